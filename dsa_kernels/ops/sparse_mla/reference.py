"""Sparse MLA attention in MQA (absorbed) mode over top-k indices: PyTorch reference.

Every head of query t attends over the same selected keys S_t (report eq. 2):

    o[t, h] = sum_{i: idx[t,i] >= 0} softmax_i(scale * q[t,h] . kv[idx[t,i]]) * kv[idx[t,i], :d_v]

Shapes: q [B, T, H, D] with D = kv_lora_rank + qk_rope_head_dim (576 in the 671B model; the
nope part already multiplied by W_UK), kv [B, T, D] = [latent | k_rope], indices [B, T, K] int
(-1 = empty slot, never read). Returns o [B, T, H, d_v] and the log-sum-exp [B, T, H] (fp32;
-inf on a row with no valid slot, whose output is 0 rather than NaN).

Memory: one query chunk's gathered keys [B, C, K, D] at a time; under autograd each chunk is
recomputed in backward (activation checkpointing), so nothing of size T x K x D is kept.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from ...masking import query_chunk_size


def gather_kv(kv: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """kv [B, T, D], indices [B, C, K] (-1 allowed) -> [B, C, K, D] (row 0 at -1 slots; mask them)."""
    B, C, K = indices.shape
    T, D = kv.shape[1], kv.shape[-1]
    rows = indices.clamp(min=0).long() + (torch.arange(B, device=kv.device) * T)[:, None, None]
    return kv.reshape(B * T, D).index_select(0, rows.reshape(-1)).view(B, C, K, D)  # whole rows copied


def sparse_attention_scores(q: torch.Tensor, kv_sel: torch.Tensor, indices: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, C, H, D], kv_sel [B, C, K, D] -> fp32 logits [B, C, H, K], -inf at empty slots."""
    logits = torch.einsum("bchd,bckd->bchk", q.float(), kv_sel.float()) * scale
    return logits.masked_fill((indices < 0)[:, :, None, :], float("-inf"))


def safe_softmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the last dim that gives 0 (not NaN) on all -inf rows, plus its log-sum-exp."""
    row_max = logits.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)).detach()
    unnormalized = torch.exp(logits - row_max)
    denom = unnormalized.sum(dim=-1, keepdim=True)
    probs = unnormalized / denom.clamp_min(torch.finfo(denom.dtype).tiny)
    lse = (row_max + torch.log(denom)).squeeze(-1)  # -inf on empty rows
    return probs, lse


def _sparse_mla_chunk(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float, d_v: int):
    kv_sel = gather_kv(kv, indices)  # [B, C, K, D]
    logits = sparse_attention_scores(q, kv_sel, indices, scale)  # [B, C, H, K]
    probs, lse = safe_softmax(logits)  # [B, C, H, K], [B, C, H]
    out = torch.einsum("bchk,bckd->bchd", probs, kv_sel[..., :d_v].float())
    return out.to(q.dtype), lse


def sparse_mla_ref(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    d_v: int,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    B, T, H, D = q.shape
    K = indices.shape[-1]
    chunk = chunk_size or query_chunk_size(T, per_query_elems=B * K * (D + 2 * H))
    use_ckpt = torch.is_grad_enabled() and (q.requires_grad or kv.requires_grad)
    outs, lses = [], []
    for q0 in range(0, T, chunk):
        q1 = min(T, q0 + chunk)
        args = (q[:, q0:q1], kv, indices[:, q0:q1], scale, d_v)
        if use_ckpt:
            o, l = checkpoint(_sparse_mla_chunk, *args, use_reentrant=False)
        else:
            o, l = _sparse_mla_chunk(*args)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)
