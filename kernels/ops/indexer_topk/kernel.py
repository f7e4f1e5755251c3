"""Lightning indexer scores (eq. 1) fused with a radix top-k selection (eq. 2): Triton.

Specification: `indexer_topk.indexer_topk_ref`. Queries are processed in chunks of C rows; for a
chunk only a [B, C, W] fp32 score block exists (W = the chunk's key window), never [T, T]:

1. `_index_scores_kernel` (grid: query tiles x key tiles x batch) computes
   `sum_j w[t, j] * ReLU(q[t, j] . k[s])` for a BLOCK_M x BLOCK_N tile, head by head (one
   [BLOCK_M, D] x [D, BLOCK_N] dot per indexer head, the key tile loaded once), applies the
   causal + document mask (-inf), and canonicalizes -0.0 to +0.0 (ReLU gives many exact zeros,
   times a negative weight -0.0; both must tie). Tiles entirely above the diagonal or before
   every document start of the tile skip the dots. An FP8 path takes e4m3 q/k with one fp32
   scale per token (per head for q) per 128 channels and multiplies the per-group dot products
   by the two scales.
2. `_radix_topk_kernel` (one program per query row) selects the k largest scores exactly with
   an MSB-first radix select over the order-preserving uint32 image of the fp32 scores: four
   passes of an 8-bit histogram (`tl.histogram`, masked to the keys that match the prefix so
   far) find the bit pattern of the k-th largest score and how many of its ties to take; a
   final pass writes the selected keys in index order (all keys above the threshold, plus the
   first `take` ties, i.e. ties go to the lower index). There is no candidate buffer that
   could overflow: every pass streams the whole row. Rows with fewer than k valid keys select
   all of them; the other slots stay -1 (score -inf).
3. The k selected (score, index) pairs are ordered by a stable descending sort in PyTorch, so
   the output equals the reference's (sorted scores, ties to the lower index).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._triton_common import Launch, interp_upcast, pow2

FP8_GROUP = 128
DEFAULT_SCORE_BUDGET = 1 << 26  # fp32 elements of one query chunk's [B, C, W] score block


@triton.jit
def _index_scores_kernel(
    Q, KI, W, DS, S, QS, KS,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt,
    stride_wb, stride_wt,
    stride_db,
    stride_sb, stride_sc,
    stride_qsb, stride_qst, stride_qsh,
    stride_ksb, stride_kst,
    q0, q1, k0, W_LEN,
    HI: tl.constexpr, DI: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_c = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # row in the chunk
    offs_t = q0 + offs_c  # query position
    mask_m = offs_t < q1
    offs_w = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # column in the window
    offs_s = k0 + offs_w  # key position
    mask_n = offs_w < W_LEN
    ds = tl.load(DS + b * stride_db + offs_t, mask=mask_m, other=2147483647).to(tl.int32)

    t_max = tl.minimum(q0 + pid_m * BLOCK_M + BLOCK_M, q1) - 1
    s_min = k0 + pid_n * BLOCK_N
    s_max = s_min + BLOCK_N - 1
    live = (s_min <= t_max) & (s_max >= tl.min(ds, 0))

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if live:
        for h in range(HI):
            logits = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for d0 in range(0, DI, BLOCK_D):
                offs_d = d0 + tl.arange(0, BLOCK_D)
                mask_d = offs_d < DI
                q = tl.load(Q + b * stride_qb + offs_t[:, None].to(tl.int64) * stride_qt + h * stride_qh + offs_d[None, :],
                            mask=mask_m[:, None] & mask_d[None, :], other=0.0)
                k = tl.load(KI + b * stride_kb + offs_s[:, None].to(tl.int64) * stride_kt + offs_d[None, :],
                            mask=mask_n[:, None] & mask_d[None, :], other=0.0)
                part = tl.dot(q, tl.trans(k))
                if FP8:
                    g = d0 // 128
                    qs = tl.load(QS + b * stride_qsb + offs_t.to(tl.int64) * stride_qst + h * stride_qsh + g,
                                 mask=mask_m, other=0.0)
                    ks = tl.load(KS + b * stride_ksb + offs_s.to(tl.int64) * stride_kst + g, mask=mask_n, other=0.0)
                    part = part * qs[:, None] * ks[None, :]
                logits += part
            wh = tl.load(W + b * stride_wb + offs_t.to(tl.int64) * stride_wt + h, mask=mask_m, other=0.0).to(tl.float32)
            acc += wh[:, None] * tl.maximum(logits, 0.0)
    acc = tl.where(acc == 0.0, 0.0, acc)  # -0.0 -> +0.0
    valid = (offs_s[None, :] <= offs_t[:, None]) & (offs_s[None, :] >= ds[:, None]) & mask_n[None, :]
    acc = tl.where(valid, acc, float("-inf"))
    ptrs = S + b * stride_sb + offs_c[:, None].to(tl.int64) * stride_sc + offs_w[None, :]
    tl.store(ptrs, acc, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _sortable(x):
    """fp32 -> uint32 whose unsigned order is the float order (-inf lowest; -0.0 == +0.0)."""
    u = tl.where(x == 0.0, 0.0, x).to(tl.uint32, bitcast=True)
    return tl.where((u >> 31) != 0, u ^ 0xFFFFFFFF, u | 0x80000000)


@triton.jit
def _finite(x):
    """Selectable scores: -inf (masked key), +inf and NaN are never selected, as in the reference."""
    return (x == x) & (x != float("inf")) & (x != float("-inf"))


@triton.jit
def _radix_topk_kernel(
    S, OUT_I, OUT_V,
    stride_sb, stride_sc,
    stride_ob, stride_oc,
    W_LEN, k0, TOPK,
    BLOCK: tl.constexpr,
):
    c = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    row = S + b * stride_sb + c * stride_sc
    bins = tl.arange(0, 256)

    prefix = tl.full((), 0, tl.uint32)
    pmask = prefix
    k_rem = TOPK
    for i in tl.static_range(4):
        shift = 24 - 8 * i  # a constexpr expression of the unrolled index (never reassigned)
        hist = tl.zeros([256], dtype=tl.int32)
        for w0 in range(0, W_LEN, BLOCK):
            offs = w0 + tl.arange(0, BLOCK)
            x = tl.load(row + offs, mask=offs < W_LEN, other=float("-inf"))
            key = _sortable(x)
            match = _finite(x) & ((key & pmask) == prefix)
            digit = ((key >> shift) & 0xFF).to(tl.int32)
            hist += tl.histogram(digit, 256, mask=match)
        if i == 0:
            k_rem = tl.minimum(k_rem, tl.sum(hist, 0))  # fewer valid keys than k: take them all
        total = tl.sum(hist, 0)
        ge = total - tl.cumsum(hist, 0) + hist  # number of matching keys with digit >= bin
        bstar = tl.max(tl.where(ge >= k_rem, bins, -1), 0)
        bstar = tl.maximum(bstar, 0)
        k_rem = k_rem - tl.sum(tl.where(bins > bstar, hist, 0), 0)
        prefix = prefix | (bstar.to(tl.uint32) << shift)
        pmask = pmask | (tl.full((), 0xFF, tl.uint32) << shift)

    # prefix = key of the k-th largest valid score; k_rem = how many of its ties to take
    count = 0
    ties = 0
    out_i = OUT_I + b * stride_ob + c * stride_oc
    out_v = OUT_V + b * stride_ob + c * stride_oc
    for w0 in range(0, W_LEN, BLOCK):
        offs = w0 + tl.arange(0, BLOCK)
        x = tl.load(row + offs, mask=offs < W_LEN, other=float("-inf"))
        key = _sortable(x)
        valid = _finite(x)
        gt = valid & (key > prefix)
        eq = (valid & (key == prefix)).to(tl.int32)
        eq_rank = ties + tl.cumsum(eq, 0) - eq
        sel = (gt | ((eq != 0) & (eq_rank < k_rem))).to(tl.int32)
        pos = count + tl.cumsum(sel, 0) - sel
        tl.store(out_i + pos, (k0 + offs).to(tl.int32), mask=sel != 0)
        tl.store(out_v + pos, x, mask=sel != 0)
        count += tl.sum(sel, 0)
        ties += tl.sum(eq, 0)


def quantize_fp8_groups(x: torch.Tensor, group: int = FP8_GROUP, ue8m0: bool = False):
    """x [..., D] -> (e4m3 [..., D], fp32 scales [..., ceil(D / group)]): one scale per `group`
    channels (the last group may be partial), dequantized = fp8 * scale."""
    D = x.shape[-1]
    G = -(-D // group)
    pad = G * group - D
    xf = torch.nn.functional.pad(x.float(), (0, pad)) if pad else x.float()
    xg = xf.view(*x.shape[:-1], G, group)
    amax = xg.abs().amax(-1).clamp_min(1e-12)
    scale = amax / 448.0
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (xg / scale[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    q = q.view(*x.shape[:-1], G * group)[..., :D]
    return q.contiguous(), scale.contiguous()


def score_blocks(C: int, W_LEN: int, DI: int):
    return (64 if C >= 64 else pow2(C)), (64 if W_LEN >= 64 else pow2(W_LEN)), min(pow2(DI), 128)


def plan_scores(q, k, w, doc_start, scores, q0: int, q1: int, k0: int, qs=None, ks=None) -> Launch:
    """Score launch for queries [q0, q1) over keys [k0, q1): q [B, T, H_I, D_I], k [B, T, D_I],
    w [B, T, H_I] fp32, doc_start [B, T], scores [B, C, W] fp32 (C = q1 - q0, W = q1 - k0);
    qs [B, T, H_I, G] / ks [B, T, G] fp32 scales for e4m3 q/k (None: 16-bit or fp32 q/k)."""
    B, T, HI, DI = q.shape
    C, W_LEN = q1 - q0, q1 - k0
    fp8 = qs is not None
    block_m, block_n, block_d = score_blocks(C, W_LEN, DI)
    dummy = scores
    return Launch(
        _index_scores_kernel, (triton.cdiv(C, block_m), triton.cdiv(W_LEN, block_n), B),
        dict(
            Q=q, KI=k, W=w, DS=doc_start, S=scores, QS=qs if fp8 else dummy, KS=ks if fp8 else dummy,
            stride_qb=q.stride(0), stride_qt=q.stride(1), stride_qh=q.stride(2),
            stride_kb=k.stride(0), stride_kt=k.stride(1),
            stride_wb=w.stride(0), stride_wt=w.stride(1),
            stride_db=doc_start.stride(0),
            stride_sb=scores.stride(0), stride_sc=scores.stride(1),
            stride_qsb=qs.stride(0) if fp8 else 0, stride_qst=qs.stride(1) if fp8 else 0,
            stride_qsh=qs.stride(2) if fp8 else 0,
            stride_ksb=ks.stride(0) if fp8 else 0, stride_kst=ks.stride(1) if fp8 else 0,
            q0=q0, q1=q1, k0=k0, W_LEN=W_LEN,
            HI=HI, DI=DI, FP8=fp8,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        ),
        num_warps=4,
    )


def select_block(W_LEN: int) -> int:
    return min(pow2(W_LEN, 128), 1024)


def plan_select(scores, idx, val, k0: int, topk: int, block: int | None = None) -> Launch:
    """Radix-select launch: scores [B, C, W] fp32 -> idx [B, C, topk] int32 (prefilled -1) and
    val [B, C, topk] fp32 (prefilled -inf), selected keys in index order."""
    B, C, W_LEN = scores.shape
    return Launch(
        _radix_topk_kernel, (C, B),
        dict(
            S=scores, OUT_I=idx, OUT_V=val,
            stride_sb=scores.stride(0), stride_sc=scores.stride(1),
            stride_ob=idx.stride(0), stride_oc=idx.stride(1),
            W_LEN=W_LEN, k0=k0, TOPK=topk,
            BLOCK=block or select_block(W_LEN),
        ),
        num_warps=4,
    )


def _score_chunk(q, k, w, doc_start, q0, q1, k0, qs=None, ks=None):
    B = q.shape[0]
    scores = torch.empty((B, q1 - q0, q1 - k0), dtype=torch.float32, device=q.device)
    plan_scores(q, k, w, doc_start, scores, q0, q1, k0, qs, ks).run()
    return scores


def _select_chunk(scores: torch.Tensor, k0: int, topk: int, block: int | None = None):
    B, C, W_LEN = scores.shape
    idx = torch.full((B, C, topk), -1, dtype=torch.int32, device=scores.device)
    val = torch.full((B, C, topk), float("-inf"), dtype=torch.float32, device=scores.device)
    plan_select(scores, idx, val, k0, topk, block).run()
    # selected pairs are in index order: a stable descending sort keeps ties at the lower index
    val, order = torch.sort(val, dim=-1, descending=True, stable=True)
    return torch.gather(idx, -1, order), val


@torch.no_grad()
def indexer_topk_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    doc_start: torch.Tensor,
    topk: int,
    chunk_size: int | None = None,
    fp8: bool = False,
    score_budget_elems: int = DEFAULT_SCORE_BUDGET,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `indexer_topk_ref`; `fp8=True` scores with e4m3 q/k (per-token,
    per-128-channel scales; q's scales are per head too)."""
    B, T, HI, DI = q.shape
    q, k = interp_upcast(q.contiguous()), interp_upcast(k.contiguous())
    w = w.float().contiguous()
    doc_start = doc_start.contiguous()
    qs = ks = None
    if fp8:
        q, qs = quantize_fp8_groups(q)
        k, ks = quantize_fp8_groups(k)
    chunk = chunk_size or max(1, min(T, score_budget_elems // max(B * T, 1)))
    ds_cpu = doc_start.min(dim=0).values.cpu()  # key window start per query (min over the batch)
    all_idx, all_val = [], []
    for q0 in range(0, T, chunk):
        q1 = min(T, q0 + chunk)
        k0 = int(ds_cpu[q0:q1].min())
        scores = _score_chunk(q, k, w, doc_start, q0, q1, k0, qs, ks)
        idx, val = _select_chunk(scores, k0, topk)
        del scores
        all_idx.append(idx)
        all_val.append(val)
    return torch.cat(all_idx, dim=1), torch.cat(all_val, dim=1)


def index_scores_triton(q, k, w, doc_start, q0: int, q1: int, fp8: bool = False):
    """Masked scores of queries [q0, q1) over their key window (testing / benchmarking helper)
    -> ([B, C, W] fp32 with -inf, k0)."""
    q, k = interp_upcast(q.contiguous()), interp_upcast(k.contiguous())
    qs = ks = None
    if fp8:
        q, qs = quantize_fp8_groups(q)
        k, ks = quantize_fp8_groups(k)
    k0 = int(doc_start[:, q0:q1].min())
    return _score_chunk(q, k, w.float().contiguous(), doc_start.contiguous(), q0, q1, k0, qs, ks), k0
