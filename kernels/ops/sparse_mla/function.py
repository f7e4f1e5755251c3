"""Sparse MLA: autograd Function over the Triton forward/backward (`kernel.py`) and its entry."""

from __future__ import annotations

import math

import torch

from ..._triton_common import interp_upcast
from .kernel import slot_counts, sparse_mla_bwd, sparse_mla_fwd


class SparseMLAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, indices, scale, d_v):
        q_c, kv_c = interp_upcast(q.contiguous()), interp_upcast(kv.contiguous())
        idx = indices.to(torch.int32).contiguous()
        n_slots = slot_counts(idx)  # [B, T]
        out, lse = sparse_mla_fwd(q_c, kv_c, idx, n_slots, scale, d_v)
        ctx.save_for_backward(q_c, kv_c, idx, n_slots, out, lse)
        ctx.scale, ctx.d_v = scale, d_v
        ctx.dtypes = (q.dtype, kv.dtype)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, kv, idx, n_slots, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout.to(q.dtype)
        dq, dkv = sparse_mla_bwd(q, kv, idx, n_slots, out, lse, dout, dlse, ctx.scale, ctx.d_v)
        return dq.to(ctx.dtypes[0]), dkv.to(ctx.dtypes[1]), None, None, None


def sparse_mla_triton(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float, d_v: int,
                      chunk_size: int | None = None):
    """Same contract as `sparse_mla_ref` (chunk_size is accepted and ignored: nothing is chunked)."""
    if q.shape[-1] != kv.shape[-1] or not 0 < d_v <= q.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)} / kv {tuple(kv.shape)} / d_v {d_v} do not match")
    if not math.isfinite(scale):
        raise ValueError("scale must be finite")
    return SparseMLAFunction.apply(q, kv, indices, float(scale), int(d_v))
