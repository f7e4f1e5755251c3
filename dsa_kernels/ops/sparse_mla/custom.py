"""The sparse MLA launchers (`kernel.py`) as custom ops (`dsa_kernels.op_registry`: fake outputs for
`dsa-train plan --trace`; real tensors call the launchers directly)."""

from __future__ import annotations

import torch

from ...op_registry import f32_empty, kernel_op


# ----------------------------------------------------------------------------- sparse MLA
def _smla_fwd_fake(q, kv, indices, n_slots, scale, d_v, target=False):
    B, T, H, _ = q.shape
    p_sum = f32_empty(q, B, T, indices.shape[-1]) if target else f32_empty(q, 0)
    return q.new_empty((B, T, H, d_v)), f32_empty(q, B, T, H), p_sum


@kernel_op("dsa_kernels::sparse_mla_fwd", fake=_smla_fwd_fake)
def sparse_mla_fwd(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, n_slots: torch.Tensor, scale: float,
                   d_v: int, target: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """out [B, T, H, d_v] (q's dtype), lse [B, T, H] fp32 and, with `target`, the sparse KL's target
    p_sum [B, T, K] fp32 (Sigma_h P per slot; an empty tensor without)."""
    from .kernel import sparse_mla_fwd as launch

    if not target:
        out, lse = launch(q, kv, indices, n_slots, scale, d_v)
        return out, lse, q.new_empty(0, dtype=torch.float32)
    p_sum = torch.zeros((*indices.shape[:2], indices.shape[-1]), dtype=torch.float32, device=q.device)
    out, lse = launch(q, kv, indices, n_slots, scale, d_v, p_sum)
    return out, lse, p_sum


def _smla_bwd_fake(q, kv, indices, n_slots, out, lse, dout, dlse, scale, d_v):
    return torch.empty_like(q), torch.empty_like(kv)


def _smla_bwd_workspace(q, kv, indices, n_slots, out, lse, dout, dlse, scale, d_v):
    from .kernel import DELTA_CHUNK_ELEMS

    B, T, H, D = q.shape
    delta = f32_empty(q, B, T, H)  # rowsum(dO * O) - dlse
    prod = f32_empty(q, min(T, max(1, DELTA_CHUNK_ELEMS // max(B * H * out.shape[-1], 1))) * B * H * out.shape[-1])
    del prod
    acc = f32_empty(kv, *kv.shape)  # dkv's fp32 accumulator
    del delta, acc


@kernel_op("dsa_kernels::sparse_mla_bwd", fake=_smla_bwd_fake, workspace=_smla_bwd_workspace)
def sparse_mla_bwd(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, n_slots: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None, scale: float, d_v: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """dq (q's shape and dtype), dkv (kv's)."""
    from .kernel import sparse_mla_bwd as launch

    return launch(q, kv, indices, n_slots, out, lse, dout, dlse, scale, d_v)
