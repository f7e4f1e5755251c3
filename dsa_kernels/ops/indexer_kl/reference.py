"""Indexer KL losses (report eqs. 3 and 4): PyTorch reference, chunked over queries.

Target (both stages): p[t, :] = L1-normalize( sum_h softmax_s(main attention logits of head h) ).
Each head's softmax sums to 1 over the keys it sees, so the L1 normalization is a division by H.
The target is computed without gradient: the indexer learns only from this loss and the main
model never receives gradient from it.

  eq. 3 (dense warm-up):  sum_t KL( p[t, :]   || softmax(I[t, :]) )     over all valid s <= t
  eq. 4 (sparse stage):   sum_t KL( p[t, S_t] || softmax(I[t, S_t]) )   over the selected keys

Both return (kl_sum, stats): kl_sum is differentiable w.r.t. the indexer tensors (q_I, k_I, w);
stats holds detached sums: "kl", "kl_uniform" (KL of p against the uniform distribution over the
same keys, the value an untrained indexer gets) and "queries" (number of query tokens).
Chunks are recomputed in backward, so memory stays O(chunk * T * heads).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from ..dense_attention.reference import dense_attention_logits
from ..indexer_topk.reference import gather_index_scores, index_scores_ref
from ...masking import query_chunk_size
from ..sparse_mla.reference import gather_kv, safe_softmax, sparse_attention_scores


def kl_rows(p: torch.Tensor, index_scores: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row KL(p || softmax(scores)) and KL(p || uniform) over valid entries. [..., S] -> [...]."""
    log_q = torch.log_softmax(index_scores.masked_fill(~valid, float("-inf")), dim=-1)
    p_log_p = torch.where(p > 0, p * torch.log(p.clamp_min(1e-38)), torch.zeros_like(p))
    p_log_q = torch.where(p > 0, p * log_q, torch.zeros_like(p))
    kl = (p_log_p - p_log_q).sum(-1)
    n_valid = valid.sum(-1).clamp_min(1).float()
    kl_uniform = p_log_p.sum(-1) + torch.log(n_valid)
    return kl, kl_uniform


def dense_target(q_main, k_main, scale, doc_start, q0, q1, lse_main=None) -> tuple[torch.Tensor, int]:
    """Head-summed, L1-normalized main-attention probabilities of queries [q0, q1) over their key
    window [k0, q1): -> p [B, C, S], k0. With the forward's log-sum-exp lse_main [B, T, H] the
    probabilities are exp(logits - lse) (one pass, no softmax reductions); without it, a softmax."""
    logits, k0 = dense_attention_logits(q_main, k_main, scale, doc_start, q0, q1)  # [B, H, C, S]
    if lse_main is None:
        probs, _ = safe_softmax(logits)
    else:
        lse = lse_main[:, q0:q1].transpose(1, 2).float()  # [B, H, C]
        lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        probs = torch.exp_(logits.sub_(lse[..., None]))  # 0 where masked
    return probs.sum(dim=1).div_(probs.shape[1]), k0


def _dense_kl_chunk(q_idx, k_idx, w_idx, q_main, k_main, scale, doc_start, q0, q1, lse_main=None):
    with torch.no_grad():
        p, k0 = dense_target(q_main, k_main, scale, doc_start, q0, q1, lse_main)  # [B, C, S]
    scores, k0_idx = index_scores_ref(q_idx, k_idx, w_idx, doc_start, q0, q1)  # [B, C, S]
    assert k0_idx == k0
    valid = torch.isfinite(scores)
    kl, kl_uniform = kl_rows(p, scores, valid)
    return kl.sum(), kl_uniform.sum().detach()


def dense_indexer_kl_ref(
    q_idx: torch.Tensor,  # [B, T, H_I, D_I]
    k_idx: torch.Tensor,  # [B, T, D_I]
    w_idx: torch.Tensor,  # [B, T, H_I] fp32, scales folded in
    q_main: torch.Tensor,  # [B, T, H, D]
    k_main: torch.Tensor,  # [B, T, H or 1, D]
    scale: float,
    doc_start: torch.Tensor,  # [B, T]
    chunk_size: int | None = None,
    lse_main: torch.Tensor | None = None,  # [B, T, H] fp32 from dense_attention (reused for p)
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Eq. 3 summed over query tokens."""
    B, T = doc_start.shape
    heads = max(q_main.shape[2], q_idx.shape[2])
    chunk = chunk_size or query_chunk_size(T, per_query_elems=B * heads * T * 3)
    use_ckpt = torch.is_grad_enabled() and any(x.requires_grad for x in (q_idx, k_idx, w_idx))
    kl_total = q_idx.new_zeros((), dtype=torch.float32)
    kl_uniform_total = torch.zeros((), dtype=torch.float32)
    for q0 in range(0, T, chunk):
        q1 = min(T, q0 + chunk)
        args = (q_idx, k_idx, w_idx, q_main, k_main, scale, doc_start, q0, q1, lse_main)
        kl, klu = checkpoint(_dense_kl_chunk, *args, use_reentrant=False) if use_ckpt else _dense_kl_chunk(*args)
        kl_total = kl_total + kl
        kl_uniform_total = kl_uniform_total + klu
    stats = {"kl": kl_total.detach(), "kl_uniform": kl_uniform_total, "queries": torch.tensor(float(B * T))}
    return kl_total, stats


def sparse_target(q_main, kv_main, lse_main, indices, scale) -> torch.Tensor:
    """Head-summed main-attention probabilities over S_t, from the forward's log-sum-exp.
    q_main [B, C, H, D], kv_main [B, T, D], lse_main [B, C, H], indices [B, C, K] -> p [B, C, K]."""
    kv_sel = gather_kv(kv_main, indices)
    logits = sparse_attention_scores(q_main, kv_sel, indices, scale)  # [B, C, H, K]
    lse = torch.where(torch.isfinite(lse_main), lse_main, torch.zeros_like(lse_main)).float()
    probs = torch.exp(logits - lse[..., None])  # 0 at empty slots
    return probs.sum(dim=2) / probs.shape[2]


def _sparse_kl_chunk(q_idx, k_idx, w_idx, indices, q_main, kv_main, lse_main, scale):
    with torch.no_grad():
        p = sparse_target(q_main, kv_main, lse_main, indices, scale)
    scores = gather_index_scores(q_idx, k_idx, w_idx, indices)  # [B, C, K]
    valid = indices >= 0
    kl, kl_uniform = kl_rows(p, scores, valid)
    return kl.sum(), kl_uniform.sum().detach()


def sparse_indexer_kl_ref(
    q_idx: torch.Tensor,  # [B, T, H_I, D_I]
    k_idx: torch.Tensor,  # [B, T, D_I]
    w_idx: torch.Tensor,  # [B, T, H_I]
    indices: torch.Tensor,  # [B, T, K] int, -1 = empty
    q_main: torch.Tensor,  # [B, T, H, D] absorbed (MQA) queries
    kv_main: torch.Tensor,  # [B, T, D]
    lse_main: torch.Tensor,  # [B, T, H] from sparse_mla
    scale: float,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Eq. 4 summed over query tokens."""
    B, T, K = indices.shape
    heads = max(q_main.shape[2], q_idx.shape[2])
    chunk = chunk_size or query_chunk_size(T, per_query_elems=B * K * (heads * 2 + kv_main.shape[-1]))
    use_ckpt = torch.is_grad_enabled() and any(x.requires_grad for x in (q_idx, k_idx, w_idx))
    kl_total = q_idx.new_zeros((), dtype=torch.float32)
    kl_uniform_total = torch.zeros((), dtype=torch.float32)
    for q0 in range(0, T, chunk):
        q1 = min(T, q0 + chunk)
        args = (q_idx[:, q0:q1], k_idx, w_idx[:, q0:q1], indices[:, q0:q1], q_main[:, q0:q1], kv_main,
                lse_main[:, q0:q1], scale)
        kl, klu = checkpoint(_sparse_kl_chunk, *args, use_reentrant=False) if use_ckpt else _sparse_kl_chunk(*args)
        kl_total = kl_total + kl
        kl_uniform_total = kl_uniform_total + klu
    stats = {"kl": kl_total.detach(), "kl_uniform": kl_uniform_total, "queries": torch.tensor(float(B * T))}
    return kl_total, stats


@torch.no_grad()
def dense_mass_recall(
    q_main: torch.Tensor,  # [B, T, H, D] absorbed queries
    kv_main: torch.Tensor,  # [B, T, D]
    indices: torch.Tensor,  # [B, T, K]
    scale: float,
    doc_start: torch.Tensor,
    query_positions: torch.Tensor,  # [n] sampled query positions (same for every row)
) -> torch.Tensor:
    """Fraction of the head-summed *dense* attention mass that lands on the selected keys, averaged
    over the sampled queries (1.0 = the top-k set holds all of the attention)."""
    B, T, H, D = q_main.shape
    recalls = []
    for t in query_positions.tolist():
        logits, k0 = dense_attention_logits(q_main, kv_main[:, :, None, :], scale, doc_start, t, t + 1)
        probs, _ = safe_softmax(logits)  # [B, H, 1, S]
        p = probs.sum(dim=1)[:, 0] / H  # [B, S]
        sel = indices[:, t].long()  # [B, K]
        ok = sel >= 0
        hits = torch.zeros_like(p, dtype=torch.int32).scatter_add_(1, (sel - k0).clamp(min=0), ok.int())
        recalls.append((p * (hits > 0)).sum(-1))  # [B]
    return torch.stack(recalls).mean()
