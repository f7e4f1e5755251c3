"""Dense causal attention with packed-document masks: the plain PyTorch reference (the spec).

    o[t, h] = sum_{doc_start[t] <= s <= t} softmax_s(scale * q[t, h] . k[s, h]) * v[s, h]
    lse[t, h] = log sum_s exp(scale * q[t, h] . k[s, h])

Used by MLA's dense mode in both of its forms:
  MHA form: q [B, T, H, 192], k [B, T, H, 192], v [B, T, H, 128]
  MQA form: q [B, T, H, 576], k [B, T, 1, 576], v [B, T, 1, 512]   (one key/value head)
Query t sees keys doc_start[t] <= s <= t. Computed one query chunk at a time in fp32: only a
[B, H, C, S] block of scores exists at once, never [H, T, T]. lse is fp32, and a row with no
visible key (cannot happen for causal rows, but may in a caller's mask) gives o = 0, lse = -inf.
"""

from __future__ import annotations

import torch

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


def dense_attention_chunk(q, k, v, scale, doc_start, q0, q1) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries [q0, q1): -> out [B, C, H, Dv] (fp32), lse [B, C, H] (fp32)."""
    logits, k0 = dense_attention_logits(q, k, scale, doc_start, q0, q1)
    probs, lse = safe_softmax(logits)  # [B, H, C, S], [B, H, C]
    v_heads = v[:, k0:q1].float().transpose(1, 2)  # [B, Hv, S, Dv]
    out = torch.matmul(probs, v_heads).transpose(1, 2)  # [B, C, H, Dv]
    return out, lse.transpose(1, 2)


def default_chunk_size(q: torch.Tensor) -> int:
    B, T, H, _ = q.shape
    return query_chunk_size(T, per_query_elems=B * H * T * 2)


@torch.no_grad()
def dense_attention_fwd_ref(q, k, v, scale, doc_start, chunk_size=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward only (no graph): -> out [B, T, H, Dv] in q's dtype, lse [B, T, H] fp32."""
    B, T, H, _ = q.shape
    chunk = chunk_size or default_chunk_size(q)
    out = q.new_empty(B, T, H, v.shape[-1])
    lse = torch.empty(B, T, H, dtype=torch.float32, device=q.device)
    for q0 in range(0, T, chunk):
        q1 = min(T, q0 + chunk)
        out[:, q0:q1], lse[:, q0:q1] = dense_attention_chunk(q, k, v, scale, doc_start, q0, q1)
    return out, lse

