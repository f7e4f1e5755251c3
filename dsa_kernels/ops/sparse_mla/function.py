"""Sparse MLA: autograd Function over the Triton forward/backward (`kernel.py`) and its entry."""

from __future__ import annotations

import math

import torch

from ..._triton_common import check_indices, compute_dtype, kernel_input
from .custom import sparse_mla_bwd, sparse_mla_fwd  # the launchers as custom ops (fake tensors: plan --trace)
from .kernel import slot_counts


def kernel_inputs(q: torch.Tensor, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, kv as the kernels take them (contiguous): compiled with fp32 inputs -> bf16 (the fp32
    policy of `compute_dtype`: one warning; DSA_KERNELS_FP32=error refuses); interpreted ->
    fp32 (`interp_upcast`); otherwise as given. q and kv must end up in one dtype."""
    cast = compute_dtype("sparse_mla", q, kv)
    q_c, kv_c = kernel_input(q, cast), kernel_input(kv, cast)
    if q_c.dtype != kv_c.dtype:
        raise TypeError(f"sparse_mla: q is {q.dtype} and kv is {kv.dtype}; pass both in one dtype (bf16)")
    return q_c, kv_c


class SparseMLAFunction(torch.autograd.Function):
    """Outputs out, lse and, with `target`, the sparse indexer KL's target p_sum [B, T, K] fp32
    (Sigma_h P per slot, formed by the forward launch: `kernel.sparse_mla_fwd`; no gradient);
    without it the third output is None."""

    @staticmethod
    def forward(ctx, q, kv, indices, scale, d_v, target=False):
        q_c, kv_c = kernel_inputs(q, kv)
        idx = indices.to(torch.int32).contiguous()
        n_slots = slot_counts(idx, kv.shape[1])  # [B, T]; same valid-slot rule as the kernels
        out, lse, p_sum = sparse_mla_fwd(q_c, kv_c, idx, n_slots, scale, d_v, bool(target))
        p_sum = p_sum if target else None
        ctx.save_for_backward(q_c, kv_c, idx, n_slots, out, lse)
        ctx.scale, ctx.d_v = scale, d_v
        ctx.dtypes = (q.dtype, kv.dtype)  # the caller's: the gradients are returned in these
        if p_sum is not None:
            ctx.mark_non_differentiable(p_sum)
        return out.to(q.dtype), lse, p_sum

    @staticmethod
    def backward(ctx, dout, dlse, _dtarget=None):
        q, kv, idx, n_slots, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout.to(q.dtype)  # the compute dtype
        dq, dkv = sparse_mla_bwd(q, kv, idx, n_slots, out, lse, dout, dlse, ctx.scale, ctx.d_v)
        return dq.to(ctx.dtypes[0]), dkv.to(ctx.dtypes[1]), None, None, None, None


def sparse_mla_triton(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float, d_v: int,
                      chunk_size: int | None = None, return_target: bool = False):
    """Same contract as `sparse_mla_ref` (chunk_size is accepted and ignored: nothing is chunked).
    kv may hold more rows than q has tokens (context parallelism: indices point into the whole
    kv). Indices outside [0, kv rows) are empty slots; DSA_KERNELS_CHECK=1 raises on them instead.
    return_target: -> (out, lse, p_sum), p_sum [B, T, K] fp32 = Sigma_h softmax_h at each slot (the
    sparse indexer KL's target before its 1/H; no gradient), for `sparse_indexer_kl(target=...)`."""
    if q.dim() != 4 or kv.dim() != 3 or indices.dim() != 3:
        raise ValueError(f"sparse_mla: expected q [B, T, H, D], kv [B, N, D], indices [B, T, K]; got "
                         f"q {tuple(q.shape)}, kv {tuple(kv.shape)}, indices {tuple(indices.shape)}")
    if q.shape[-1] != kv.shape[-1] or not 0 < d_v <= q.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)} / kv {tuple(kv.shape)} / d_v {d_v} do not match")
    if kv.shape[0] != q.shape[0] or tuple(indices.shape[:2]) != tuple(q.shape[:2]):
        raise ValueError(f"sparse_mla: batch / token dims differ: q {tuple(q.shape)}, kv {tuple(kv.shape)}, "
                         f"indices {tuple(indices.shape)} (need kv [B, N, D] and indices [B, T, K] for q [B, T, H, D])")
    if not math.isfinite(scale):
        raise ValueError("scale must be finite")
    check_indices(indices, kv.shape[1], "sparse_mla")
    out, lse, p_sum = SparseMLAFunction.apply(q, kv, indices, float(scale), int(d_v), bool(return_target))
    return (out, lse, p_sum) if return_target else (out, lse)
