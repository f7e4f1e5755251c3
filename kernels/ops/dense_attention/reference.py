"""Dense causal attention with packed-document masks, chunked over queries: PyTorch reference.

Used by MLA's dense mode in both of its forms:
  MHA form: q [B, T, H, 192], k [B, T, H, 192], v [B, T, H, 128]
  MQA form: q [B, T, H, 576], k [B, T, 1, 576], v [B, T, 1, 512]   (one key/value head)
Query t sees keys doc_start[t] <= s <= t. Only a [B, C, H, S] block of scores exists at a time;
under autograd each chunk is recomputed in backward, so no [H, T, T] tensor is ever kept.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from ...masking import chunk_key_range, chunk_valid_mask, query_chunk_size
from ..sparse_mla.reference import safe_softmax


def dense_attention_logits(
    q: torch.Tensor, k: torch.Tensor, scale: float, doc_start: torch.Tensor, q0: int, q1: int
) -> tuple[torch.Tensor, int]:
    """Masked fp32 logits [B, H, C, S] (contiguous per head) of queries [q0, q1) over their key
    window [k0, q1), and k0."""
    k0, k1 = chunk_key_range(doc_start, q0, q1)
    q_heads = q[:, q0:q1].float().transpose(1, 2)  # [B, H, C, D]
    k_heads = k[:, k0:k1].float().permute(0, 2, 3, 1)  # [B, Hk, D, S]; Hk = 1 broadcasts
    logits = torch.matmul(q_heads * scale, k_heads)  # [B, H, C, S]
    valid = chunk_valid_mask(doc_start, q0, q1, k0, k1)  # [B, C, S]
    return logits.masked_fill_(~valid[:, None], float("-inf")), k0


def _dense_chunk(q, k, v, scale, doc_start, q0, q1):
    logits, k0 = dense_attention_logits(q, k, scale, doc_start, q0, q1)
    probs, lse = safe_softmax(logits)  # [B, H, C, S]
    v_heads = v[:, k0:q1].float().transpose(1, 2)  # [B, Hk, S, Dv]
    out = torch.matmul(probs, v_heads).transpose(1, 2)  # [B, C, H, Dv]
    return out.to(q.dtype), lse.transpose(1, 2)


def dense_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    doc_start: torch.Tensor,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (out [B, T, H, Dv], lse [B, T, H] fp32)."""
    B, T, H, D = q.shape
    chunk = chunk_size or query_chunk_size(T, per_query_elems=B * H * T * 2)
    use_ckpt = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    outs, lses = [], []
    for q0 in range(0, T, chunk):
        q1 = min(T, q0 + chunk)
        args = (q, k, v, scale, doc_start, q0, q1)
        o, l = checkpoint(_dense_chunk, *args, use_reentrant=False) if use_ckpt else _dense_chunk(*args)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)
