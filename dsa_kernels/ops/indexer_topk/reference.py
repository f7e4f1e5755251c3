"""Lightning indexer scores (report eq. 1) and top-k token selection (eq. 2): PyTorch reference.

    I[t, s] = sum_j w[t, j] * ReLU(q_I[t, j] . k_I[s])      for doc_start[t] <= s <= t

Shapes: q_I [B, T, H_I, D_I] (roped, optionally Hadamard-rotated), k_I [B, T, D_I] (one key head
shared by all indexer heads), w [B, T, H_I] fp32 with the H_I^-1/2 * D_I^-1/2 scale folded in,
doc_start [B, T]. The [T, T] score matrix exists only one query chunk at a time.

Top-k convention: invalid keys score -inf; non-finite scores (+inf, NaN) are treated as invalid
keys; a row with fewer than k valid keys returns all of them followed by -1 slots (score -inf),
so the -1 slots are always the tail. Ties are broken towards the lower key index (a stable sort),
so the selected set is deterministic.
"""

from __future__ import annotations

import torch

from ...masking import chunk_key_range, chunk_valid_mask, query_chunk_size


FP8_GROUP = 128  # channels per FP8 scale (e4m3 with one fp32 scale per 128 channels)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_AMAX_FLOOR = 1e-4  # DeepSeek-V3.2's act_quant floors each group's amax here (an all-zero group: scale 1e-4 / 448)


def ue8m0_scale(scale: torch.Tensor) -> torch.Tensor:
    """Positive normal fp32 scales -> the next power of two at or above each (V3.2's
    `fast_round_scale`, from the bits: exponent + 1 unless the mantissa is zero), exactly."""
    bits = scale.float().contiguous().view(torch.int32)
    exp = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return torch.ldexp(torch.ones_like(scale, dtype=torch.float32), exp)


def quantize_fp8_groups(x: torch.Tensor, group: int = FP8_GROUP, ue8m0: bool = False):
    """x [..., D] -> (e4m3 [..., D], fp32 scales [..., ceil(D / group)]): one scale per `group`
    channels (the last group may be partial), dequantized = fp8 * scale. As DeepSeek-V3.2's
    inference `act_quant` (block 128): scale = max(amax, 1e-4) / 448, with ue8m0 rounded up to a
    power of two; fp8 = e4m3(clamp(x / scale, +-448)) rounded to nearest even."""
    D = x.shape[-1]
    G = -(-D // group)
    pad = G * group - D
    xf = torch.nn.functional.pad(x.float(), (0, pad)) if pad else x.float()
    xg = xf.view(*x.shape[:-1], G, group)
    amax = xg.abs().amax(-1).clamp_min(FP8_AMAX_FLOOR)
    scale = amax / FP8_MAX
    if ue8m0:
        scale = ue8m0_scale(scale)
    q = (xg / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.view(*x.shape[:-1], G * group)[..., :D]
    return q.contiguous(), scale.contiguous()


def index_scores_block(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor
) -> torch.Tensor:
    """q [B, C, H, D], k [B, S, D], w [B, C, H] -> scores [B, C, S] fp32 (no masking)."""
    B, C, H, D = q.shape
    S = k.shape[1]
    logits = torch.matmul(q.float().reshape(B, C * H, D), k.float().transpose(1, 2))  # [B, C*H, S]
    relu = torch.relu(logits).view(B * C, H, S)
    return torch.bmm(w.float().reshape(B * C, 1, H), relu).view(B, C, S)


def index_scores_ref(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, doc_start: torch.Tensor, q0: int, q1: int
) -> tuple[torch.Tensor, int]:
    """Masked scores of queries [q0, q1) against their key window -> ([B, C, S] with -inf, k0)."""
    k0, k1 = chunk_key_range(doc_start, q0, q1)
    scores = index_scores_block(q[:, q0:q1], k[:, k0:k1], w[:, q0:q1])
    valid = chunk_valid_mask(doc_start, q0, q1, k0, k1)
    return scores.masked_fill(~valid, float("-inf")), k0


def topk_from_scores(scores: torch.Tensor, topk: int, key_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [B, C, S] (-inf = invalid) -> (indices [B, C, topk] int32 with -1, values [B, C, topk])."""
    B, C, S = scores.shape
    kk = min(topk, S)
    # a non-finite score (+inf or NaN from bad inputs) is never selected: it counts as a masked key,
    # so the -1 slots are always the row's tail
    scores = torch.where(torch.isfinite(scores), scores, torch.full_like(scores, float("-inf")))
    values, order = torch.sort(scores, dim=-1, descending=True, stable=True)
    values, order = values[..., :kk], order[..., :kk]
    indices = torch.where(torch.isfinite(values), order + key_offset, torch.full_like(order, -1))
    if kk < topk:
        pad = topk - kk
        indices = torch.cat([indices, indices.new_full((B, C, pad), -1)], dim=-1)
        values = torch.cat([values, values.new_full((B, C, pad), float("-inf"))], dim=-1)
    return indices.to(torch.int32), values


@torch.no_grad()
def indexer_topk_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    doc_start: torch.Tensor,
    topk: int,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k keys per query -> (topk_indices [B, T, topk] int32, -1 invalid; topk_scores fp32)."""
    B, T, H, _ = q.shape
    chunk = chunk_size or query_chunk_size(T, per_query_elems=B * H * T)
    all_idx, all_val = [], []
    for q0 in range(0, T, chunk):
        q1 = min(T, q0 + chunk)
        scores, k0 = index_scores_ref(q, k, w, doc_start, q0, q1)
        idx, val = topk_from_scores(scores, topk, key_offset=k0)
        all_idx.append(idx)
        all_val.append(val)
    return torch.cat(all_idx, dim=1), torch.cat(all_val, dim=1)


@torch.no_grad()
def indexer_topk_at_positions_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    doc_start: torch.Tensor,
    topk: int,
    query_positions: torch.Tensor,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k for queries at global `query_positions` [Tq] (context parallelism: a rank holds some
    of the sequence's queries) over every key. q [B, Tq, H, D], w [B, Tq, H]; k [B, T, D] and
    doc_start [B, T] of the whole sequence -> (indices [B, Tq, topk] int32, scores fp32)."""
    B, Tq, H, _ = q.shape
    chunk = positions_chunk_size(q, k, chunk_size)
    all_idx, all_val = [], []
    for q0 in range(0, Tq, chunk):
        pos = query_positions[q0 : q0 + chunk]
        k0, k1 = int(doc_start[:, pos].min()), int(pos.max()) + 1
        idx, val = topk_in_window(q[:, q0 : q0 + chunk], k, w[:, q0 : q0 + chunk], doc_start, pos, k0, k1, topk)
        all_idx.append(idx)
        all_val.append(val)
    return torch.cat(all_idx, dim=1), torch.cat(all_val, dim=1)


def positions_chunk_size(q: torch.Tensor, k: torch.Tensor, chunk_size: int | None = None) -> int:
    """Queries per chunk of `indexer_topk_at_positions_ref`: a [chunk * H_I, T] fp32 logit block
    within `query_chunk_size`'s budget."""
    B, Tq, H, _ = q.shape
    return chunk_size or query_chunk_size(Tq, per_query_elems=B * H * k.shape[1])


def topk_in_window(q_c, k, w_c, doc_start, pos, k0: int, k1: int, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of `indexer_topk_at_positions_ref`: queries at global positions `pos` [C]
    (q_c [B, C, H, D], w_c [B, C, H]) against keys [k0, k1) of k [B, T, D]."""
    scores = index_scores_block(q_c, k[:, k0:k1], w_c)
    s = torch.arange(k0, k1, device=k.device)
    valid = (s[None, None, :] <= pos[None, :, None]) & (s[None, None, :] >= doc_start[:, pos, None])
    return topk_from_scores(scores.masked_fill(~valid, float("-inf")), topk, key_offset=k0)


def gather_index_scores(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, indices: torch.Tensor
) -> torch.Tensor:
    """Differentiable scores at selected keys: q [B,C,H,D], k [B,T,D], w [B,C,H], indices [B,C,K]
    -> [B, C, K] fp32 with -inf at -1 slots."""
    valid = indices >= 0
    safe = indices.clamp(min=0).long()
    B, C, K = safe.shape
    k_sel = torch.gather(k, 1, safe.reshape(B, C * K, 1).expand(-1, -1, k.shape[-1])).view(B, C, K, -1)
    logits = torch.einsum("bchd,bckd->bchk", q.float(), k_sel.float())
    scores = torch.einsum("bchk,bch->bck", torch.relu(logits), w.float())
    return scores.masked_fill(~valid, float("-inf"))
