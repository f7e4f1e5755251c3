"""The fused update-time checks (docs/training.md, "Host overhead of a step"): the non-finite
check over distinct gradient buffers, the single-process engine's norm computed and read once
(clipping with it is `clip_grad_norm_` bit for bit), and the operator / host-read counter."""

from __future__ import annotations

import math

import torch

from dsa_train.trainer.nonfinite import distinct_gradients, gradients_finite_flag
from dsa_train.trainer.op_counts import StepCounts


def test_distinct_gradients_drop_views_inside_a_listed_flat_buffer():
    flat = torch.zeros(100)
    views = [flat[0:10].view(2, 5), flat[10:40], flat[40:100]]
    other = torch.ones(3)
    kept = distinct_gradients([*views, flat, other, other, flat[::2], torch.zeros(0)])
    assert len(kept) == 2 and kept[0] is flat and kept[1] is other
    assert distinct_gradients(views) == views  # no flat buffer listed: every view is checked


def test_finite_flag_sees_nan_and_inf_anywhere_in_one_read():
    flat = torch.zeros(100)
    grads = [flat[:50], flat[50:], flat, torch.ones(4, dtype=torch.bfloat16)]
    assert bool(gradients_finite_flag(distinct_gradients(grads)))
    for bad in (float("nan"), float("inf"), -float("inf")):
        flat[77] = bad
        with StepCounts() as counts:
            flag = gradients_finite_flag(distinct_gradients(grads))
            finite = bool(flag)
        assert not finite and counts.reads == {"item": 1}
        flat[77] = 0.0
    assert gradients_finite_flag([]) is None


def test_engine_norm_read_once_and_step_is_clip_grad_norm():
    from dsa_train.config import OptimConfig
    from dsa_train.stage import Stage
    from dsa_train.trainer.engine import Engine
    from dsa_train.config.schema import StageConfig

    torch.manual_seed(0)

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))

    stage = Stage.of("sparse", StageConfig(attention="sparse", trainable="all", lr=1e-2, steps=3))
    optim = OptimConfig(grad_clip=0.05)
    x = torch.randn(5, 8)
    ours, ref = model(), model()
    engine = Engine(ours, stage, optim)
    opt = torch.optim.AdamW([{"params": [p for p in ref.parameters() if p.ndim >= 2], "weight_decay": optim.weight_decay},
                             {"params": [p for p in ref.parameters() if p.ndim < 2], "weight_decay": 0.0}],
                            lr=1e-2, betas=tuple(optim.betas), eps=optim.eps)
    for _ in range(3):
        engine.backward(ours(x).square().sum())
        with StepCounts() as counts:
            # AdamW's own reads (its host-resident step counters, CPU loop) counted apart
            step = engine.optimizer.step
            engine.optimizer.step = counts.in_phase("optimizer", step)
            value = engine.grad_norm_value()
            assert engine.grad_norm_value() == value  # cached: the check and the step share one read
            got = engine.step()
            engine.optimizer.step = step
        assert got == value and counts.phase_reads["step"] == {"item": 1}
        ref(x).square().sum().backward()
        want = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), optim.grad_clip)
        opt.step()
        opt.zero_grad()
        assert math.isfinite(got) and got == float(want)
        assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), ref.parameters()))


def test_counts_see_host_reads_and_operators():
    x = torch.randn(4, 3)
    with StepCounts() as counts:
        y = (x * 2).sum()
        float(y)
        x.tolist()
        bool(y > 0)
    assert counts.reads == {"item": 2, "tolist": 1}
    assert counts.ops["aten.mul"] == 1 and counts.ops["aten.sum"] == 1 and counts.kernels >= 3


def _per_query_recall(scale, q_abs, kv_all, topk_indices, doc_start, queries) -> float:
    """The recall as it was measured before (one `dense_mass_recall` per sampled query), summed over rows."""
    import dsa_kernels as K

    total, B = 0.0, q_abs.shape[0]
    for t in queries.tolist():
        q_t = q_abs[:, t : t + 1].expand(B, t + 1, *q_abs.shape[2:])
        idx_t = topk_indices[:, t : t + 1].expand(B, t + 1, topk_indices.shape[-1])
        total += float(K.dense_mass_recall(q_t, kv_all[:, : t + 1], idx_t, scale, doc_start[:, : t + 1],
                                           torch.full((1,), t, dtype=torch.long))) * B
    return total


def test_topk_recall_in_one_pass_without_host_reads_matches_the_per_query_form(monkeypatch):
    """record_topk_recall: all sampled queries at once, no host read, the per-query form's value
    (fp32 rounding apart); under context parallelism each rank's masked share adds up to it."""
    from types import SimpleNamespace

    import dsa_train.model.mla as mla
    from dsa_train.model.mla import AttentionAux, record_topk_recall

    g = torch.Generator().manual_seed(0)
    B, T, H, D, K = 2, 48, 4, 24, 8
    q_abs, kv_all = torch.randn(B, T, H, D, generator=g), torch.randn(B, T, D, generator=g)
    doc_start = torch.zeros(B, T, dtype=torch.long)
    doc_start[1, 20:] = 20  # row 1: a second document from position 20
    scores = torch.rand(B, T, T, generator=g)
    valid = (torch.arange(T)[None, :] <= torch.arange(T)[:, None]) & (torch.arange(T)[None, :] >= doc_start[:, :, None])
    top = scores.masked_fill(~valid, -1.0).topk(K, dim=-1)
    topk_indices = torch.where(top.values >= 0, top.indices, -1).int()  # -1: fewer than K valid keys
    queries = torch.tensor([0, 3, 19, 20, 21, 30, 47])
    want = _per_query_recall(0.3, q_abs, kv_all, topk_indices, doc_start, queries)
    monkeypatch.setattr(mla, "RECALL_CHUNK_ELEMS", B * H * T * 3)  # several chunks
    aux = AttentionAux()
    with StepCounts() as counts:
        record_topk_recall(aux, 0.3, q_abs, kv_all, topk_indices, doc_start, SimpleNamespace(recall_queries=queries), None)
    assert counts.host_reads == 0
    assert aux.topk_recall_count == B * len(queries)
    assert abs(float(aux.topk_recall_sum) - want) <= 1e-5 * want
    # context parallelism: two ranks holding interleaved halves of the positions
    total, count = 0.0, 0.0
    for rank in range(2):
        positions = torch.arange(rank, T, 2)
        cp = SimpleNamespace(positions=positions)
        part = AttentionAux()
        record_topk_recall(part, 0.3, q_abs[:, positions], kv_all, topk_indices[:, positions], doc_start,
                           SimpleNamespace(recall_queries=queries), cp)
        total, count = total + float(part.topk_recall_sum), count + float(part.topk_recall_count)
    assert count == B * len(queries) and abs(total - want) <= 1e-5 * want
