"""Sparse MLA on the CPU (and any device without the Triton kernels): a memory-bounded autograd
Function with the contract of `sparse_mla_ref`.

Forward: one query chunk at a time, the reference's own per-chunk computation (`_sparse_mla_chunk`,
no autograd graph); saves only q, kv, indices and the log-sum-exp [B, T, H].
Backward: per query chunk, recomputes the probabilities from the saved lse (no softmax
reductions) and forms the gradients by hand (FlashAttention-2's backward, in the MQA form):

    P    = exp(scale * q . kv_sel - lse)                    [B, C, H, K]  (0 at empty slots)
    dP   = dO . v_sel                                        v_sel = kv_sel[..., :d_v]
    dS   = P * (dP - sum_k P dP + dlse)                      (dlse: the gradient reaching lse)
    dq   = scale * dS . kv_sel                               written into dq[:, chunk]
    dkv_sel = scale * dS^T q + P^T dO (first d_v columns)   one product; index_add_ into an fp32 dkv

So the backward allocates dq and dkv once ([B, T, H, D], [B, T, D]) and per chunk only blocks of
C x K x D, never a full-size gradient per chunk (what slicing q inside a checkpointed loop costs:
a zero [B, T, H, D] tensor per chunk, O(T^2) traffic). Everything is computed in fp32, as in the
reference; gradients are returned in the inputs' dtypes.
"""

from __future__ import annotations

import torch

from ...chunk_ops import chunk_loop_op
from ...masking import query_chunk_size
from .reference import _sparse_mla_chunk, gather_kv, sparse_attention_scores


def sparse_chunk_size(B: int, K: int, H: int, D: int) -> int:
    """Queries per chunk: the backward's fp32 blocks (kv_sel and dkv_sel [C, K, D], four
    [C, H, K]) within `query_chunk_size`'s element budget."""
    return max(1, query_chunk_size(1 << 30, per_query_elems=B * K * (2 * D + 4 * H)))


def _forward_loop(q, kv, indices, scale: float, d_v: int, chunk: int):
    # q [B, T, H, D], kv [B, T, D], indices [B, T, K] -> out [B, T, H, d_v] (q.dtype), lse [B, T, H] fp32
    B, T, H, _ = q.shape
    out = q.new_empty(B, T, H, d_v)
    lse = torch.empty(B, T, H, dtype=torch.float32, device=q.device)
    kv32 = kv.float()  # [B, T, D]: converted once, not per gathered row
    for q0 in range(0, T, chunk):
        q1 = min(T, q0 + chunk)
        o, l = _sparse_mla_chunk(q[:, q0:q1], kv32, indices[:, q0:q1], scale, d_v)
        out[:, q0:q1] = o
        lse[:, q0:q1] = l
    return out, lse


def _backward_loop(q, kv, indices, lse, dout, dlse, scale: float, d_v: int, chunk: int, need_dq: bool,
                   need_dkv: bool):
    B, T, H, D = q.shape
    T_kv = kv.shape[1]  # the whole sequence's keys (context parallelism: T_kv > T)
    kv32 = kv.float()
    dq = torch.empty_like(q) if need_dq else None
    dkv = torch.zeros(B * T_kv, D, dtype=torch.float32, device=kv.device) if need_dkv else None
    row_offset = (torch.arange(B, device=kv.device) * T_kv)[:, None, None]  # batch b's rows in dkv
    finite_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    for q0 in range(0, T, chunk):
        q1 = min(T, q0 + chunk)
        idx = indices[:, q0:q1]
        q_c = q[:, q0:q1].float()  # [B, C, H, D]
        kv_sel = gather_kv(kv32, idx)  # [B, C, K, D]
        logits = sparse_attention_scores(q_c, kv_sel, idx, scale)  # [B, C, H, K], -inf at empty slots
        probs = torch.exp_(logits.sub_(finite_lse[:, q0:q1, :, None]))
        dS = torch.zeros_like(probs)
        if dout is not None:
            dout_c = dout[:, q0:q1].float()  # [B, C, H, d_v]
            dP = torch.einsum("bchd,bckd->bchk", dout_c, kv_sel[..., :d_v])
            dS += dP.sub_((probs * dP).sum(-1, keepdim=True))
        if dlse is not None:
            dS += dlse[:, q0:q1, :, None].float()
        dS.mul_(probs).mul_(scale)
        if dq is not None:
            dq[:, q0:q1] = torch.einsum("bchk,bckd->bchd", dS, kv_sel)
        if dkv is not None:
            if dout is None:
                dkv_sel = torch.einsum("bchk,bchd->bckd", dS, q_c)  # [B, C, K, D]
            else:  # both terms in one product: [dS | P]^T [q | dO, 0] over 2H heads
                dout_pad = torch.nn.functional.pad(dout_c, (0, D - d_v))  # [B, C, H, D]
                dkv_sel = torch.einsum("bchk,bchd->bckd", torch.cat([dS, probs], dim=2),
                                       torch.cat([q_c, dout_pad], dim=2))
            rows = (idx.clamp(min=0).long() + row_offset).reshape(-1)  # empty slots: P = 0, adds 0
            dkv.index_add_(0, rows, dkv_sel.reshape(-1, D))
    if dkv is not None:
        dkv = dkv.view(B, T_kv, D).to(kv.dtype)
    return dq, dkv


# The two loops as torch ops (`dsa_kernels.chunk_ops`): one fake dispatch each under the memory
# trace's FakeTensorMode, which measures the loop's working set by running it on the first chunk.
def _fwd_outputs(q, kv, indices, scale, d_v, chunk):
    B, T, H, _ = q.shape
    return q.new_empty(B, T, H, d_v), q.new_empty((B, T, H), dtype=torch.float32)


def _fwd_first_chunk(q, kv, indices, scale, d_v, chunk):
    _forward_loop(q[:, :chunk], kv, indices[:, :chunk], scale, d_v, chunk)


@chunk_loop_op("dsa_kernels::sparse_mla_chunked_fwd", fake=_fwd_outputs, worst_chunk=_fwd_first_chunk)
def sparse_mla_chunked_fwd(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float, d_v: int,
                           chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward_loop(q, kv, indices, scale, d_v, chunk)


def _bwd_outputs(q, kv, indices, lse, dout, dlse, scale, d_v, chunk, need_dq, need_dkv):
    return (torch.empty_like(q) if need_dq else q.new_empty(0),
            torch.empty_like(kv) if need_dkv else kv.new_empty(0))


def _bwd_first_chunk(q, kv, indices, lse, dout, dlse, scale, d_v, chunk, need_dq, need_dkv):
    c = slice(0, chunk)
    _backward_loop(q[:, c], kv, indices[:, c], lse[:, c], None if dout is None else dout[:, c],
                   None if dlse is None else dlse[:, c], scale, d_v, chunk, need_dq, need_dkv)


@chunk_loop_op("dsa_kernels::sparse_mla_chunked_bwd", fake=_bwd_outputs, worst_chunk=_bwd_first_chunk)
def sparse_mla_chunked_bwd(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, lse: torch.Tensor,
                           dout: torch.Tensor | None, dlse: torch.Tensor | None, scale: float, d_v: int, chunk: int,
                           need_dq: bool, need_dkv: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (dq, dkv); an empty tensor for a gradient not asked for."""
    dq, dkv = _backward_loop(q, kv, indices, lse, dout, dlse, scale, d_v, chunk, need_dq, need_dkv)
    return (q.new_empty(0) if dq is None else dq), (kv.new_empty(0) if dkv is None else dkv)


class SparseMLAChunkedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, indices, scale, d_v, chunk):
        out, lse = sparse_mla_chunked_fwd(q, kv, indices, scale, d_v, chunk)
        ctx.save_for_backward(q, kv, indices, lse)
        ctx.scale, ctx.d_v, ctx.chunk = scale, d_v, chunk
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, kv, indices, lse = ctx.saved_tensors
        need_dq, need_dkv = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dq, dkv = sparse_mla_chunked_bwd(q, kv, indices, lse, dout, dlse, ctx.scale, ctx.d_v, ctx.chunk, need_dq,
                                         need_dkv)
        return (dq if need_dq else None), (dkv if need_dkv else None), None, None, None, None


def sparse_mla_chunked(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float, d_v: int,
                       chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `sparse_mla_ref`; memory O(T * H * D) plus one chunk's blocks."""
    B, T, H, D = q.shape
    if kv.dim() != 3 or kv.shape[0] != B or kv.shape[2] != D or indices.shape[:2] != (B, T) or not 0 < d_v <= D:
        raise ValueError(f"sparse_mla: q {tuple(q.shape)} / kv {tuple(kv.shape)} / indices {tuple(indices.shape)} "
                         f"/ d_v {d_v} do not match (expected q [B,T,H,D], kv [B,T_kv,D], indices [B,T,K])")
    chunk = chunk_size or sparse_chunk_size(B, indices.shape[-1], H, D)
    return SparseMLAChunkedFunction.apply(q, kv, indices, float(scale), int(d_v), int(chunk))
