"""`MemoryTrace.category_max`: each category's own maximum over the step, replayed from the trace's
allocation log with each storage's last category (the plan's terms are per-category maxima; the
total's peak can fall where a category is below its maximum)."""

import torch


def test_category_max_counts_each_storage_in_its_last_category():
    from dsa_train.plan.trace import MemoryTrace

    trace = MemoryTrace()
    a = torch.zeros(8, dtype=torch.float32)  # 32 B of activations
    trace.add(a, "activations")
    g = torch.zeros(16, dtype=torch.float32)  # made as an activation, retagged: a gradient all its life
    trace.add(g, "activations")
    trace.retag(g, "gradients")
    del a  # activations back to 0
    b = torch.zeros(4, dtype=torch.float32)
    trace.add(b, "activations")
    trace._bump(40, "activations")  # a transient on top of b: 16 + 40
    mx = trace.category_max()
    assert mx["activations"] == 56 and mx["gradients"] == 64, mx
    # counting from a later event on: what was live then, and what came after
    start = len(trace.events)
    d = torch.zeros(2, dtype=torch.float32)
    trace.add(d, "activations")
    assert trace.category_max(start)["activations"] == 24
    assert trace.category_max(start)["gradients"] == 64


def _function_in(path: str, src: str, name: str, **glob):
    """A function whose frames carry the source file name `path` (as the trace sees the stack)."""
    scope = dict(glob)
    exec(compile(src, path, "exec"), scope)
    return scope[name]


def test_an_allocation_is_categorized_by_the_nearest_project_frame():
    """What the model's code allocates is activations even beneath a kernel's frame (an activation
    checkpoint's recompute runs inside the kernel's backward when it unpacks its saved tensors:
    the 671B warm-up's recomputed layer was counted as 2.67 GiB of DSA buffers that way); what the
    kernels' own code allocates is DSA buffers."""
    from dsa_train.plan.trace import MemoryTrace

    model_code = _function_in("/x/dsa_train/model/layer.py", "def layer():\n    return torch.empty(1000)\n",
                              "layer", torch=torch)
    kernel_code = _function_in(
        "/x/dsa_kernels/ops/kl/function.py",
        "def backward(recompute):\n    mine = torch.empty(10)\n    return mine, recompute()\n", "backward", torch=torch)
    trace = MemoryTrace()
    with trace:
        mine, recomputed = kernel_code(model_code)
    categories = {n: c for n, c, *_ in trace.live.values()}
    assert categories[4 * 10] == "dsa_buffers" and categories[4 * 1000] == "activations", categories


def test_logsumexp_counts_its_own_temporary():
    """`torch.logsumexp` allocates a copy of its input inside itself (`(x - amax).exp_()`), which
    its outputs do not show: the trace adds it as a transient of the op's category (the loss's
    forward holds it beside its fp32 row chunk: the demo's activations' maximum). The size is the
    installed torch's, measured by its profiler on real tensors."""
    from torch.profiler import ProfilerActivity, profile

    from dsa_train.plan.trace import MemoryTrace, _logsumexp_temporary

    x = torch.randn(64, 512)  # 128 KiB, made before the trace: not counted
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.logsumexp(x, dim=-1)
    largest = max(e.self_cpu_memory_usage for e in prof.key_averages())
    assert largest == _logsumexp_temporary(x) == x.numel() * 4, (largest, _logsumexp_temporary(x))
    trace = MemoryTrace()
    with trace:
        y = torch.logsumexp(x, dim=-1)
    assert trace.category_max()["activations"] == y.untyped_storage().nbytes() + x.numel() * 4
