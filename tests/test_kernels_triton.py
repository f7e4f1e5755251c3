"""Triton DSA kernels against the PyTorch references: values and gradients.

On the CPU the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set here before
triton is imported); shapes are tiny so the file stays fast. On a GPU the same tests run the kernels
compiled; the realistic-shape GPU checks are `dsa-train gpu-check` (tests/test_gpu_check.py).
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dsa_kernels as K  # noqa: E402
from dsa_kernels import (  # noqa: E402
    dense_indexer_kl_ref,
    doc_starts_from_position_ids,
    indexer_topk_ref,
    sparse_indexer_kl_ref,
    sparse_mla_ref,
)
from dsa_kernels.ops.indexer_kl.function import dense_indexer_kl_triton, sparse_indexer_kl_triton  # noqa: E402
from dsa_kernels.ops.indexer_topk import (  # noqa: E402
    index_scores_ref,
    indexer_topk_at_positions_ref,
    quantize_fp8_groups,
    topk_from_scores,
)
from dsa_kernels.ops.indexer_topk.kernel import (  # noqa: E402
    CANDIDATE_CAP,
    _select_chunk,
    index_scores_triton,
    indexer_topk_triton,
)
from dsa_kernels.ops.sparse_mla.function import sparse_mla_triton  # noqa: E402

DEV = "cuda" if HAS_CUDA else "cpu"


def doc_start(lengths_per_row):
    rows = [torch.cat([torch.arange(n) for n in lengths]) for lengths in lengths_per_row]
    return doc_starts_from_position_ids(torch.stack(rows)).to(DEV)


def grid_values(shape, lo=-2, hi=2, denom=4, seed=0):
    """Values on a coarse grid (multiples of 1/denom): dot products and weighted sums are exact
    in fp32, so scores tie exactly where they tie mathematically and selections compare exactly."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(lo * denom, hi * denom + 1, shape, generator=g).float() / denom).to(DEV)


def causal_indices(B, T, K, seed=0, drop=0.3, empty_rows=()):
    """Random selections of keys s <= t (t < K rows are padded with -1), some slots dropped."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.full((B, T, K), -1, dtype=torch.int32)
    for b in range(B):
        for t in range(T):
            n = min(K, t + 1)
            sel = torch.randperm(t + 1, generator=g)[:n].to(torch.int32)
            keep = torch.rand(n, generator=g) >= drop
            idx[b, t, :n] = torch.where(keep, sel, torch.full_like(sel, -1))
    for b, t in empty_rows:
        idx[b, t] = -1
    return idx.to(DEV)


# ----------------------------------------------------------------------------- sparse MLA
@pytest.mark.parametrize("d_v,d_r,H,K", [(32, 16, 3, 70), (64, 0, 2, 9)])
def test_sparse_mla_values_and_grads(d_v, d_r, H, K):
    torch.manual_seed(0)
    B, T = 2, 23
    D = d_v + d_r
    q = torch.randn(B, T, H, D, device=DEV, requires_grad=True)
    kv = torch.randn(B, T, D, device=DEV, requires_grad=True)
    idx = causal_indices(B, T, K, empty_rows=[(0, 4), (1, 0)])
    scale = D**-0.5
    outs = {}
    for name, fn in (("triton", sparse_mla_triton), ("ref", sparse_mla_ref)):
        o, lse = fn(q, kv, idx, scale, d_v)
        go = torch.randn(o.shape, generator=torch.Generator().manual_seed(1)).to(DEV)
        glse = torch.randn(lse.shape, generator=torch.Generator().manual_seed(2)).to(DEV)
        loss = (o * go).sum() + (torch.where(torch.isfinite(lse), lse, 0) * glse).sum()
        dq, dkv = torch.autograd.grad(loss, (q, kv))
        outs[name] = (o, lse, dq, dkv)
    o, lse, dq, dkv = outs["triton"]
    ro, rlse, rdq, rdkv = outs["ref"]
    assert torch.isfinite(o).all() and torch.isfinite(dq).all() and torch.isfinite(dkv).all()
    torch.testing.assert_close(o, ro, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, rlse, rtol=1e-5, atol=1e-5)  # -inf on the empty rows in both
    assert torch.isneginf(lse[0, 4]).all() and (o[0, 4] == 0).all() and (o[1, 0] == 0).all()
    torch.testing.assert_close(dq, rdq, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dkv, rdkv, rtol=1e-4, atol=1e-5)


def test_sparse_mla_forward_value_split_plan_matches_reference():
    """The forward as planned for sm_100 (VALUE_SPLIT = 2: two programs per head block, each owning
    two value quarters, the logits in both) equals the reference, odd head count included."""
    from dsa_kernels._triton_common import planning_for

    torch.manual_seed(3)
    B, T, H, d_v, d_r, K = 2, 19, 5, 48, 16, 12
    q = torch.randn(B, T, H, d_v + d_r, device=DEV)
    kv = torch.randn(B, T, d_v + d_r, device=DEV)
    idx = causal_indices(B, T, K, empty_rows=[(1, 3)])
    with planning_for(100):
        o, lse = sparse_mla_triton(q, kv, idx, 0.2, d_v)
    ro, rlse = sparse_mla_ref(q, kv, idx, 0.2, d_v)
    torch.testing.assert_close(o, ro, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, rlse, rtol=1e-5, atol=1e-5)
    assert torch.isneginf(lse[1, 3]).all() and (o[1, 3] == 0).all()


@pytest.mark.slow
def test_sparse_mla_deterministic_backward(monkeypatch):
    """Under torch.use_deterministic_algorithms(True) the backward stages every dkv contribution and
    reduces in a fixed order (no atomics into shared rows): same gradients as the reference, and
    bitwise the same on a rerun. A small stage budget forces several query chunks."""
    import dsa_kernels.ops.sparse_mla.kernel as smk

    monkeypatch.setattr(smk, "DETERMINISTIC_STAGE_ELEMS", 2 * 9 * 40 * 5)  # deterministic_plan: 2-token chunks, one 16-slot window
    torch.manual_seed(0)
    B, T, H, d_v, d_r, K = 2, 19, 3, 32, 8, 9
    q = torch.randn(B, T, H, d_v + d_r, device=DEV, requires_grad=True)
    kv = torch.randn(B, T, d_v + d_r, device=DEV, requires_grad=True)
    idx = causal_indices(B, T, K, empty_rows=[(1, 3)])
    idx[0, 10, :3] = 4  # a key selected three times by one query
    go = torch.randn(B, T, H, d_v, generator=torch.Generator().manual_seed(1)).to(DEV)

    def grads(fn):
        o, lse = fn(q, kv, idx, (d_v + d_r) ** -0.5, d_v)
        return torch.autograd.grad((o * go).sum() + lse.sum(), (q, kv))

    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        first, second = grads(sparse_mla_triton), grads(sparse_mla_triton)
    finally:
        torch.use_deterministic_algorithms(was)
    ref = grads(sparse_mla_ref)
    for a, b, r in zip(first, second, ref):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-5)


def test_sparse_mla_never_reads_empty_slots_as_token_0():
    B, T, H, D, d_v = 1, 5, 2, 48, 32
    q = torch.randn(B, T, H, D, device=DEV)
    kv = torch.randn(B, T, D, device=DEV, requires_grad=True)
    kv.data[0, 0] = float("nan")  # token 0 is poison: any read of it shows
    idx = torch.tensor([[[1, -1, -1], [1, 2, -1], [-1, -1, -1], [3, 4, -1], [4, -1, 2]]], dtype=torch.int32, device=DEV)
    o, lse = sparse_mla_triton(q, kv, idx, 0.1, d_v)
    assert torch.isfinite(o).all()
    (dkv,) = torch.autograd.grad(o.sum(), (kv,))
    assert (dkv[0, 0] == 0).all() and torch.isfinite(dkv[0, 1:]).all()


def test_sparse_mla_bf16_576_dims():
    torch.manual_seed(0)
    B, T, H, K, d_v = 1, 6, 2, 16, 512
    q = torch.randn(B, T, H, 576, device=DEV).bfloat16().requires_grad_()
    kv = torch.randn(B, T, 576, device=DEV).bfloat16().requires_grad_()
    idx = causal_indices(B, T, K, drop=0.0)
    o, lse = sparse_mla_triton(q, kv, idx, 576**-0.5, d_v)
    ro, rlse = sparse_mla_ref(q, kv, idx, 576**-0.5, d_v)
    assert o.dtype == torch.bfloat16
    torch.testing.assert_close(o.float(), ro.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse, rlse, rtol=1e-3, atol=1e-3)
    dq, dkv = torch.autograd.grad(o.float().sum(), (q, kv))
    rdq, rdkv = torch.autograd.grad(ro.float().sum(), (q, kv))
    torch.testing.assert_close(dq.float(), rdq.float(), rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(dkv.float(), rdkv.float(), rtol=5e-2, atol=5e-2)


# ----------------------------------------------------------------------------- indexer + top-k
@pytest.mark.slow
@pytest.mark.parametrize("chunk_size", [None, 16])
def test_indexer_topk_matches_reference_docs_and_short_rows(chunk_size):
    B, T, H, D, topk = 2, 70, 3, 24, 12  # T and D not multiples of the tiles; t < k rows
    q, k, w = grid_values((B, T, H, D), seed=1), grid_values((B, T, D), seed=2), grid_values((B, T, H), seed=3)
    ds = doc_start([[30, 5, 35], [70]])
    idx, val = indexer_topk_triton(q, k, w, ds, topk, chunk_size=chunk_size)
    ridx, rval = indexer_topk_ref(q, k, w, ds, topk)
    assert idx.dtype == torch.int32
    assert torch.equal(idx, ridx)
    torch.testing.assert_close(val, rval)
    # never across a document boundary, never in the future
    t = torch.arange(T, device=DEV)[None, :, None]
    sel = idx >= 0
    assert ((idx <= t) | ~sel).all() and ((idx >= ds[..., None]) | ~sel).all()
    assert (sel.sum(-1) == torch.clamp(t[..., 0] - ds + 1, max=topk)).all()


def test_indexer_topk_many_ties_and_negative_zero():
    # integer inputs in {-1, 0, 1}: most scores tie, ReLU gives exact zeros, negative weights -0.0
    B, T, H, D, topk = 1, 40, 2, 16, 10
    q = grid_values((B, T, H, D), lo=-1, hi=1, denom=1, seed=4)
    k = grid_values((B, T, D), lo=-1, hi=1, denom=1, seed=5)
    w = grid_values((B, T, H), lo=-1, hi=1, denom=1, seed=6)
    ds = doc_start([[T]])
    idx, val = indexer_topk_triton(q, k, w, ds, topk)
    ridx, rval = indexer_topk_ref(q, k, w, ds, topk)
    assert torch.equal(idx, ridx) and torch.equal(val, rval)


@pytest.mark.slow
@pytest.mark.parametrize("dtype,topk,rank", [(torch.float32, 12, 1), (torch.bfloat16, 64, 0)])
def test_indexer_topk_context_parallel_positions_use_the_kernel(monkeypatch, dtype, topk, rank):
    # a CP rank's queries (chunks r and 2*cp-1-r of the zigzag layout, parallel/context.py) over
    # the whole sequence, through the entry point on the Triton path; odd H_I and D_I, packed
    # documents, several key spans per query tile, and one key whose scores are non-finite
    from dsa_train.parallel.context import local_positions

    monkeypatch.setenv("DSA_KERNELS", "triton")
    B, T, H, D, cp = 2, 72, 3, 24, 3
    q, k, w = grid_values((B, T, H, D), seed=7), grid_values((B, T, D), seed=8), grid_values((B, T, H), seed=9)
    k[1, 40] = float("inf")  # row 1: key 40 scores inf/NaN for every query -> never selected
    q, k = q.to(dtype), k.to(dtype)
    ds = doc_start([[30, 5, 37], [72]])
    p = local_positions(T, cp, rank, device=DEV)
    ridx, rval = indexer_topk_at_positions_ref(q[:, p], k, w[:, p], ds, topk, p)
    idx, val = K.indexer_topk(q[:, p], k, w[:, p], ds, topk, query_positions=p)
    assert torch.equal(idx, ridx) and torch.equal(val, rval)
    assert not (idx[1] == 40).any() and (idx[0] == 40).any()  # dropped only where non-finite
    idx, val = indexer_topk_triton(q[:, p], k, w[:, p], ds, topk, chunk_size=9, query_positions=p, key_span=64)
    assert torch.equal(idx, ridx) and torch.equal(val, rval)
    with pytest.raises(ValueError, match="query_positions must be"):
        K.indexer_topk(q[:, :8], k, w[:, :8], ds, topk, query_positions=torch.arange(9, device=DEV))


def test_radix_select_low_bit_differences_and_multiple_tiles():
    # scores that differ only in the last mantissa bits, many exact ties, -inf holes, and a row
    # longer than the selection tile
    base = torch.full((1, 5, 700), 1.0)
    steps = torch.randint(0, 4, base.shape, generator=torch.Generator().manual_seed(0))
    scores = base.clone()
    for _ in range(3):
        scores = torch.where(steps > 0, torch.nextafter(scores, torch.tensor(2.0)), scores)
        steps = steps - 1
    scores[0, 1, ::3] = float("-inf")
    scores[0, 2] = float("-inf")  # no valid key
    scores[0, 3, 10:] = float("-inf")  # fewer valid keys than k
    scores[0, 4] = -0.0
    scores[0, 4, 100:] = 0.0
    for topk in (1, 64, 300):
        idx, val = _select_chunk(scores.to(DEV), 5, topk, block=128)
        ridx, rval = topk_from_scores(scores, topk, key_offset=5)
        assert torch.equal(idx.cpu(), ridx) and torch.equal(val.cpu(), rval)


@pytest.mark.parametrize("composite_ms,repair_ms", [(3.0, 5.0), (0.5, 5.0), (3.0, 0.2)])
def test_select_autotuning_as_on_a_gpu(monkeypatch, tmp_path, composite_ms, repair_ms):
    """`_select_chunk` driven as on a GPU (timing forced, the interpreter runs the launches): the
    other radix config and the four torch.topk paths are verified against the default (same index
    sets), all six are timed into the real outputs, the fastest by a fake clock (b2048-w4, or the
    composite or repair path when it is faster) is chosen and remembered, and the selection equals
    the reference's."""
    from dsa_kernels import autotune
    from dsa_kernels.ops.indexer_topk import kernel as TK

    monkeypatch.setenv("DSA_AUTOTUNE_CACHE", str(tmp_path / "autotune.json"))
    monkeypatch.setattr(autotune, "_MEMORY", {})
    timed, verified = [], []
    real_pick = autotune.pick

    def pick_as_on_a_gpu(kernel, key, names, build, on_gpu, device_id="", bench=None, verify=None):
        def fake_bench(launch):
            launch.run()
            if isinstance(launch, TK._CompositeSelect):
                timed.append(launch.name)
                return {TK.COMPOSITE_CONFIG: composite_ms, TK.REPAIR_CONFIG: repair_ms}.get(launch.name, 5.0)
            timed.append((launch.args["BLOCK"], launch.num_warps))
            return 1.0 if launch.num_warps == 4 else 2.0

        def verify_logged(name):
            verified.append(name)
            return verify(name)

        return real_pick(kernel, key, names, build, True, "test GPU", fake_bench, verify_logged)

    monkeypatch.setattr(TK.autotune, "pick", pick_as_on_a_gpu)
    g = torch.Generator().manual_seed(5)
    scores = torch.randn(1, 6, 300, generator=g)
    scores[0, 1, ::4] = float("-inf")
    scores[0, 2, 20:] = float("-inf")  # fewer valid keys than k
    scores[0, 3, 100:200] = 0.25  # ties across the threshold
    idx, val = TK._select_chunk(scores.to(DEV), 3, 32)
    ridx, rval = topk_from_scores(scores, 32, key_offset=3)
    assert torch.equal(idx.cpu(), ridx) and torch.equal(val.cpu(), rval)
    assert verified == ["b2048-w4", TK.COMPOSITE_CONFIG, TK.FIX_TIES_CONFIG, TK.REPAIR_CONFIG, TK.REPAIR_COUNT_CONFIG]
    # a 300-score row: one block at each radix config
    assert sorted(timed, key=str) == sorted([(512, 4), (512, 8), TK.COMPOSITE_CONFIG, TK.FIX_TIES_CONFIG,
                                             TK.REPAIR_CONFIG, TK.REPAIR_COUNT_CONFIG], key=str)
    want = TK.COMPOSITE_CONFIG if composite_ms < 1.0 else TK.REPAIR_CONFIG if repair_ms < 1.0 else "b2048-w4"
    assert list(autotune.choices("indexer_topk_select").values()) == [want]
    idx2, val2 = TK._select_chunk(scores.to(DEV), 3, 32)  # the remembered choice, nothing timed again
    assert torch.equal(idx2.cpu(), ridx) and torch.equal(val2.cpu(), rval) and len(timed) == 6


def test_radix_select_never_selects_non_finite_scores():
    # +inf and NaN scores (from non-finite indexer inputs) are dropped as the reference drops them:
    # never selected, the k best finite keys are, and the -1 slots stay at the row's tail
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(1, 4, 300, generator=g)
    scores[0, 0, ::7] = float("inf")
    scores[0, 1, ::5] = float("nan")
    scores[0, 2, :290] = float("nan")  # only 10 finite keys
    scores[0, 3, 50:] = float("-inf")
    scores[0, 3, :50:2] = float("inf")
    for topk in (8, 64):
        idx, val = _select_chunk(scores.to(DEV), 0, topk, block=128)
        ridx, rval = topk_from_scores(scores, topk)
        assert torch.equal(idx.cpu(), ridx) and torch.equal(val.cpu(), rval)
        sel = idx.cpu().long()
        picked = torch.gather(scores, -1, sel.clamp(min=0))
        assert torch.isfinite(picked[sel >= 0]).all()
        n_valid = (sel >= 0).sum(-1)
        assert (sel[..., :][torch.arange(topk)[None, None] >= n_valid[..., None]] == -1).all()  # -1 tail
        assert n_valid[0, 2] == min(topk, 10)


def test_radix_select_bf16_scores_two_passes():
    # bf16 score blocks: selection over the 16 bits of the bf16 key (two 8-bit passes) equals the
    # reference's selection on the same bf16 scores: ties (many, after rounding) to the lower
    # index, +inf / NaN dropped, -inf holes, rows with fewer valid keys than k, several tiles
    g = torch.Generator().manual_seed(5)
    scores = (1.0 + torch.rand(1, 5, 300, generator=g) * 2.0**-5).bfloat16()  # ~4 bf16 values
    scores[0, 0, ::7] = float("inf")
    scores[0, 1, ::5] = float("nan")
    scores[0, 2, 20:] = float("-inf")  # 20 valid keys
    scores[0, 3] = -scores[0, 3]  # negative keys
    scores[0, 4, 100:] = -0.0
    scores[0, 4, :100] = 0.0
    for topk in (1, 64):
        idx, val = _select_chunk(scores.to(DEV), 3, topk, block=128)
        ridx, rval = topk_from_scores(scores.float(), topk, key_offset=3)
        assert torch.equal(idx.cpu(), ridx) and torch.equal(val.cpu(), rval)
    # end to end: bf16 score blocks in the driver = the reference's top-k of the rounded scores
    B, T, H, D, topk = 1, 45, 3, 24, 16
    q, k, w = grid_values((B, T, H, D), seed=12), grid_values((B, T, D), seed=13), grid_values((B, T, H), seed=14)
    ds = doc_start([[19, 26]])
    idx, val = indexer_topk_triton(q, k, w, ds, topk, score_dtype=torch.bfloat16)
    ref, k0 = index_scores_ref(q, k, w, ds, 0, T)  # exact (grid values): the rounding is the same
    assert not torch.equal(ref.bfloat16().float(), ref)  # the scores need more than bf16's 8 bits
    ridx, rval = topk_from_scores(ref.bfloat16().float(), topk, key_offset=k0)
    assert torch.equal(idx, ridx) and torch.equal(val, rval)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_radix_select_candidate_overflow_falls_back_to_streaming(dtype):
    # rows whose threshold bin (top digit of the k-th largest key) holds more keys than the
    # candidate buffer take the streaming path and still select exactly; the other rows refine
    # from the candidates. cap=32 makes small rows overflow; the last row overflows the default CAP.
    g = torch.Generator().manual_seed(7)
    scores = torch.randn(1, 5, 300, generator=g)
    scores[0, 0] = scores[0, 0] * 0.1
    scores[0, 0, 40:240] = 0.5  # 200 exact ties above every other key: the k-th largest for k <= 200
    scores[0, 1] = 1.0 + torch.rand(300, generator=g) * 2.0**-6  # one top bin, no exact ties
    scores[0, 2, 100:] = float("-inf")  # 100 valid keys, k beyond them
    scores[0, 3, ::3] = 0.0  # 100 exact zeros
    scores = scores.to(dtype)
    for topk, cap in ((16, 32), (64, 32), (120, 32), (16, CANDIDATE_CAP)):
        counts = []
        idx, val = _select_chunk(scores.to(DEV), 2, topk, block=128, cap=cap, bin_count_out=counts)
        ridx, rval = topk_from_scores(scores.float(), topk, key_offset=2)
        assert torch.equal(idx.cpu(), ridx) and torch.equal(val.cpu(), rval)
        used = counts[0].cpu()[0]  # candidates refined per row, -1: streamed
        assert (used <= cap).all()
        if cap == 32:
            assert used[0] == -1 and used[1] == -1  # the tie rows streamed
            assert (used[2:] >= 0).any()  # other rows refined from candidates, in the same launch
        else:
            assert (used >= 0).all()
    # heavy ties beyond the default CAP: 5000 exact zeros under 40 positive keys, k = 64
    row = torch.zeros(1, 2, 5000)
    row[0, :, 1000:1040] = torch.rand(40, generator=g) + 1.0
    row[0, 1, 4000:] = float("-inf")  # 3960 valid keys: the zero bin fits in CAP
    counts = []
    idx, val = _select_chunk(row.to(dtype).to(DEV), 0, 64, bin_count_out=counts)
    ridx, rval = topk_from_scores(row.to(dtype).float(), 64)
    assert torch.equal(idx.cpu(), ridx) and torch.equal(val.cpu(), rval)
    assert counts[0][0, 0] == -1 and counts[0][0, 1] == 3960  # 3960 zeros in the bin (<= CAP)


def test_topk_work_reads_each_score_row_at_most_twice():
    # the analysis column of the shipped top-k launches (671B shapes, T = 128K): two reads of the
    # score row plus the candidate buffer's traffic, against the streaming design's PASSES + 1
    from dsa_kernels.registry import cases

    topk_cases = {c.launch.args["S"].dtype: c for c in cases(["indexer_topk"]) if c.kernel_name == "_radix_topk_kernel"}
    assert set(topk_cases) == {torch.float32, torch.bfloat16}
    for dtype, case in topk_cases.items():
        a, work = case.launch.args, case.work
        row_bytes = a["W_LEN"] * dtype.itemsize
        candidate_bytes = a["CAP"] * (torch.int32.itemsize + torch.float32.itemsize)
        assert a["W_LEN"] == 131072 and a["CAP"] == CANDIDATE_CAP
        assert work.read_bytes <= 2 * row_bytes + a["PASSES"] * candidate_bytes
        assert work.read_bytes < (a["PASSES"] + 1) * row_bytes  # fewer bytes than streaming the row
        assert work.useful_flops == 0 and work.anchor["read_bytes"] == row_bytes
    score_cases = [c for c in cases(["indexer_scores"]) if c.kernel_name != "_fp8_quant_kernel"]  # the FP8 path's q_I pass
    assert score_cases
    for case in score_cases:  # scores: 2 H_I D_I per causal key, issued within 1%
        a, work = case.launch.args, case.work
        causal_keys = sum(t + 1 for t in range(a["r0"], a["r1"])) / (a["r1"] - a["r0"])
        assert work.useful_flops == pytest.approx(2 * a["HI"] * a["DI"] * causal_keys)
        assert work.useful_flops <= work.issued_flops <= 1.01 * work.useful_flops
        assert work.write_bytes == a["W_LEN"] * a["S"].element_size()


def test_indexer_fp8_scores_match_dequantized_reference():
    B, T, H, D = 1, 33, 4, 160  # two channel groups, the second partial
    g = torch.Generator().manual_seed(0)
    q, k, w = torch.randn(B, T, H, D, generator=g), torch.randn(B, T, D, generator=g), torch.rand(B, T, H, generator=g)
    q, k, w = q.to(DEV), k.to(DEV), w.to(DEV)
    ds = doc_start([[20, 13]])
    q8, qs = quantize_fp8_groups(q)
    k8, ks = quantize_fp8_groups(k)
    assert qs.shape == (B, T, H, 2) and ks.shape == (B, T, 2)
    deq = lambda x8, s: (x8.float().view(*x8.shape[:-1], -1) * s.repeat_interleave(128, -1)[..., :D])  # noqa: E731
    s8, k0 = index_scores_triton(q, k, w, ds, 0, T, fp8=True)
    ref, rk0 = index_scores_ref(deq(q8, qs), deq(k8, ks), w, ds, 0, T)
    assert k0 == rk0
    torch.testing.assert_close(s8, ref, rtol=1e-4, atol=1e-4)
    exact, _ = index_scores_ref(q, k, w, ds, 0, T)
    finite = torch.isfinite(exact)
    assert ((s8 - exact)[finite].abs().max() / exact[finite].abs().max()) < 0.1


# ----------------------------------------------------------------------------- indexer KL
def _indexer_inputs(B, T, HI, DI, seed=0):
    g = torch.Generator().manual_seed(seed)
    qi = torch.randn(B, T, HI, DI, generator=g).to(DEV).requires_grad_()
    ki = torch.randn(B, T, DI, generator=g).to(DEV).requires_grad_()
    wi = torch.randn(B, T, HI, generator=g).to(DEV).requires_grad_()
    return qi, ki, wi


def _check_kl(res, ref, inputs):
    (kl, st), (rkl, rst) = res, ref
    torch.testing.assert_close(kl, rkl, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(st["kl_uniform"].to(DEV), rst["kl_uniform"].to(DEV), rtol=1e-5, atol=1e-4)
    assert float(st["queries"]) == float(rst["queries"])
    grads = torch.autograd.grad(kl * 0.7, inputs)
    rgrads = torch.autograd.grad(rkl * 0.7, inputs)
    for a, b in zip(grads, rgrads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_sparse_indexer_kl_values_and_grads():
    B, T, HI, DI, H, D, K = 2, 21, 3, 16, 3, 40, 40  # K > T: every row has -1 slots
    qi, ki, wi = _indexer_inputs(B, T, HI, DI)
    g = torch.Generator().manual_seed(1)
    qm, kv = torch.randn(B, T, H, D, generator=g).to(DEV), torch.randn(B, T, D, generator=g).to(DEV)
    idx = causal_indices(B, T, K, empty_rows=[(0, 5)])
    _, lse = sparse_mla_ref(qm, kv, idx, 0.2, 32)
    res = sparse_indexer_kl_triton(qi, ki, wi, idx, qm, kv, lse, 0.2)
    ref = sparse_indexer_kl_ref(qi, ki, wi, idx, qm, kv, lse, 0.2)
    _check_kl(res, ref, (qi, ki, wi))


def test_sparse_indexer_kl_without_grad():
    qi, ki, wi = (x.detach() for x in _indexer_inputs(1, 9, 2, 16))
    qm, kv = torch.randn(1, 9, 2, 24, device=DEV), torch.randn(1, 9, 24, device=DEV)
    idx = causal_indices(1, 9, 4)
    _, lse = sparse_mla_ref(qm, kv, idx, 0.3, 16)
    kl, _ = sparse_indexer_kl_triton(qi, ki, wi, idx, qm, kv, lse, 0.3)
    rkl, _ = sparse_indexer_kl_ref(qi, ki, wi, idx, qm, kv, lse, 0.3)
    assert not kl.requires_grad
    torch.testing.assert_close(kl, rkl, rtol=1e-5, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("K", [1, 5, 32, 64])
def test_sparse_indexer_kl_small_k(K):
    # K <= 64: one or two slot tiles of the KL kernel, one tile of the target kernel
    B, T, HI, DI, H, D = 1, 70, 2, 16, 2, 24
    qi, ki, wi = _indexer_inputs(B, T, HI, DI, seed=K)
    g = torch.Generator().manual_seed(K)
    qm, kv = torch.randn(B, T, H, D, generator=g).to(DEV), torch.randn(B, T, D, generator=g).to(DEV)
    idx = causal_indices(B, T, K, seed=K, drop=0.2)
    _, lse = sparse_mla_ref(qm, kv, idx, 0.25, 16)
    res = sparse_indexer_kl_triton(qi, ki, wi, idx, qm, kv, lse, 0.25)
    ref = sparse_indexer_kl_ref(qi, ki, wi, idx, qm, kv, lse, 0.25)
    _check_kl(res, ref, (qi, ki, wi))


def test_sparse_indexer_kl_target_head_blocks_and_token_chunks(monkeypatch):
    # Sigma_h P formed once per token by the target kernel: 130 main heads (two head blocks of
    # 128, the second partial, summed in order in the scratch), D = 40 split 32 + 8, bf16 main
    # inputs, K = 48 with -1 tails and empty rows, and tokens in chunks of 6 (the scratch reused)
    import dsa_kernels.ops.indexer_kl.function as kl_function

    B, T, HI, DI, H, D, K = 2, 17, 3, 16, 130, 40, 48
    monkeypatch.setattr(kl_function, "TARGET_CHUNK_ELEMS", B * K * 6)
    qi, ki, wi = _indexer_inputs(B, T, HI, DI, seed=11)
    g = torch.Generator().manual_seed(11)
    qm = torch.randn(B, T, H, D, generator=g).to(DEV).bfloat16()
    kv = torch.randn(B, T, D, generator=g).to(DEV).bfloat16()
    idx = causal_indices(B, T, K, seed=11, drop=0.3)
    idx[1, 4] = -1
    _, lse = sparse_mla_ref(qm, kv, idx, 0.15, 32)
    res = sparse_indexer_kl_triton(qi, ki, wi, idx, qm, kv, lse, 0.15)
    ref = sparse_indexer_kl_ref(qi, ki, wi, idx, qm, kv, lse, 0.15)
    _check_kl(res, ref, (qi, ki, wi))


def test_slot_counts_stop_at_the_minus_one_tail():
    from dsa_kernels.ops.sparse_mla.kernel import slot_counts

    idx = torch.tensor([[[3, -1, 5, -1, -1], [-1, -1, -1, -1, -1], [0, 1, 2, 3, 4], [-1, -1, -1, -1, 7]]],
                       dtype=torch.int32)
    assert slot_counts(idx).tolist() == [[3, 0, 5, 5]]


def _relative_error(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("kind", ["sparse", "dense"])
def test_kl_gradients_precision_bf16(kind):
    """The precision contract of the KL gradients with bf16 inputs (the model's dtype): within 1%
    (relative L2) of the gradients computed in float64 on the same bf16 values. Compiled, the
    gradient dots take bf16 operands with fp32 accumulation; interpreted, fp32."""
    B, T, HI, DI, H, D, K = 1, 40, 4, 32, 4, 48, 24
    g = torch.Generator().manual_seed(7)
    qi, ki, wi = (torch.randn(*s, generator=g).bfloat16().to(DEV) for s in ((B, T, HI, DI), (B, T, DI), (B, T, HI)))
    wi = wi.float()
    qm = torch.randn(B, T, H, D, generator=g).bfloat16().to(DEV)
    kv = torch.randn(B, T, D, generator=g).bfloat16().to(DEV)
    scale = D**-0.5
    ds = doc_start([[25, 15]])
    if kind == "sparse":
        idx = causal_indices(B, T, K, seed=7, drop=0.1)
        _, lse = sparse_mla_ref(qm.double(), kv.double(), idx, scale, 32)
        run = lambda q, k, w, cast: sparse_indexer_kl_triton(q, k, w, idx, qm, kv, lse.float(), scale) if cast else \
            sparse_indexer_kl_ref(q, k, w, idx, qm.double(), kv.double(), lse, scale)  # noqa: E731
    else:
        km = kv[:, :, None, :]
        run = lambda q, k, w, cast: dense_indexer_kl_triton(q, k, w, qm, km, scale, ds) if cast else \
            dense_indexer_kl_ref(q, k, w, qm.double(), km.double(), scale, ds)  # noqa: E731
    ins = [x.clone().requires_grad_() for x in (qi, ki, wi)]
    kl, _ = run(*ins, True)
    grads = torch.autograd.grad(kl, ins)
    ins64 = [x.detach().double().requires_grad_() for x in (qi, ki, wi)]
    kl64, _ = run(*ins64, False)
    grads64 = torch.autograd.grad(kl64, ins64)
    assert grads[0].dtype == torch.bfloat16 and grads[1].dtype == torch.bfloat16
    assert abs(float(kl.detach()) - float(kl64.detach())) <= 1e-3 * abs(float(kl64.detach())) + 1e-4
    for name, a, b in zip(("q_I", "k_I", "w"), grads, grads64):
        assert _relative_error(a, b) < 1e-2, (name, _relative_error(a, b))


@pytest.mark.parametrize("form", ["mha", "mqa"])
def test_dense_indexer_kl_values_and_grads(form):
    B, T, HI, DI, H = 2, 70, 2, 16, 3  # T not a multiple of the 64-row tiles; two tiles
    D = 24 if form == "mha" else 80
    qi, ki, wi = _indexer_inputs(B, T, HI, DI)
    g = torch.Generator().manual_seed(1)
    qm = torch.randn(B, T, H, D, generator=g).to(DEV)
    km = torch.randn(B, T, H if form == "mha" else 1, D, generator=g).to(DEV)
    ds = doc_start([[40, 30], [5, 65]])
    res = dense_indexer_kl_triton(qi, ki, wi, qm, km, D**-0.5, ds)
    ref = dense_indexer_kl_ref(qi, ki, wi, qm, km, D**-0.5, ds)
    _check_kl(res, ref, (qi, ki, wi))


# ----------------------------------------------------------------------------- dispatch + model
def test_dispatcher_routes_by_device_and_env(monkeypatch):
    q = torch.randn(1, 4, 2, 32)
    kv = torch.randn(1, 4, 32)
    idx = causal_indices(1, 4, 2).cpu()
    calls = []
    import dsa_kernels.ops.sparse_mla.function as smt

    monkeypatch.setattr(smt, "sparse_mla_triton", lambda *a, **k: calls.append("triton") or sparse_mla_ref(*a))
    monkeypatch.setenv("DSA_KERNELS", "ref")
    K.sparse_mla(q, kv, idx, 0.1, 16)
    monkeypatch.setenv("DSA_KERNELS", "auto")
    K.sparse_mla(q, kv, idx, 0.1, 16)
    assert calls == []  # CPU tensors -> reference
    monkeypatch.setenv("DSA_KERNELS", "triton")
    K.sparse_mla(q, kv, idx, 0.1, 16)
    assert calls == ["triton"]
    monkeypatch.setenv("DSA_KERNELS", "bogus")
    with pytest.raises(ValueError):
        K.sparse_mla(q, kv, idx, 0.1, 16)


def assert_model_step_triton_matches_ref(monkeypatch, attention: str, doc_lengths: list[int], **config) -> set[str]:
    """One step of a tiny model (20 tokens packed as documents of `doc_lengths`, LM + indexer loss,
    `attention` "sparse" or "dense") with DSA_KERNELS=triton and =ref: the same losses and
    gradients. -> the names of the parameters that got a gradient."""
    import dsa_train

    def run(mode):
        monkeypatch.setenv("DSA_KERNELS", mode)
        torch.manual_seed(0)
        model = dsa_train.DSAForCausalLM(dsa_train.tiny_config(index_n_heads=4, **config))
        x = torch.randint(0, 4096, (1, 20), generator=torch.Generator().manual_seed(0))
        pos = torch.cat([torch.arange(n) for n in doc_lengths])[None]
        out = model(x, attention=attention, labels=x, indexer_loss=True, position_ids=pos)
        (out.lm_loss + out.indexer_loss).backward()
        return out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    out_t, g_t = run("triton")
    out_r, g_r = run("ref")
    torch.testing.assert_close(out_t.lm_loss, out_r.lm_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_t.indexer_loss, out_r.indexer_loss, rtol=1e-5, atol=1e-5)
    assert g_t.keys() == g_r.keys()
    for n in g_r:
        torch.testing.assert_close(g_t[n], g_r[n], rtol=1e-3, atol=1e-5, msg=n)
    return set(g_r)


@pytest.mark.slow
def test_model_sparse_step_through_triton_kernels(monkeypatch):
    assert_model_step_triton_matches_ref(monkeypatch, "sparse", [12, 8], index_topk=8, num_hidden_layers=2,
                                         first_k_dense_replace=1)


# ----------------------------------------------------------------------------- GPU scale
# The realistic-shape GPU checks (sparse MLA at T = 4K/32K/128K with the 671B dims, top-k exact at
# those T and with a context-parallel rank's queries, FP8 scores, both KL losses, dense attention)
# are `dsa-train gpu-check`'s correctness checks; on a GPU `pytest -m gpu tests/test_gpu_check.py`
# runs them as tests (dsa_train/gpucheck/correctness.py).
