"""Causal + packed-document masks, built one query chunk at a time.

A packed row holds several documents; a document starts wherever the position ids restart
(`position_ids[t] != position_ids[t-1] + 1`). Query t may read key s iff
`doc_start[t] <= s <= t`. Nothing here builds a [T, T] mask: callers ask for the
[chunk, keys] block they are about to use.
"""

from __future__ import annotations

import torch


def doc_starts_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] position ids -> [B, T] index of the first token of each token's document."""
    B, T = position_ids.shape
    idx = torch.arange(T, device=position_ids.device).expand(B, T)
    is_start = torch.ones_like(position_ids, dtype=torch.bool)
    is_start[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    starts = torch.where(is_start, idx, torch.zeros_like(idx))
    return torch.cummax(starts, dim=1).values


def doc_starts_from_cu_seqlens(cu_seqlens: torch.Tensor, total_len: int) -> torch.Tensor:
    """cu_seqlens [n_docs + 1] (flash-attn style, one packed row) -> [1, T] document starts."""
    cu = cu_seqlens.to(torch.long)
    if cu[0] != 0 or cu[-1] != total_len or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(
            f"cu_seqlens must start at 0, end at the sequence length {total_len} and not decrease; "
            f"got {cu.tolist()}"
        )
    lengths = cu[1:] - cu[:-1]
    return torch.repeat_interleave(cu[:-1], lengths).unsqueeze(0)


def chunk_valid_mask(doc_start: torch.Tensor, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
    """[B, q1-q0, k1-k0] bool: key s in [k0, k1) is visible to query t in [q0, q1)."""
    t = torch.arange(q0, q1, device=doc_start.device)[:, None]
    s = torch.arange(k0, k1, device=doc_start.device)[None, :]
    causal = s <= t  # [C, S]
    same_doc = s >= doc_start[:, q0:q1, None]  # [B, C, S]
    return causal[None] & same_doc


def chunk_key_range(doc_start: torch.Tensor, q0: int, q1: int) -> tuple[int, int]:
    """The key window [k0, k1) any query of the chunk can see (causality bounds it by q1)."""
    return int(doc_start[:, q0:q1].min()), q1


def query_chunk_size(seq_len: int, per_query_elems: int, budget_elems: int = 1 << 24) -> int:
    """Queries per chunk so that a [chunk, per_query_elems] fp32 block stays within budget."""
    return max(1, min(seq_len, budget_elems // max(per_query_elems, 1)))
