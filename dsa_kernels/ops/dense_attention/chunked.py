"""Dense attention's PyTorch path: the reference forward, and under autograd a flash-style Function.

Forward runs the reference one query chunk at a time and keeps only the inputs, the output and
the log-sum-exp lse [B, T, H] (fp32). Backward recomputes each chunk's probabilities from lse,
never a [H, T, T] tensor (per head h, chunk rows t, key window s, all fp32):

    P  = exp(scale * q k^T - lse)          (0 where masked)
    dV = P^T dO                            dP = dO v^T
    Delta_t = sum_s P[t, s] dP[t, s]       (= dO_t . o_t)
    dS = P * (dP - Delta)
    dQ = scale * dS k                      dK = scale * dS^T q

Shapes as in reference.py; k / v may have one head (MQA form), then dK / dV sum over heads.
Memory: a few [B, H, C, S] fp32 blocks at a time plus fp32 dK / dV accumulators [B, T, Hk, D].
"""

from __future__ import annotations

import torch

from .reference import default_chunk_size, dense_attention_fwd_ref, dense_attention_logits


class DenseAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, doc_start, chunk_size):
        out, lse = dense_attention_fwd_ref(q, k, v, scale, doc_start, chunk_size)
        ctx.save_for_backward(q, k, v, lse, doc_start)
        ctx.scale = scale
        ctx.chunk_size = chunk_size
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, lse, doc_start = ctx.saved_tensors
        dq, dk, dv = dense_attention_bwd_ref(q, k, v, lse, grad_out, ctx.scale, doc_start, ctx.chunk_size)
        return dq, dk, dv, None, None, None


@torch.no_grad()
def dense_attention_bwd_ref(q, k, v, lse, grad_out, scale, doc_start, chunk_size=None):
    """-> dq, dk, dv in the dtypes of q, k, v. lse [B, T, H] from the forward."""
    B, T, H, _ = q.shape
    chunk = chunk_size or default_chunk_size(q)
    dq = torch.empty_like(q)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)  # [B, T, Hk, D]
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)  # [B, T, Hk, Dv]
    one_kv_head = k.shape[2] == 1 and H > 1
    for q0 in range(0, T, chunk):
        q1 = min(T, q0 + chunk)
        logits, k0 = dense_attention_logits(q, k, scale, doc_start, q0, q1)  # [B, H, C, S]
        row_lse = lse[:, q0:q1].transpose(1, 2).float()  # [B, H, C]
        row_lse = torch.where(torch.isfinite(row_lse), row_lse, torch.zeros_like(row_lse))
        probs = torch.exp_(logits.sub_(row_lse[..., None]))  # P, 0 where masked
        del logits
        do_heads = grad_out[:, q0:q1].float().transpose(1, 2)  # [B, H, C, Dv]
        v_heads = v[:, k0:q1].float().transpose(1, 2)  # [B, Hk, S, Dv]
        k_heads = k[:, k0:q1].float().transpose(1, 2)  # [B, Hk, S, D]
        q_heads = q[:, q0:q1].float().transpose(1, 2)  # [B, H, C, D]
        dv_chunk = torch.matmul(probs.transpose(-1, -2), do_heads)  # [B, H, S, Dv]
        dp = torch.matmul(do_heads, v_heads.transpose(-1, -2))  # [B, H, C, S]
        delta = (probs * dp).sum(-1, keepdim=True)  # [B, H, C, 1]
        ds = dp.sub_(delta).mul_(probs).mul_(scale)  # dS * scale
        del probs, dp
        dq[:, q0:q1] = torch.matmul(ds, k_heads).transpose(1, 2)  # [B, C, H, D]
        dk_chunk = torch.matmul(ds.transpose(-1, -2), q_heads)  # [B, H, S, D]
        if one_kv_head:
            dk_chunk, dv_chunk = dk_chunk.sum(1, keepdim=True), dv_chunk.sum(1, keepdim=True)
        dk[:, k0:q1] += dk_chunk.transpose(1, 2)
        dv[:, k0:q1] += dv_chunk.transpose(1, 2)
    return dq, dk.to(k.dtype), dv.to(v.dtype)


def dense_attention_ref(q, k, v, scale, doc_start, chunk_size=None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (out [B, T, H, Dv] in q's dtype, lse [B, T, H] fp32, never differentiable).
    The reference's forward; under autograd `DenseAttentionFunction` (forward keeps out + lse,
    backward recomputes each chunk's probabilities from lse)."""
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        return DenseAttentionFunction.apply(q, k, v, scale, doc_start, chunk_size)
    return dense_attention_fwd_ref(q, k, v, scale, doc_start, chunk_size)
