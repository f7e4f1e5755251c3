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

from .masking import chunk_key_range, chunk_valid_mask, query_chunk_size
from .sparse_mla import safe_softmax


def dense_attention_logits(
    q: torch.Tensor, k: torch.Tensor, scale: float, doc_start: torch.Tensor, q0: int, q1: int
) -> tuple[torch.Tensor, int]:
    """Masked fp32 logits [B, C, H, S] of queries [q0, q1) over their key window, and k0."""
    k0, k1 = chunk_key_range(doc_start, q0, q1)
    logits = torch.einsum("bchd,bshd->bchs", q[:, q0:q1].float(), _expand_heads(k[:, k0:k1], q.shape[2]).float())
    valid = chunk_valid_mask(doc_start, q0, q1, k0, k1)  # [B, C, S]
    return (logits * scale).masked_fill(~valid[:, :, None, :], float("-inf")), k0


def _expand_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    return x if x.shape[2] == num_heads else x.expand(-1, -1, num_heads, -1)


def _dense_chunk(q, k, v, scale, doc_start, q0, q1):
    logits, k0 = dense_attention_logits(q, k, scale, doc_start, q0, q1)
    probs, lse = safe_softmax(logits)  # [B, C, H, S]
    v_win = _expand_heads(v[:, k0:q1], q.shape[2]).float()
    out = torch.einsum("bchs,bshd->bchd", probs, v_win)
    return out.to(q.dtype), lse


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
