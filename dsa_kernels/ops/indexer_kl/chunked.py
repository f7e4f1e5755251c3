"""Sparse indexer KL (report eq. 4) on the CPU (and any device without the Triton kernels): a
memory-bounded autograd Function with the contract of `sparse_indexer_kl_ref`.

The loss is a scalar and its target p has no gradient, so the gradients w.r.t. the indexer tensors
are formed in the same pass as the value, one query chunk at a time, and kept (in the inputs'
dtypes) for backward, which only scales them by the incoming gradient. Per chunk:

    p       = sparse_target(...)                                   [B, C, K]  (no gradient)
    z       = q_I . k_I[idx]        [B, C, H_I, K];   I = sum_h w_h relu(z_h)   [B, C, K]
    KL      = sum_k p (log p - log_softmax(I))          (valid slots; kl_rows, as the reference)
    dI      = softmax(I) * sum_k p - p                     (0 at empty slots)
    dw      = sum_k dI relu(z);   dz = dI w_h [z > 0]
    dq_I    = dz . k_I[idx];      dk_I[idx] += dz^T q_I    (index_add_ into one fp32 dk_I)

Nothing of size T x K is kept between forward and backward, and no per-chunk full-size gradient
is built (the checkpointed reference slices q_I per chunk: each chunk's backward would allocate
a zero [B, T, H_I, D_I] gradient). Computed in fp32, as the reference.
"""

from __future__ import annotations

import torch

from ...chunk_ops import chunk_loop_op
from ...masking import query_chunk_size
from ..sparse_mla.reference import gather_kv
from .reference import kl_rows, sparse_target


def _kl_loop(q_idx, k_idx, w_idx, indices, q_main, kv_main, lse_main, scale: float, chunk: int, want_grad: bool):
    # q_idx [B, T, H_I, D_I], k_idx [B, T_kv, D_I], w_idx [B, T, H_I], indices [B, T, K],
    # q_main [B, T, H, D], kv_main [B, T_kv, D], lse_main [B, T, H]
    # -> kl_sum, kl_uniform_sum (fp64 scalars), and with want_grad dq_I, dk_I [B, T_kv, D_I], dw
    B, T, H_I, D_I = q_idx.shape
    T_kv = k_idx.shape[1]
    kv32, k32 = kv_main.float(), k_idx.float()  # converted once, not per gathered row
    kl_total = torch.zeros((), dtype=torch.float64, device=q_idx.device)
    kl_uniform_total = torch.zeros((), dtype=torch.float64, device=q_idx.device)
    if want_grad:
        dq = torch.empty_like(q_idx)
        dw = torch.empty_like(w_idx)
        dk = torch.zeros(B * T_kv, D_I, dtype=torch.float32, device=k_idx.device)
        row_offset = (torch.arange(B, device=k_idx.device) * T_kv)[:, None, None]
    for q0 in range(0, T, chunk):
        q1 = min(T, q0 + chunk)
        idx = indices[:, q0:q1]
        valid = idx >= 0
        p = sparse_target(q_main[:, q0:q1], kv32, lse_main[:, q0:q1], idx, scale)  # [B, C, K]
        k_sel = gather_kv(k32, idx)  # [B, C, K, D_I]
        q_c = q_idx[:, q0:q1].float()
        w_c = w_idx[:, q0:q1].float()  # [B, C, H_I]
        z = torch.einsum("bchd,bckd->bchk", q_c, k_sel)  # [B, C, H_I, K]
        relu_z = torch.relu(z)
        scores = torch.einsum("bchk,bch->bck", relu_z, w_c).masked_fill_(~valid, float("-inf"))
        kl, kl_uniform = kl_rows(p, scores, valid)
        kl_total += kl.sum()
        kl_uniform_total += kl_uniform.sum()
        if want_grad:
            soft = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # rows with no valid slot: 0
            d_scores = soft.mul_(p.sum(-1, keepdim=True)).sub_(p)  # [B, C, K]
            dw[:, q0:q1] = torch.einsum("bck,bchk->bch", d_scores, relu_z)
            dz = (z > 0).float().mul_(d_scores[:, :, None, :]).mul_(w_c[..., None])  # [B, C, H_I, K]
            dq[:, q0:q1] = torch.einsum("bchk,bckd->bchd", dz, k_sel)
            dk_sel = torch.einsum("bchk,bchd->bckd", dz, q_c)  # [B, C, K, D_I]
            rows = (idx.clamp(min=0).long() + row_offset).reshape(-1)  # empty slots: dz = 0
            dk.index_add_(0, rows, dk_sel.reshape(-1, D_I))
    if not want_grad:
        return kl_total, kl_uniform_total, None, None, None
    return kl_total, kl_uniform_total, dq, dk.view(B, T_kv, D_I).to(k_idx.dtype), dw


# The loop as a torch op (`dsa_kernels.chunk_ops`): one fake dispatch under the memory trace's
# FakeTensorMode, which measures the loop's working set by running it on the first chunk.
def _kl_outputs(q_idx, k_idx, w_idx, indices, q_main, kv_main, lse_main, scale, chunk, want_grad):
    scalar = q_idx.new_empty((), dtype=torch.float64)
    if not want_grad:
        return scalar, scalar.clone(), q_idx.new_empty(0), k_idx.new_empty(0), w_idx.new_empty(0)
    return scalar, scalar.clone(), torch.empty_like(q_idx), torch.empty_like(k_idx), torch.empty_like(w_idx)


def _kl_first_chunk(q_idx, k_idx, w_idx, indices, q_main, kv_main, lse_main, scale, chunk, want_grad):
    c = slice(0, chunk)
    _kl_loop(q_idx[:, c], k_idx, w_idx[:, c], indices[:, c], q_main[:, c], kv_main, lse_main[:, c], scale, chunk,
             want_grad)


@chunk_loop_op("dsa_kernels::sparse_indexer_kl_chunked", fake=_kl_outputs, worst_chunk=_kl_first_chunk)
def sparse_indexer_kl_loop(q_idx: torch.Tensor, k_idx: torch.Tensor, w_idx: torch.Tensor, indices: torch.Tensor,
                           q_main: torch.Tensor, kv_main: torch.Tensor, lse_main: torch.Tensor, scale: float,
                           chunk: int, want_grad: bool
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (kl_sum, kl_uniform_sum, dq_I, dk_I, dw); empty gradients without want_grad."""
    kl, klu, dq, dk, dw = _kl_loop(q_idx, k_idx, w_idx, indices, q_main, kv_main, lse_main, scale, chunk, want_grad)
    if not want_grad:
        return kl, klu, q_idx.new_empty(0), k_idx.new_empty(0), w_idx.new_empty(0)
    return kl, klu, dq, dk, dw


class SparseIndexerKLChunkedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_idx, k_idx, w_idx, indices, q_main, kv_main, lse_main, scale, chunk):
        want_grad = any(ctx.needs_input_grad[:3])
        kl_total, kl_uniform_total, dq, dk, dw = sparse_indexer_kl_loop(
            q_idx, k_idx, w_idx, indices, q_main, kv_main, lse_main, scale, chunk, want_grad)
        if want_grad:
            ctx.save_for_backward(dq, dk, dw)
        ctx.want_grad = want_grad
        kl_uniform_total = kl_uniform_total.float()
        ctx.mark_non_differentiable(kl_uniform_total)
        return kl_total.float(), kl_uniform_total

    @staticmethod
    def backward(ctx, d_kl, _d_kl_uniform):
        if not ctx.want_grad or d_kl is None:
            return (None,) * 9
        dq, dk, dw = ctx.saved_tensors
        return (dq * d_kl.to(dq.dtype), dk * d_kl.to(dk.dtype), dw * d_kl.to(dw.dtype),
                None, None, None, None, None, None)


def sparse_indexer_kl_chunked(q_idx, k_idx, w_idx, indices, q_main, kv_main, lse_main, scale, chunk_size=None):
    """Same contract as `sparse_indexer_kl_ref` (q_main, kv_main, lse_main get no gradient)."""
    B, T, K = indices.shape
    heads = max(q_main.shape[2], q_idx.shape[2])
    chunk = chunk_size or query_chunk_size(T, per_query_elems=B * K * (heads * 4 + kv_main.shape[-1] + q_idx.shape[-1]))
    kl, kl_uniform = SparseIndexerKLChunkedFunction.apply(
        q_idx, k_idx, w_idx, indices, q_main.detach(), kv_main.detach(), lse_main.detach(), float(scale), int(chunk)
    )
    stats = {"kl": kl.detach(), "kl_uniform": kl_uniform, "queries": torch.tensor(float(B * T))}
    return kl, stats
