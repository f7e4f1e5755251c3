"""The Triton kernels in context parallelism's shape: fewer query rows than key rows.

Under CP a rank holds some of the sequence's queries (`parallel/context.py`: chunks r and
2*cp-1-r of 2*cp) and the keys of the whole sequence, gathered (`model/mla.py`:
`k_idx_all = cp.gather(k_idx)`, `kv_all = cp.gather(kv)`). The model then calls, with
T_loc < T: the indexer top-k with `query_positions`, the sparse indexer KL (sparse stage, and
the dense warm-up under CP through `visible_key_indices`). Each is compared with its PyTorch
reference here under the Triton interpreter (TRITON_INTERPRET=1, set before triton is
imported): values and all three KL gradients, for the last chunk, a middle chunk and CP's
load-balanced pair of chunks. Sparse MLA in this shape is tested in
tests/test_kernels_sparse_mla_launch.py.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dsa_kernels as K  # noqa: E402
from dsa_kernels import doc_starts_from_position_ids, sparse_indexer_kl_ref, sparse_mla_ref  # noqa: E402
from dsa_kernels.ops.indexer_kl.function import sparse_indexer_kl_triton  # noqa: E402
from dsa_kernels.ops.indexer_topk import indexer_topk_at_positions_ref  # noqa: E402
from dsa_kernels.ops.indexer_topk.kernel import _score_chunk  # noqa: E402
from dsa_train.model.mla import visible_key_indices  # noqa: E402
from dsa_train.parallel.context import local_positions  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
T = 32  # key rows: the whole (gathered) sequence
B, HI, DI, H, D = 2, 4, 16, 3, 24


def _doc_start():
    rows = [torch.cat([torch.arange(n) for n in lengths]) for lengths in ([20, 12], [5, 27])]
    return doc_starts_from_position_ids(torch.stack(rows)).to(DEV)


def _positions(kind: str) -> torch.Tensor:
    """Global positions of one rank's query rows."""
    if kind == "last":  # the last 8 positions (the case that crashed: dk sized by the query count)
        return torch.arange(T - 8, T, device=DEV)
    if kind == "middle":
        return torch.arange(12, 20, device=DEV)
    return local_positions(T, 2, 0, device=DEV)  # CP = 2, rank 0: chunks 0 and 3 of 4


POSITIONS = ["last", "middle", "cp_pair"]


def _selected(pos, ds, K_sel, seed):
    """[B, T_loc, K_sel] int32: random visible keys of each query (global key rows), -1 tails
    and dropped slots, one row with no key at all."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.full((B, len(pos), K_sel), -1, dtype=torch.int32)
    for b in range(B):
        for r, t in enumerate(pos.tolist()):
            lo = int(ds[b, t])
            keys = lo + torch.randperm(t + 1 - lo, generator=g)[:K_sel]
            keep = torch.rand(len(keys), generator=g) >= 0.2
            keys = keys[keep].to(torch.int32)
            idx[b, r, : len(keys)] = keys
    idx[1, 0] = -1
    return idx.to(DEV)


def _kl_inputs(pos, seed):
    g = torch.Generator().manual_seed(seed)
    n = len(pos)
    qi = torch.randn(B, n, HI, DI, generator=g).to(DEV).requires_grad_()
    ki = torch.randn(B, T, DI, generator=g).to(DEV).requires_grad_()  # every key row
    wi = torch.randn(B, n, HI, generator=g).to(DEV).requires_grad_()
    qm = torch.randn(B, n, H, D, generator=g).to(DEV)
    kv = torch.randn(B, T, D, generator=g).to(DEV)
    return qi, ki, wi, qm, kv


def _check_kl_against_reference(run, qi, ki, wi, idx, qm, kv, lse, scale):
    kl, st = run(qi, ki, wi, idx, qm, kv, lse, scale)
    rkl, rst = sparse_indexer_kl_ref(qi, ki, wi, idx, qm, kv, lse, scale)
    torch.testing.assert_close(kl, rkl, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(st["kl_uniform"].to(DEV), rst["kl_uniform"].to(DEV), rtol=1e-5, atol=1e-4)
    grads = torch.autograd.grad(kl * 0.7, (qi, ki, wi))
    rgrads = torch.autograd.grad(rkl * 0.7, (qi, ki, wi))
    assert grads[1].shape == ki.shape  # the key gradient covers every (gathered) key row
    for name, a, b in zip(("q_I", "k_I", "w"), grads, rgrads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"d{n}: {m}")
    return grads


@pytest.mark.parametrize("kind", POSITIONS)
def test_sparse_indexer_kl_fewer_queries_than_keys(kind):
    ds = _doc_start()
    pos = _positions(kind)
    qi, ki, wi, qm, kv = _kl_inputs(pos, seed=len(kind))
    idx = _selected(pos, ds, 12, seed=3)
    _, lse = sparse_mla_ref(qm, kv, idx, 0.2, 16)
    grads = _check_kl_against_reference(sparse_indexer_kl_triton, qi, ki, wi, idx, qm, kv, lse, 0.2)
    # keys no query selected get no gradient; a selected key row past the local rows gets some
    hit = torch.zeros(B, T, dtype=torch.bool, device=DEV)
    sel = idx >= 0
    hit[torch.arange(B, device=DEV)[:, None, None].expand_as(idx)[sel], idx[sel].long()] = True
    assert (grads[1][~hit] == 0).all()
    assert (grads[1][hit].abs().sum(-1) > 0).any()


def test_sparse_indexer_kl_dense_warmup_under_cp(monkeypatch):
    # the dense warm-up under CP (`MLA._dense_at_positions`): every visible key of the rank's
    # queries as an index list of width T, through the dispatcher on the Triton path
    ds = _doc_start()
    pos = _positions("cp_pair")
    qi, ki, wi, qm, kv = _kl_inputs(pos, seed=5)
    idx = visible_key_indices(ds, pos)  # [B, T_loc, T]
    _, lse = sparse_mla_ref(qm, kv, idx, 0.2, 16)
    monkeypatch.setenv("DSA_KERNELS", "triton")
    _check_kl_against_reference(K.sparse_indexer_kl, qi, ki, wi, idx, qm, kv, lse, 0.2)


def test_sparse_indexer_kl_out_of_range_indices(monkeypatch):
    # an index >= the key rows (a caller bug) is read as an empty slot; DSA_KERNELS_CHECK=1 raises
    ds = _doc_start()
    pos = _positions("last")
    qi, ki, wi, qm, kv = _kl_inputs(pos, seed=9)
    idx = _selected(pos, ds, 6, seed=9)
    _, lse = sparse_mla_ref(qm, kv, idx, 0.2, 16)
    bad = idx.clone()
    bad[0, 2, 5] = T + 3
    bad[1, 4, 5] = 1 << 20
    kl, _ = sparse_indexer_kl_triton(qi, ki, wi, bad, qm, kv, lse, 0.2)
    rkl, _ = sparse_indexer_kl_ref(qi, ki, wi, torch.where(bad >= T, -1, bad), qm, kv, lse, 0.2)
    torch.testing.assert_close(kl, rkl, rtol=1e-5, atol=1e-4)
    dk = torch.autograd.grad(kl, ki)[0]
    rdk = torch.autograd.grad(rkl, ki)[0]
    torch.testing.assert_close(dk, rdk, rtol=1e-4, atol=1e-5)
    monkeypatch.setenv("DSA_KERNELS_CHECK", "1")
    with pytest.raises(ValueError, match=r"sparse_indexer_kl: indices\[0, 2, 5\] = 35 is outside \[-1, 32\)"):
        sparse_indexer_kl_triton(qi, ki, wi, bad, qm, kv, lse, 0.2)


def test_sparse_indexer_kl_mismatched_key_rows():
    pos = _positions("last")
    qi, ki, wi, qm, kv = _kl_inputs(pos, seed=1)
    idx = _selected(pos, _doc_start(), 4, seed=1)
    lse = torch.zeros(B, len(pos), H, device=DEV)
    with pytest.raises(ValueError, match="must hold the same key rows"):
        sparse_indexer_kl_triton(qi, ki, wi, idx, qm, kv[:, :-1], lse, 0.2)


def _grid(shape, seed):
    """Multiples of 1/4 in [-2, 2]: dots and weighted sums are exact in fp32, so scores tie
    exactly where they tie mathematically and the selections compare exactly."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-8, 9, shape, generator=g).float() / 4).to(DEV)


def _tie_free(shape, seed):
    """Distinct weights for the top-k test: per-query head weights that make ties between keys
    improbable (exact ties are covered by test_kernels_triton.py's tie tests)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=g) + 0.5).to(DEV)


@pytest.mark.parametrize("kind", POSITIONS)
def test_indexer_topk_fewer_queries_than_keys(monkeypatch, kind):
    monkeypatch.setenv("DSA_KERNELS", "triton")
    ds = _doc_start()
    pos = _positions(kind)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(B, len(pos), HI, DI, generator=g).to(DEV)
    k = torch.randn(B, T, DI, generator=g).to(DEV)
    w = _tie_free((B, len(pos), HI), seed=5)
    ridx, rval = indexer_topk_at_positions_ref(q, k, w, ds, 10, pos)
    assert (ridx >= 0).sum() > 0 and (ridx == -1).sum() > 0  # full rows and short rows
    idx, val = K.indexer_topk(q, k, w, ds, 10, query_positions=pos)
    assert torch.equal(idx, ridx)
    torch.testing.assert_close(val, rval, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", POSITIONS)
def test_index_scores_at_positions(kind):
    # the score kernel alone: the rank's query rows (local rows r0..r1, global positions pos) over
    # the key window [k0, k_end) of the whole sequence, every entry (masked ones -inf)
    ds = _doc_start()
    pos = _positions(kind)
    q, k, w = _grid((B, len(pos), HI, DI), 1), _grid((B, T, DI), 2), _grid((B, len(pos), HI), 3)
    r0, r1 = 2, len(pos)
    k0, k_end = int(ds[:, pos[r0:r1]].min()), int(pos[r0:r1].max()) + 1
    scores = _score_chunk(q, k, w, ds, pos.to(torch.int32), r0, r1, k0, k_end)  # [B, r1 - r0, k_end - k0]
    from dsa_kernels.ops.indexer_topk import index_scores_block

    ref = index_scores_block(q[:, r0:r1], k[:, k0:k_end], w[:, r0:r1])
    s = torch.arange(k0, k_end, device=DEV)
    p = pos[r0:r1]
    valid = (s[None, None, :] <= p[None, :, None]) & (s[None, None, :] >= ds[:, p, None])
    ref = ref.masked_fill(~valid, float("-inf"))
    assert torch.equal(scores, ref)


# ----------------------------------------------------------------------------- fp32 inputs
# Compiled, fp32 q/k are computed in bf16 (`_triton_common.compute_dtype`: fp32 dots would be TF32,
# fp32 tiles would not fit); interpreted they stay fp32. These tests stand in the compiled path's
# policy (a bf16 compute dtype for fp32 inputs) and check that the entry points cast what the
# dots read, keep the interpreter's fp32 upcast of those bf16 values, and return outputs and
# gradients in the caller's dtypes: the results equal the references on the bf16-rounded inputs.
def _bf16_policy(op, *tensors):
    return torch.bfloat16 if any(t.dtype == torch.float32 for t in tensors) else None


def _rounded(x: torch.Tensor) -> torch.Tensor:
    return x.detach().bfloat16().float().requires_grad_(x.requires_grad)


def test_fp32_inputs_sparse_indexer_kl_computed_in_bf16(monkeypatch):
    import dsa_kernels.ops.indexer_kl.function as kl_function

    monkeypatch.setattr(kl_function, "compute_dtype", _bf16_policy)
    ds = _doc_start()
    pos = _positions("cp_pair")
    qi, ki, wi, qm, kv = _kl_inputs(pos, seed=21)
    idx = _selected(pos, ds, 10, seed=21)
    _, lse = sparse_mla_ref(qm, kv, idx, 0.2, 16)
    kl, _ = sparse_indexer_kl_triton(qi, ki, wi, idx, qm, kv, lse, 0.2)
    rqi, rki = _rounded(qi), _rounded(ki)
    rkl, _ = sparse_indexer_kl_ref(rqi, rki, wi, idx, _rounded(qm), _rounded(kv), lse, 0.2)
    torch.testing.assert_close(kl, rkl, rtol=1e-5, atol=1e-4)
    grads = torch.autograd.grad(kl, (qi, ki, wi))
    rgrads = torch.autograd.grad(rkl, (rqi, rki, wi))
    for a, b in zip(grads, rgrads):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # without the cast the fp32 values differ from their bf16 roundings by more than the tolerance
    assert (qi.detach() - rqi.detach()).abs().max() > 1e-4


def test_fp32_inputs_dense_attention_computed_in_bf16(monkeypatch):
    import dsa_kernels.ops.dense_attention.function as dense_function

    monkeypatch.setattr(dense_function, "compute_dtype", _bf16_policy)
    monkeypatch.setenv("DSA_KERNELS", "triton")
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 20, 2, s, generator=g).to(DEV).requires_grad_() for s in (24, 24, 16))
    ds = _doc_start()[:1, :20]
    out, lse = K.dense_attention(q, k, v, 0.3, ds)
    rq, rk, rv = _rounded(q), _rounded(k), _rounded(v)
    rout, rlse = K.dense_attention_ref(rq, rk, rv, 0.3, ds)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    torch.testing.assert_close(out, rout, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, rlse, rtol=1e-5, atol=1e-5)
    dout = torch.randn(out.shape, generator=g).to(DEV)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    rgrads = torch.autograd.grad(rout, (rq, rk, rv), dout)
    for a, b in zip(grads, rgrads):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_fp32_inputs_indexer_topk_scored_in_bf16(monkeypatch):
    import dsa_kernels.ops.indexer_topk.kernel as topk_kernel

    monkeypatch.setattr(topk_kernel, "compute_dtype", _bf16_policy)
    monkeypatch.setenv("DSA_KERNELS", "triton")
    ds = _doc_start()
    pos = _positions("last")
    g = torch.Generator().manual_seed(6)
    q = torch.randn(B, len(pos), HI, DI, generator=g).to(DEV)
    k = torch.randn(B, T, DI, generator=g).to(DEV)
    w = _tie_free((B, len(pos), HI), seed=7)
    idx, val = K.indexer_topk(q, k, w, ds, 10, query_positions=pos)
    ridx, rval = indexer_topk_at_positions_ref(_rounded(q), _rounded(k), w, ds, 10, pos)
    assert torch.equal(idx, ridx) and val.dtype == torch.float32
    torch.testing.assert_close(val, rval, rtol=1e-5, atol=1e-5)


def test_dense_attention_backward_delta_in_token_chunks():
    # rowsum(dO * O) of the Triton backward, a token chunk at a time (no full-size fp32 copies)
    from dsa_kernels._triton_common import row_dot

    g = torch.Generator().manual_seed(3)
    a, b = (torch.randn(2, 37, 3, 8, generator=g).bfloat16() for _ in range(2))
    full = (a.float() * b.float()).sum(-1)
    for chunk_elems in (2 * 3 * 8 * 5, 1 << 24):  # 5 tokens per chunk (8 chunks, the last partial); one chunk
        torch.testing.assert_close(row_dot(a, b, chunk_elems), full, rtol=0, atol=0)
