"""The plan's optimizer step phase: the update's temporaries (`ADAMW_STEP_TEMPORARIES` fp32 tensors
the size of the param group being stepped) are what torch's foreach AdamW allocates on the
installed torch, counted by the trace's own counter, with DeepSpeed's layout (one flat fp32
partition per param group, the groups stepped one after the other)."""

import torch


def test_foreach_adamw_step_allocates_the_planned_temporaries_one_group_at_a_time():
    from dsa_train.plan.estimate import ADAMW_STEP_TEMPORARIES
    from dsa_train.plan.trace import MemoryTrace

    sizes = (1000, 300)  # two flat partitions (dense, expert), the larger first
    trace = MemoryTrace()
    with trace:
        masters = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
        for m in masters:
            m.grad = torch.ones(m.numel())
        opt = torch.optim.AdamW([{"params": [m]} for m in masters], lr=1e-3, foreach=True)
        for m in masters:  # DeepSpeed creates the moments at initialization
            opt.state[m] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(m), "exp_avg_sq": torch.zeros_like(m)}
        before = sum(trace.current.values())
        start = len(trace.events)
        opt.step()
    state = 4 * 4 * sum(sizes) + 2 * 4  # masters, gradients, two moments; the step counters
    assert before == state, (before, state)
    transient = trace.category_max(start)["activations"] - before  # everything counts as activations here
    assert transient == ADAMW_STEP_TEMPORARIES * 4 * max(sizes), (transient, sizes)
    assert torch.all(masters[0] != 0)  # the update ran
