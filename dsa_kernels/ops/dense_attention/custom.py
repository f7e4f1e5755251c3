"""The dense attention launchers (`kernel.py`) as custom ops (`dsa_kernels.op_registry`: fake outputs
for `dsa-train plan --trace`; real tensors call the launchers directly)."""

from __future__ import annotations

import torch

from ...op_registry import f32_empty, kernel_op


# ----------------------------------------------------------------------------- dense attention (MHA form)
def _da_fwd_fake(q, k, v, doc_start, scale):
    B, T, H, _ = q.shape
    return q.new_empty((B, T, H, v.shape[-1])), f32_empty(q, B, T, H)


@kernel_op("dsa_kernels::dense_attention_fwd", fake=_da_fwd_fake)
def dense_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_start: torch.Tensor, scale: float
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k, v in the compute dtype (contiguous), doc_start int32 -> out [B, T, H, Dv] (q's dtype), lse fp32."""
    from .kernel import plan_fwd

    B, T, H, _ = q.shape
    out = torch.empty(B, T, H, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(B, T, H, dtype=torch.float32, device=q.device)
    if B * T * H > 0:
        plan_fwd(q, k, v, doc_start, out, lse, scale).run()
    return out, lse


def _da_bwd_fake(q, k, v, out, lse, dout, doc_start, doc_end, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _da_bwd_workspace(q, k, v, out, lse, dout, doc_start, doc_end, scale):
    from .kernel import DELTA_CHUNK_ELEMS

    B, T, H, Dv = out.shape
    delta = f32_empty(q, B, T, H)
    prod = f32_empty(q, min(T, max(1, DELTA_CHUNK_ELEMS // max(B * H * Dv, 1))) * B * H * Dv)
    del delta, prod


@kernel_op("dsa_kernels::dense_attention_bwd", fake=_da_bwd_fake, workspace=_da_bwd_workspace)
def dense_attention_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                        dout: torch.Tensor, doc_start: torch.Tensor, doc_end: torch.Tensor, scale: float
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv in q's / k's / v's shape and dtype (dout contiguous, in q's dtype)."""
    from ..._triton_common import row_dot

    from .kernel import DELTA_CHUNK_ELEMS
    from .kernel import plan_bwd

    delta = row_dot(dout, out, DELTA_CHUNK_ELEMS)  # [B, T, H] = rowsum(dO * O), fp32
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if q.numel() > 0:
        for launch in plan_bwd(q, k, v, dout, lse, delta, doc_start, doc_end, dq, dk, dv, scale):
            launch.run()
    return dq, dk, dv
