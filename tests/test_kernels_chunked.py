"""The memory-bounded CPU Functions (sparse MLA, sparse indexer KL) equal the plain PyTorch
references in values and gradients, at small odd shapes, fp32 and bf16, with packed documents,
empty (-1) slots and a row with no valid slot; and the CPU entry points run them."""

import pytest
import torch

import dsa_kernels as K
from dsa_kernels.ops.indexer_kl import sparse_indexer_kl_chunked, sparse_indexer_kl_ref
from dsa_kernels.ops.sparse_mla import sparse_mla_chunked, sparse_mla_ref

# fp32: same arithmetic up to summation order; bf16: gradients rounded to bf16 once (chunked) or
# per chunk and per accumulation (reference)
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def packed_topk(B, T, topk, H_I=3, D_I=8, seed=0):
    """Top-k indices of a random indexer over two packed documents per row (-1 tails early on)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H_I, D_I, generator=g)
    k = torch.randn(B, T, D_I, generator=g)
    w = torch.randn(B, T, H_I, generator=g)
    pos = torch.cat([torch.arange(T // 2), torch.arange(T - T // 2)])[None].expand(B, T)
    doc_start = K.doc_starts_from_position_ids(pos)
    indices, _ = K.indexer_topk_ref(q, k, w, doc_start, topk)
    return indices


def finite(x):
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 4, None])
def test_sparse_mla_chunked_matches_reference(dtype, chunk):
    B, T, H, D, d_v, topk = 2, 19, 3, 20, 12, 7
    indices = packed_topk(B, T, topk)
    indices[1, 4] = -1  # a row with every slot empty
    g = torch.Generator().manual_seed(1)
    q0, kv0 = torch.randn(B, T, H, D, generator=g).to(dtype), torch.randn(B, T, D, generator=g).to(dtype)
    d_out, d_lse = torch.randn(B, T, H, d_v, generator=g).to(dtype), torch.randn(B, T, H, generator=g)
    results = []
    for fn in (sparse_mla_ref, sparse_mla_chunked):
        q, kv = q0.clone().requires_grad_(), kv0.clone().requires_grad_()
        out, lse = fn(q, kv, indices, 0.3, d_v, chunk)
        loss = (out.float() * d_out.float()).sum() + (finite(lse) * d_lse).sum()
        results.append((out, lse, *torch.autograd.grad(loss, (q, kv))))
    (out, lse, dq, dkv), (c_out, c_lse, c_dq, c_dkv) = results
    assert c_out.dtype == dtype and c_dq.dtype == dtype and c_dkv.dtype == dtype
    assert torch.isneginf(c_lse[1, 4]).all() and bool((c_out[1, 4] == 0).all())
    torch.testing.assert_close(c_out, out, **TOL[dtype])
    torch.testing.assert_close(c_lse, lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c_dq, dq, **TOL[dtype])
    torch.testing.assert_close(c_dkv, dkv, **TOL[dtype])


def test_sparse_mla_chunked_keys_longer_than_queries():
    """Context parallelism: this rank's queries (the last 5 positions) over the whole sequence's kv."""
    B, T, H, D, d_v = 1, 17, 2, 12, 8
    indices = packed_topk(B, T, 6)[:, -5:]
    q = torch.randn(B, 5, H, D, requires_grad=True)
    kv = torch.randn(B, T, D, requires_grad=True)
    grads = []
    for fn in (sparse_mla_ref, sparse_mla_chunked):
        out, _ = fn(q, kv, indices, 0.5, d_v, 2)
        grads.append(torch.autograd.grad(out.square().sum(), (q, kv)))
    for c, r in zip(grads[1], grads[0]):
        torch.testing.assert_close(c, r, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 5, None])
def test_sparse_indexer_kl_chunked_matches_reference(dtype, chunk):
    B, T, H, D, H_I, D_I, topk = 2, 21, 4, 12, 3, 8, 6
    indices = packed_topk(B, T, topk, seed=2)
    g = torch.Generator().manual_seed(3)
    q_main, kv = torch.randn(B, T, H, D, generator=g).to(dtype), torch.randn(B, T, D, generator=g).to(dtype)
    _, lse = sparse_mla_ref(q_main, kv, indices, 0.3, 8)
    inputs = (torch.randn(B, T, H_I, D_I, generator=g).to(dtype), torch.randn(B, T, D_I, generator=g).to(dtype),
              torch.randn(B, T, H_I, generator=g))
    results = []
    for fn in (sparse_indexer_kl_ref, sparse_indexer_kl_chunked):
        q_i, k_i, w_i = (x.clone().requires_grad_() for x in inputs)
        kl, stats = fn(q_i, k_i, w_i, indices, q_main, kv, lse, 0.3, chunk)
        grads = torch.autograd.grad(0.7 * kl, (q_i, k_i, w_i))  # a loss coefficient, as the trainer has
        results.append((kl, stats["kl_uniform"], stats["queries"], *grads))
    for c, r in zip(results[1], results[0]):
        assert c.dtype == r.dtype
        torch.testing.assert_close(c, r, **TOL[dtype])
    assert results[1][0] > 0


def test_cpu_entry_points_run_the_chunked_functions():
    indices = packed_topk(1, 9, 4)
    q = torch.randn(1, 9, 2, 8, requires_grad=True)
    kv = torch.randn(1, 9, 8, requires_grad=True)
    out, lse = K.sparse_mla(q, kv, indices, 0.3, 6)
    assert type(out.grad_fn).__name__ == "SparseMLAChunkedFunctionBackward"
    q_i, k_i, w_i = torch.randn(1, 9, 2, 4, requires_grad=True), torch.randn(1, 9, 4), torch.randn(1, 9, 2)
    kl, _ = K.sparse_indexer_kl(q_i, k_i, w_i, indices, q.detach(), kv.detach(), lse.detach(), 0.3)
    assert type(kl.grad_fn).__name__ == "SparseIndexerKLChunkedFunctionBackward"


def test_sparse_mla_chunked_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="do not match"):
        sparse_mla_chunked(torch.randn(1, 4, 2, 8), torch.randn(1, 4, 6), torch.zeros(1, 4, 2, dtype=torch.long), 1.0, 4)
