"""Dense attention as a flash-style autograd Function in PyTorch (the CPU path under autograd).

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


class DenseAttentionTritonFunction(torch.autograd.Function):
    """The same op on the Triton kernels (`kernel.py`): MHA form only (k / v with H heads)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, doc_start):
        from ..._triton_common import compute_dtype, kernel_input
        from .kernel import doc_ends, plan_fwd

        B, T, H, _ = q.shape
        # fp32 inputs on the compiled path: computed in bf16 (fp32 dots would be TF32; one warning)
        cdt = compute_dtype("dense_attention", q, k, v)
        q_c, k_c, v_c = (kernel_input(x, cdt) for x in (q, k, v))
        ds = doc_start.to(torch.int32).contiguous()
        out = torch.empty(B, T, H, v.shape[-1], dtype=q_c.dtype, device=q.device)
        lse = torch.empty(B, T, H, dtype=torch.float32, device=q.device)
        if B * T * H > 0:
            plan_fwd(q_c, k_c, v_c, ds, out, lse, scale).run()
        de = doc_ends(ds).to(torch.int32).contiguous()
        ctx.save_for_backward(q_c, k_c, v_c, out, lse, ds, de)
        ctx.scale = scale
        ctx.dtypes = (q.dtype, k.dtype, v.dtype)
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, _grad_lse):
        from ..._triton_common import row_dot
        from .kernel import plan_bwd

        q, k, v, out, lse, ds, de = ctx.saved_tensors
        dout = grad_out.to(q.dtype).contiguous()
        delta = row_dot(dout, out, DELTA_CHUNK_ELEMS)  # [B, T, H] = rowsum(dO * O), fp32
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        if q.numel() > 0:
            for launch in plan_bwd(q, k, v, dout, lse, delta, ds, de, dq, dk, dv, ctx.scale):
                launch.run()
        return dq.to(ctx.dtypes[0]), dk.to(ctx.dtypes[1]), dv.to(ctx.dtypes[2]), None, None


DELTA_CHUNK_ELEMS = 1 << 24  # fp32 elements of the backward's rowsum(dO * O) temporary (64 MB; `row_dot`)


def triton_supports(q, k, v) -> bool:
    """The Triton kernels take the MHA form (per-head k / v) with head dims up to 256 (MLA's
    192 / 128); the MQA form (one 576-dim key head) runs the PyTorch path."""
    return k.shape[2] == q.shape[2] and v.shape[2] == q.shape[2] and q.shape[-1] <= 256 and v.shape[-1] <= 256


def dense_attention_triton(q, k, v, scale, doc_start, chunk_size=None):
    """Same contract as `dense_attention_ref` (chunk_size accepted and ignored), MHA form."""
    if not triton_supports(q, k, v):
        raise ValueError(
            f"the Triton dense attention takes per-head k / v with head dims <= 256; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)} (use dense_attention, which picks the PyTorch path)"
        )
    return DenseAttentionTritonFunction.apply(q, k, v, float(scale), doc_start)
