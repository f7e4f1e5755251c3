"""Dense attention's autograd Function over the Triton kernels (`kernel.py`), MHA form, and its
entry `dense_attention_triton`. The kernel module (and triton) is imported when the Function
first runs, so importing `dsa_kernels` never imports triton."""

from __future__ import annotations

import torch

from ..._triton_common import compute_dtype, kernel_input


class DenseAttentionTritonFunction(torch.autograd.Function):
    """The same op on the Triton kernels (`kernel.py`): MHA form only (k / v with H heads)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, doc_start):
        from .custom import dense_attention_fwd
        from .kernel import doc_ends

        B, T, H, _ = q.shape
        # fp32 inputs on the compiled path: computed in bf16 (fp32 dots would be TF32; one warning)
        cdt = compute_dtype("dense_attention", q, k, v)
        q_c, k_c, v_c = (kernel_input(x, cdt) for x in (q, k, v))
        ds = doc_start.to(torch.int32).contiguous()
        out, lse = dense_attention_fwd(q_c, k_c, v_c, ds, scale)  # a custom op (`dsa_kernels.custom_ops`)
        de = doc_ends(ds).to(torch.int32).contiguous()
        ctx.save_for_backward(q_c, k_c, v_c, out, lse, ds, de)
        ctx.scale = scale
        ctx.dtypes = (q.dtype, k.dtype, v.dtype)
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, _grad_lse):
        from .custom import dense_attention_bwd

        q, k, v, out, lse, ds, de = ctx.saved_tensors
        dout = grad_out.to(q.dtype).contiguous()
        # rowsum(dO * O) (`row_dot`, DELTA_CHUNK_ELEMS) and the kernels, as one custom op
        dq, dk, dv = dense_attention_bwd(q, k, v, out, lse, dout, ds, de, ctx.scale)
        return dq.to(ctx.dtypes[0]), dk.to(ctx.dtypes[1]), dv.to(ctx.dtypes[2]), None, None



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
