"""Lightning indexer scores (eq. 1) fused with a radix top-k selection (eq. 2): Triton.

Specification: `indexer_topk.indexer_topk_ref` (`indexer_topk_at_positions_ref` with query
positions). Queries are processed in chunks of C rows; for a
chunk only a [B, C, W] fp32 (or opt-in bf16) score block exists (W = the chunk's key window), never [T, T]:

1. `_index_scores_kernel` (grid: query tiles x key spans x batch) keeps a tile of BLOCK_Q
   queries resident as one [BLOCK_Q * H_I, D] operand (all indexer heads of each query) and
   streams the keys of its span past it, BLOCK_N at a time: one dot per key tile gives every
   head's logits, ReLU, times w, summed over each query's heads -> `sum_j w[t, j] * ReLU(q[t, j] .
   k[s])`; then the causal + document mask (-inf) and -0.0 canonicalized to +0.0 (ReLU gives many
   exact zeros, times a negative weight -0.0; both must tie). Key tiles outside the rows' live
   range skip the dot. Query rows carry their global position (`positions`), so a
   context-parallel rank's chunks are scored like any others. An FP8 path takes e4m3 q/k with
   one fp32 scale per token (per head for q) per 128 channels: with one group (d_I <= 128) in
   DeepSeek-V3.2's `fp8_index` order (q's scale folded into the head weight, k's applied after
   the head sum: no per-element scaling of the [M, BLOCK_N] logits); with several, each group's
   dot is multiplied by both scales. Specification: `fp8.index_scores_fp8_block`.
2. `_radix_topk_kernel` (one program per query row) selects the k largest scores exactly with
   an MSB-first radix select over the order-preserving uint32 image of the scores (fp32 rows:
   three 11-bit digits; bf16 rows: two 8-bit digits), reading the row twice: pass 1 histograms
   the top digit (`tl.histogram`) and finds the threshold bin (the one holding the k-th largest
   finite score); pass 2 writes every key above that bin to the output and appends the bin's
   keys (index, score; in index order, by prefix sums) to the row's candidate buffer [CAP]
   (global scratch, CAP = 4096: Triton has no explicit shared memory; the buffer is written and
   read by the same program, so L2 should serve it, but nothing guarantees it). The remaining
   digits are refined by histogram passes over the candidates only, then the candidates above
   the threshold key plus the first `take` keys equal to it (ties go to the lower index) are
   written. A threshold bin with more than CAP keys (heavy ties, e.g. many exact zeros) takes
   the old streaming path for that row: one pass over the row per remaining digit and one
   writing the selection (PASSES + 1 reads), so correctness never depends on CAP. Rows with
   fewer than k valid keys select all of them; the other slots stay -1 (score -inf);
   non-finite scores are never selected.
3. The k selected (score, index) pairs are ordered by a stable descending sort in PyTorch, so
   the output equals the reference's (sorted scores, ties to the lower index).
The select's torch.topk paths (`composite.py`): torch.topk on int64 composites (order-preserving
score bits, then the inverted key index), already in the reference's order; or torch.topk on the
fp32 scores with the rows tied at the k-th score redone that way (a host sync); or torch.topk on
the scores (k + 1 picks) and one Triton repair kernel that fixes ties, runs of equal scores and
non-finite picks on the device (`repair.py`, no host sync), or torch.topk for k picks with a tie
count pass before that kernel. On a GPU `_select_chunk` lets the
autotuner verify them against the radix default and time all; `select=` forces one.
"""

from __future__ import annotations

import os
import types

import numpy as np
import torch
import triton
import triton.language as tl

from ... import autotune
from ...analysis import Work
from ...host_values import host_values, window_starts
from ..._triton_common import Launch, compute_dtype, interpreted, kernel_input, pow2, target_capability
from .quant import quantize_rows_triton
from .pipeline import chunk_windows, overlap_enabled, run_chunks

DEFAULT_SCORE_BUDGET = 1 << 26  # fp32 elements of one query chunk's [B, C, W] score block


@triton.jit
def _index_scores_kernel(
    Q, KI, W, POS, DS, S, QS, KS,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt,
    stride_wb, stride_wt,
    stride_db,
    stride_sb, stride_sc,
    stride_qsb, stride_qst, stride_qsh,
    stride_ksb, stride_kst,
    r0, r1, k0, W_LEN,
    HI: tl.constexpr, DI: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    KEY_SPAN: tl.constexpr, KEYS_MAJOR: tl.constexpr = False,
):
    """Scores of BLOCK_Q query rows (local rows r0 + ..., global positions POS[row]) over the
    KEY_SPAN keys of window columns [pid_n * KEY_SPAN, ...): the rows' BLOCK_Q x H_I query
    vectors are loaded once as one [BLOCK_Q * BLOCK_HI, D] operand (row = query * BLOCK_HI +
    head) and the keys stream past it, BLOCK_N at a time."""
    pid_q = tl.program_id(0)
    pid_n = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    M: tl.constexpr = BLOCK_Q * BLOCK_HI
    ONE_D: tl.constexpr = DI <= BLOCK_D  # the whole head dim in one resident tile

    offs_c = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)  # row in the chunk
    mask_q = r0 + offs_c < r1
    t = tl.load(POS + r0 + offs_c, mask=mask_q, other=-1).to(tl.int32)  # global query position
    ds = tl.load(DS + b * stride_db + t, mask=mask_q, other=2147483647).to(tl.int32)
    t_max = tl.max(t, 0)
    ds_min = tl.min(ds, 0)

    # flattened (query, head) rows of the resident operand
    offs_r = tl.arange(0, M)
    row_r = (r0 + pid_q * BLOCK_Q + offs_r // BLOCK_HI).to(tl.int64)
    head_r = offs_r % BLOCK_HI
    mask_r = (row_r < r1) & (head_r < HI)
    w_r = tl.load(W + b * stride_wb + row_r * stride_wt + head_r, mask=mask_r, other=0.0).to(tl.float32)
    q_base = Q + b * stride_qb + row_r[:, None] * stride_qt + head_r[:, None] * stride_qh
    offs_d = tl.arange(0, BLOCK_D)
    if ONE_D:
        q_res = tl.load(q_base + offs_d[None, :], mask=mask_r[:, None] & (offs_d[None, :] < DI), other=0.0)
        if FP8:  # one scale group: q's scale joins the head weight (positive, so it commutes with ReLU)
            qs_r = tl.load(QS + b * stride_qsb + row_r * stride_qst + head_r * stride_qsh, mask=mask_r, other=0.0)
            w_r = w_r * qs_r

    # live key columns of this span: [lo, hi) (causal: s <= t_max; documents: s >= ds_min)
    span0 = pid_n * KEY_SPAN
    span1 = tl.minimum(span0 + KEY_SPAN, W_LEN)
    lo = tl.maximum(span0, ((ds_min - k0) // BLOCK_N) * BLOCK_N)
    hi = tl.minimum(span1, t_max - k0 + 1)
    out = S + b * stride_sb + offs_c[:, None].to(tl.int64) * stride_sc
    for n0 in range(lo, hi, BLOCK_N):
        offs_w = n0 + tl.arange(0, BLOCK_N)  # column in the window
        offs_s = k0 + offs_w  # key position
        mask_n = offs_w < span1
        k_base = KI + b * stride_kb + offs_s[:, None].to(tl.int64) * stride_kt
        if ONE_D:
            k = tl.load(k_base + offs_d[None, :], mask=mask_n[:, None] & (offs_d[None, :] < DI), other=0.0)
            if KEYS_MAJOR:  # [BLOCK_N, M]: the heads along the accumulator's columns
                logits = tl.dot(k, tl.trans(q_res))
            else:
                logits = tl.dot(q_res, tl.trans(k))  # [M, BLOCK_N]; e4m3 x e4m3 -> fp32 on the FP8 path
        else:  # head dim wider than one tile: stream q in D chunks too (one FP8 scale group each)
            logits = tl.zeros([M, BLOCK_N], dtype=tl.float32)
            for d0 in range(0, DI, BLOCK_D):
                dd = d0 + offs_d
                q = tl.load(q_base + dd[None, :], mask=mask_r[:, None] & (dd[None, :] < DI), other=0.0)
                k = tl.load(k_base + dd[None, :], mask=mask_n[:, None] & (dd[None, :] < DI), other=0.0)
                part = tl.dot(q, tl.trans(k))
                if FP8:
                    g = d0 // 128
                    qs = tl.load(QS + b * stride_qsb + row_r * stride_qst + head_r * stride_qsh + g,
                                 mask=mask_r, other=0.0)
                    ks = tl.load(KS + b * stride_ksb + offs_s.to(tl.int64) * stride_kst + g, mask=mask_n, other=0.0)
                    part = part * qs[:, None] * ks[None, :]
                logits += part
        # ReLU keeping NaN (as torch.relu): a non-finite score must stay non-finite to be dropped
        if KEYS_MAJOR and ONE_D:  # the head sum along each thread's accumulator columns, then [BLOCK_Q, BLOCK_N]
            weighted = w_r[None, :] * tl.maximum(logits, 0.0, propagate_nan=tl.PropagateNan.ALL)  # [BLOCK_N, M]
            acc = tl.trans(tl.sum(tl.reshape(weighted, (BLOCK_N, BLOCK_Q, BLOCK_HI)), axis=2))
        else:
            weighted = w_r[:, None] * tl.maximum(logits, 0.0, propagate_nan=tl.PropagateNan.ALL)  # [M, BLOCK_N]
            acc = tl.sum(tl.reshape(weighted, (BLOCK_Q, BLOCK_HI, BLOCK_N)), axis=1)  # sum over heads
        if FP8 and ONE_D:  # k's scale after the head sum (DeepSeek-V3.2's fp8_index order)
            ks = tl.load(KS + b * stride_ksb + offs_s.to(tl.int64) * stride_kst, mask=mask_n, other=0.0)
            acc = acc * ks[None, :]
        acc = tl.where(acc == 0.0, 0.0, acc)  # -0.0 -> +0.0
        valid = (offs_s[None, :] <= t[:, None]) & (offs_s[None, :] >= ds[:, None])
        acc = tl.where(valid, acc, float("-inf"))
        if S.dtype.element_ty == tl.bfloat16:  # a bf16 score block: round to nearest even, as torch
            acc = _round_to_bf16(acc)
        tl.store(out + offs_w[None, :], acc, mask=mask_q[:, None] & mask_n[None, :])
    # dead columns of the span (before every document start of the rows, or after every row)
    dead = tl.full([BLOCK_Q, BLOCK_N], float("-inf"), tl.float32)
    for n0 in range(span0, tl.minimum(lo, span1), BLOCK_N):
        offs_w = n0 + tl.arange(0, BLOCK_N)
        tl.store(out + offs_w[None, :], dead, mask=mask_q[:, None] & (offs_w[None, :] < tl.minimum(lo, span1)))
    for n0 in range(tl.maximum(hi, span0), span1, BLOCK_N):
        offs_w = n0 + tl.arange(0, BLOCK_N)
        tl.store(out + offs_w[None, :], dead, mask=mask_q[:, None] & (offs_w[None, :] < span1))


@triton.jit
def _round_to_bf16(x):
    """fp32 -> the fp32 value of its bf16 rounding to nearest even (integer arithmetic, so the
    interpreter, which truncates an fp32 -> bf16 cast, and the GPU agree); non-finite unchanged."""
    u = x.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return tl.where(_finite(x), r.to(tl.float32, bitcast=True), x)


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
def _digit_histogram(x, prefix, pmask, shift, NBINS: tl.constexpr):
    """Histogram of the DIGIT at `shift` of the finite scores x [BLOCK] whose key matches the
    prefix so far (key & pmask == prefix) -> [NBINS] int32."""
    key = _sortable(x)
    match = _finite(x) & ((key & pmask) == prefix)
    digit = ((key >> shift) & (NBINS - 1)).to(tl.int32)
    return tl.histogram(digit, NBINS, mask=match)


@triton.jit
def _threshold_bin(hist, k_rem, NBINS: tl.constexpr):
    """The bin holding the k_rem-th largest of the histogrammed keys -> (bin, how many of that
    bin's keys are still to take = k_rem minus the keys in the bins above it)."""
    bins = tl.arange(0, NBINS)
    total = tl.sum(hist, 0)
    ge = total - tl.cumsum(hist, 0) + hist  # number of keys with digit >= bin
    bstar = tl.maximum(tl.max(tl.where(ge >= k_rem, bins, -1), 0), 0)
    return bstar, k_rem - tl.sum(tl.where(bins > bstar, hist, 0), 0)


@triton.jit
def _write_selected(x, key_idx, prefix, pmask, k_rem, count, ties, out_i, out_v):
    """One block [BLOCK] of the final selection, in index order: keys above the prefix, plus the
    ties (key & pmask == prefix) whose rank among the ties so far is < k_rem (ties go to the
    lower index) -> written at out[count + ...]; returns the new (count, ties)."""
    key = _sortable(x) & pmask
    valid = _finite(x)
    gt = valid & (key > prefix)
    eq = (valid & (key == prefix)).to(tl.int32)
    eq_rank = ties + tl.cumsum(eq, 0) - eq
    sel = (gt | ((eq != 0) & (eq_rank < k_rem))).to(tl.int32)
    pos = count + tl.cumsum(sel, 0) - sel
    tl.store(out_i + pos, key_idx, mask=sel != 0)
    tl.store(out_v + pos, x, mask=sel != 0)
    return count + tl.sum(sel, 0), ties + tl.sum(eq, 0)


@triton.jit
def _refine_digits(src, n_keys, prefix, pmask, k_rem,
                   BLOCK: tl.constexpr, DIGIT_BITS: tl.constexpr, PASSES: tl.constexpr):
    """Digits 2..PASSES of the radix select, MSB first, one histogram pass over the n_keys scores
    at src (the row, or the candidate buffer) per digit -> (prefix, pmask, k_rem) of the k-th
    largest key. The last digit may overlap the previous one when 32 is not a multiple of
    DIGIT_BITS: those bits already agree among the matching keys, so re-fixing them changes
    nothing."""
    NBINS: tl.constexpr = 1 << DIGIT_BITS
    for i in tl.static_range(1, PASSES):
        shift = max(32 - DIGIT_BITS * (i + 1), 0)  # a constexpr of the unrolled index
        hist = tl.zeros([NBINS], dtype=tl.int32)
        for j0 in range(0, n_keys, BLOCK):
            offs = j0 + tl.arange(0, BLOCK)
            x = tl.load(src + offs, mask=offs < n_keys, other=float("-inf")).to(tl.float32)
            hist += _digit_histogram(x, prefix, pmask, shift, NBINS)
        bstar, k_rem = _threshold_bin(hist, k_rem, NBINS)
        prefix = prefix | (bstar.to(tl.uint32) << shift)
        pmask = pmask | (tl.full((), NBINS - 1, tl.uint32) << shift)
    return prefix, pmask, k_rem


@triton.jit
def _radix_topk_kernel(
    S, OUT_I, OUT_V, CAND_I, CAND_V, BIN_N,
    stride_sb, stride_sc,
    stride_ob, stride_oc,
    stride_cb, stride_cc,
    stride_nb,
    W_LEN, k0, TOPK,
    BLOCK: tl.constexpr, DIGIT_BITS: tl.constexpr, PASSES: tl.constexpr, CAP: tl.constexpr,
):
    """Exact top-k of one score row over the top DIGIT_BITS * PASSES bits of the order-preserving
    uint32 image of its scores (fp32 rows: 32 bits; bf16 rows: the 16 bits a bf16 has).

    Pass 1 over the row: histogram of the top digit -> the threshold bin (holding the k-th
    largest) and its key count n. If n <= CAP, pass 2 over the row writes every key above that
    bin to the output and appends the bin's keys (value, index; in index order) to this row's
    candidate buffer CAND_V / CAND_I [CAP]; the other PASSES - 1 digits are refined over the
    candidates only, which then give the remaining selections: the row is read twice. If n > CAP
    (heavy ties), the row falls back to streaming: one pass over the row per remaining digit,
    then one writing the selection (PASSES + 1 reads). BIN_N [rows] gets the number of candidates
    the row refined from the buffer (n), or -1 where it streamed."""
    c = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    row = S + b * stride_sb + c * stride_sc
    out_i = OUT_I + b * stride_ob + c * stride_oc
    out_v = OUT_V + b * stride_ob + c * stride_oc
    cand_i = CAND_I + b * stride_cb + c * stride_cc
    cand_v = CAND_V + b * stride_cb + c * stride_cc
    NBINS: tl.constexpr = 1 << DIGIT_BITS
    TOP_SHIFT: tl.constexpr = 32 - DIGIT_BITS
    bins = tl.arange(0, NBINS)

    # pass 1: the top digit
    top = tl.full((), 0, tl.uint32)
    hist = tl.zeros([NBINS], dtype=tl.int32)  # [NBINS] keys per top digit
    for w0 in range(0, W_LEN, BLOCK):
        offs = w0 + tl.arange(0, BLOCK)
        x = tl.load(row + offs, mask=offs < W_LEN, other=float("-inf")).to(tl.float32)
        hist += _digit_histogram(x, top, top, TOP_SHIFT, NBINS)
    k_rem = tl.minimum(TOPK, tl.sum(hist, 0))  # fewer valid keys than k: take them all
    bstar, k_rem = _threshold_bin(hist, k_rem, NBINS)
    n_cand = tl.sum(tl.where(bins == bstar, hist, 0), 0)
    prefix = bstar.to(tl.uint32) << TOP_SHIFT
    pmask = tl.full((), NBINS - 1, tl.uint32) << TOP_SHIFT

    if n_cand <= CAP:
        # pass 2: keys above the threshold bin -> output; the bin's keys -> candidates
        count = 0
        n = 0
        for w0 in range(0, W_LEN, BLOCK):
            offs = w0 + tl.arange(0, BLOCK)
            x = tl.load(row + offs, mask=offs < W_LEN, other=float("-inf")).to(tl.float32)  # [BLOCK]
            key = _sortable(x) & pmask  # [BLOCK] top digit in place
            valid = _finite(x)
            gt = (valid & (key > prefix)).to(tl.int32)
            eq = (valid & (key == prefix)).to(tl.int32)
            pos = count + tl.cumsum(gt, 0) - gt
            tl.store(out_i + pos, (k0 + offs).to(tl.int32), mask=gt != 0)
            tl.store(out_v + pos, x, mask=gt != 0)
            cpos = n + tl.cumsum(eq, 0) - eq
            tl.store(cand_i + cpos, (k0 + offs).to(tl.int32), mask=eq != 0)
            tl.store(cand_v + cpos, x, mask=eq != 0)
            count += tl.sum(gt, 0)  # keys written to the output so far
            n += tl.sum(eq, 0)  # candidates so far
        tl.store(BIN_N + b * stride_nb + c, n)  # = n_cand
        tl.debug_barrier()  # the candidates written by every thread are visible to all of them
        prefix, pmask, k_rem = _refine_digits(cand_v, n_cand, prefix, pmask, k_rem, BLOCK, DIGIT_BITS, PASSES)
        ties = 0
        for j0 in range(0, n_cand, BLOCK):
            offs = j0 + tl.arange(0, BLOCK)
            x = tl.load(cand_v + offs, mask=offs < n_cand, other=float("-inf"))
            key_idx = tl.load(cand_i + offs, mask=offs < n_cand, other=0)
            count, ties = _write_selected(x, key_idx, prefix, pmask, k_rem, count, ties, out_i, out_v)
    else:
        # overflow (more than CAP keys in the threshold bin): refine by streaming the row
        tl.store(BIN_N + b * stride_nb + c, -1)
        prefix, pmask, k_rem = _refine_digits(row, W_LEN, prefix, pmask, k_rem, BLOCK, DIGIT_BITS, PASSES)
        count = 0
        ties = 0
        for w0 in range(0, W_LEN, BLOCK):
            offs = w0 + tl.arange(0, BLOCK)
            x = tl.load(row + offs, mask=offs < W_LEN, other=float("-inf")).to(tl.float32)
            count, ties = _write_selected(x, (k0 + offs).to(tl.int32), prefix, pmask, k_rem, count, ties,
                                          out_i, out_v)


SCORE_ROWS = 256  # (query, head) rows of the resident query operand: 4 queries x 64 indexer heads
KEY_SPAN_TILES = 16  # key tiles one score program streams past its resident queries


def score_blocks(C: int, W_LEN: int, HI: int, DI: int) -> tuple[int, int, int, int]:
    """(BLOCK_Q, BLOCK_HI, BLOCK_N, BLOCK_D): BLOCK_Q queries x BLOCK_HI (>= H_I) heads form the
    resident operand (at least 16 rows for tl.dot), BLOCK_N keys per streamed tile."""
    block_hi = pow2(HI, 1)
    block_q = max(16 // block_hi, min(max(SCORE_ROWS // block_hi, 1), pow2(C, 1)))
    return block_q, block_hi, (64 if W_LEN >= 64 else pow2(W_LEN)), min(pow2(DI), 128)


def plan_scores(q, k, w, doc_start, scores, positions, r0: int, r1: int, k0: int, qs=None, ks=None,
                key_span: int | None = None, config: str | None = None) -> Launch:
    """Score launch for the local query rows [r0, r1) over the key window [k0, k0 + W):
    q [B, Tq, H_I, D_I] and w [B, Tq, H_I] fp32 (local rows), positions [Tq] int32 (global
    position of each local row: arange(T) without context parallelism), k [B, T, D_I] and
    doc_start [B, T] (the whole sequence), scores [B, r1 - r0, W] fp32 or bf16 (every entry
    written, rounded to its dtype; -inf where masked); qs [B, Tq, H_I, G] / ks [B, T, G] fp32 scales for e4m3 q/k (None: 16-bit
    or fp32 q/k). key_span: keys per program (a multiple of BLOCK_N; default 16 tiles). config: a
    name of `SCORE_CONFIG_SPACE` (default: its first) or of `SCORE_GLUON_CONFIGS` (the Gluon kernel,
    `gluon_scores.plan_scores_gluon`; a call it does not take is a ValueError naming why)."""
    B, Tq, HI, DI = q.shape
    C, W_LEN = r1 - r0, scores.shape[2]
    fp8 = qs is not None
    block_q, block_hi, block_n, block_d = score_blocks(C, W_LEN, HI, DI)
    span = key_span or KEY_SPAN_TILES * block_n
    if span % block_n:
        raise ValueError(f"key_span={span} must be a multiple of the key tile {block_n}")
    name = config or SCORE_CONFIG_SPACE[0][0]
    kinds = dict(SCORE_CONFIG_SPACE + SCORE_GLUON_CONFIGS)
    if name not in kinds:
        raise ValueError(f"index scores: config {name!r} (config= or DSA_INDEX_SCORES_CONFIG) is not a score "
                         f"config; pick one of {', '.join(kinds)}")
    if kinds[name] == "gluon":
        from .gluon_scores import gluon_scores_supported, plan_scores_gluon

        why = gluon_scores_supported(q, k, scores, fp8, target_capability(q))
        if why is not None:
            raise ValueError(f"index scores: the Gluon config {name!r} does not take this call: {why}; force a "
                             f"Triton config ({', '.join(n for n, _ in SCORE_CONFIG_SPACE)}) or unset "
                             "DSA_INDEX_SCORES_CONFIG")
        return plan_scores_gluon(q, k, w, doc_start, scores, positions, r0, r1, k0, name, key_span)
    keys_major = kinds[name]
    keys_major = keys_major and DI <= block_d  # one resident head-dim tile only
    dummy = scores
    return Launch(
        _index_scores_kernel, (triton.cdiv(C, block_q), triton.cdiv(W_LEN, span), B),
        dict(
            Q=q, KI=k, W=w, POS=positions, DS=doc_start, S=scores,
            QS=qs if fp8 else dummy, KS=ks if fp8 else dummy,
            stride_qb=q.stride(0), stride_qt=q.stride(1), stride_qh=q.stride(2),
            stride_kb=k.stride(0), stride_kt=k.stride(1),
            stride_wb=w.stride(0), stride_wt=w.stride(1),
            stride_db=doc_start.stride(0),
            stride_sb=scores.stride(0), stride_sc=scores.stride(1),
            stride_qsb=qs.stride(0) if fp8 else 0, stride_qst=qs.stride(1) if fp8 else 0,
            stride_qsh=qs.stride(2) if fp8 else 0,
            stride_ksb=ks.stride(0) if fp8 else 0, stride_kst=ks.stride(1) if fp8 else 0,
            r0=r0, r1=r1, k0=k0, W_LEN=W_LEN,
            HI=HI, DI=DI, FP8=fp8,
            BLOCK_Q=block_q, BLOCK_HI=block_hi, BLOCK_N=block_n, BLOCK_D=block_d, KEY_SPAN=span,
            KEYS_MAJOR=keys_major,
        ),
        num_warps=8,
    )


def scores_work(launch: Launch) -> Work:
    """Per query row of a `plan_scores` launch, from its arguments, taking each row's global
    position to be its local row (positions = arange, as without context parallelism) and one
    document (doc_start 0). Useful FLOPs: 2 H_I D_I per causal key. Issued: every live key
    tile's dot, [BLOCK_Q * BLOCK_HI, D] x [D, BLOCK_N] at the padded sizes. Reads: each program
    (query tile x key span) loads its resident q, w (and q scales), positions and doc starts,
    and streams the k rows (and k scales) of its live tiles; q is reloaded per key tile when the
    head dim is wider than one tile. Writes: the whole score row (dead columns too)."""
    a = launch.args
    hi, di, bq, bhi, bn, bd = a["HI"], a["DI"], a["BLOCK_Q"], a["BLOCK_HI"], a["BLOCK_N"], a["BLOCK_D"]
    r0, r1, k0, w_len = a["r0"], a["r1"], a["k0"], a["W_LEN"]
    spans = launch.grid[1]
    d_tiles = triton.cdiv(di, bd)
    q_el, k_el = a["Q"].element_size(), a["KI"].element_size()
    scale = a["QS"].element_size() if a["FP8"] else 0
    rows = r1 - r0
    useful = issued = read = 0.0
    for t0 in range(r0, r1, bq):  # one query tile (all of its key spans)
        t1 = min(t0 + bq, r1)
        n_q = t1 - t0
        useful += sum(2 * hi * di * (t - k0 + 1) for t in (t0, t1 - 1)) * n_q / 2  # arithmetic series
        tiles = triton.cdiv(min(t1 - k0, w_len), bn)  # live key tiles (span boundaries are tile-aligned)
        issued += tiles * 2 * (bq * bhi) * (d_tiles * bd) * bn
        q_loads = spans if d_tiles == 1 else tiles  # resident once per program, or once per key tile
        read += n_q * (q_loads * hi * (di * q_el + scale) + spans * (hi * a["W"].element_size()
                                                                     + a["POS"].element_size() + a["DS"].element_size()))
        read += tiles * bn * (di * k_el + d_tiles * scale)
    return Work(useful_flops=useful / rows, issued_flops=issued / rows, read_bytes=read / rows,
                write_bytes=w_len * a["S"].element_size())


def gluon_scores_work(launch):
    """The analysis column of a Gluon score launch: `scores_work`'s formulas (its block sizes:
    BLOCK_Q queries x 64 heads resident, 64-key tiles, q once per CTA, k per live tile)."""
    args = dict(launch.args, FP8=False, QS=launch.args["S"])
    return scores_work(types.SimpleNamespace(args=args, grid=launch.grid))


def select_block(W_LEN: int, block: int = 4096) -> int:
    """Scores a select program reads per step: `block` (a config's), or the row's length rounded
    up to a power of two (at least 128) when that is shorter."""
    return min(pow2(W_LEN, 128), block)


# The select's autotuning space (`dsa_kernels.autotune`): (name, score block, warps), the first the
# default. Measured on an H200 (Triton 3.6; 4096 rows x 32768 fp32 scores, k = 2048;
# docs/gpu-check/NVIDIA-H200/variants.json, sweep 2): 4096 x 8 warps 7.87 ms, 2048 x 4 warps
# 6.91 ms, 2048 x 8 warps 9.52 ms, 1024 x 8 warps 11.8 ms. Both configs compile without spill for
# fp32 and bf16 scores under Triton 3.6 / 3.9 on sm_90a and under 3.9 on sm_100 (2048 x 8 warps
# spills 64 B for bf16 under 3.6, 4096 x 4 warps 100-592 B, 4096 x 16 warps 120 B for fp32 under
# 3.6: not in the space). The same space for Hopper and Blackwell (sm_100 is unmeasured).
SELECT_CONFIG_SPACE = (("b4096-w8", 4096, 8), ("b2048-w4", 2048, 4))


def select_config_space(capability: int) -> tuple:
    """The select's configs `_select_chunk` times on a GPU of this compute capability."""
    return SELECT_CONFIG_SPACE


CANDIDATE_CAP = 4096  # keys of a row's threshold bin refined from the candidate buffer (more: streaming fallback)


def radix_digits(score_dtype: torch.dtype) -> tuple[int, int]:
    """(DIGIT_BITS, PASSES): fp32 scores 3 x 11 bits (the last digit overlaps the second by one
    bit); bf16 scores (16 significant key bits) 2 x 8."""
    return (8, 2) if score_dtype == torch.bfloat16 else (11, 3)


def candidate_buffers(B: int, C: int, cap: int = CANDIDATE_CAP, device=None):
    """Scratch of the selector: per row `cap` candidate (index int32, score fp32) slots and the
    number of candidates the row used (-1: its threshold bin overflowed `cap`, the row was
    streamed) -> (cand_idx [B, C, cap], cand_val [B, C, cap], bin_count [B, C])."""
    return (torch.empty((B, C, cap), dtype=torch.int32, device=device),
            torch.empty((B, C, cap), dtype=torch.float32, device=device),
            torch.empty((B, C), dtype=torch.int32, device=device))


def plan_select(scores, idx, val, cand_idx, cand_val, bin_count, k0: int, topk: int,
                block: int | None = None, config: tuple | None = None) -> Launch:
    """Radix-select launch: scores [B, C, W] fp32 or bf16 -> idx [B, C, topk] int32 (prefilled
    -1) and val [B, C, topk] fp32 (prefilled -inf), the selected keys (each run of equal scores
    in index order); cand_idx / cand_val [B, C, CAP] and bin_count [B, C] from
    `candidate_buffers` (CAP = their last dim). `config`: one of `select_config_space` (default:
    its first); `block` (tests): that score block at the default's warps."""
    B, C, W_LEN = scores.shape
    if cand_idx.shape[:2] != (B, C) or cand_val.shape != cand_idx.shape or bin_count.shape != (B, C):
        raise ValueError(f"candidate buffers must be [B, C, CAP] = [{B}, {C}, CAP] twice and bin_count [{B}, {C}]; "
                         f"got {tuple(cand_idx.shape)}, {tuple(cand_val.shape)}, {tuple(bin_count.shape)} "
                         "(make them with candidate_buffers(B, C))")
    digit_bits, passes = radix_digits(scores.dtype)
    _, config_block, warps = config or select_config_space(target_capability(scores))[0]
    return Launch(
        _radix_topk_kernel, (C, B),
        dict(
            S=scores, OUT_I=idx, OUT_V=val, CAND_I=cand_idx, CAND_V=cand_val, BIN_N=bin_count,
            stride_sb=scores.stride(0), stride_sc=scores.stride(1),
            stride_ob=idx.stride(0), stride_oc=idx.stride(1),
            stride_cb=cand_idx.stride(0), stride_cc=cand_idx.stride(1),
            stride_nb=bin_count.stride(0),
            W_LEN=W_LEN, k0=k0, TOPK=topk,
            BLOCK=block or select_block(W_LEN, config_block), DIGIT_BITS=digit_bits, PASSES=passes,
            CAP=cand_idx.shape[2],
        ),
        num_warps=warps,
    )


def select_work(launch: Launch) -> Work:
    """Per query row of a `plan_select` launch, on its candidate path (threshold bin <= CAP keys):
    two reads of the row; the candidates (index + fp32 score; the bound n = CAP) written once,
    their scores read by the PASSES - 1 refinement passes and scores + indices by the final one;
    writes: k (index, score) pairs, the candidates, the row's candidate count. No FLOPs
    (histograms and compares). A row that overflows CAP streams the row PASSES + 1 times instead
    (`streaming_read_bytes`)."""
    a = launch.args
    row = a["W_LEN"] * a["S"].element_size()
    cand_v = a["CAP"] * a["CAND_V"].element_size()  # [CAP] scores
    cand = cand_v + a["CAP"] * a["CAND_I"].element_size()  # [CAP] scores + indices
    out = a["TOPK"] * (a["OUT_I"].element_size() + a["OUT_V"].element_size())
    return Work(useful_flops=0.0, issued_flops=0.0, read_bytes=2 * row + (a["PASSES"] - 1) * cand_v + cand,
                write_bytes=out + cand + a["BIN_N"].element_size(),
                anchor=dict(name="TileLang topk_selector", read_bytes=row))


def streaming_read_bytes(launch: Launch) -> int:
    """Bytes a `plan_select` row reads on the overflow path (and every row read before the
    candidate buffer): one histogram pass per digit plus the selection pass over the row."""
    a = launch.args
    return (a["PASSES"] + 1) * a["W_LEN"] * a["S"].element_size()


# The score kernel's autotuning space (issue 31, scores + select at 32K): (name, keys-major tile).
# "heads-rows" (the default): the tile's dot is [BLOCK_Q * H_I, D] x [D, BLOCK_N], the heads along
# the accumulator's rows, so the head sum reduces across warps; "keys-rows": [BLOCK_N, D] x [D,
# BLOCK_Q * H_I], the heads along its columns, so the head sum stays within each thread and its
# quad, and the [BLOCK_N, BLOCK_Q] sums are transposed once. Compiled at the 671B shapes (bf16 /
# fp8 / bf16 block, registers, no spill): 3.6 sm_90a 128 / 140 / 128, 3.9 sm_90a 208 / 168 / 208
# (1 CTA per SM). GPU speed unmeasured: on a GPU each is verified against the default (same -inf
# pattern, finite scores within SCORE_VERIFY_RTOL of the block's largest) and timed.
SCORE_CONFIG_SPACE = (("heads-rows", False), ("keys-rows", True))
SCORE_VERIFY_RTOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
# The Gluon score kernel (`gluon_scores.py`: keys along the wgmma M, a cp.async producer warp group, two
# ping-pong consumer warp groups; bf16 / fp16 q and k only, sm_90a): (name, "gluon"), after the Triton
# configs on sm_90, never the default. They join the autotuned space only with DSA_KERNELS_GLUON_SCORES=1
# until a GPU has run them (`gluon_scores.gluon_scores_enabled`); `config=` / DSA_INDEX_SCORES_CONFIG
# force one by name (gpu-check's correctness.index_scores_bf16 does).
SCORE_GLUON_CONFIGS = (("gluon-keys-rows", "gluon"), ("gluon-keys-rows-q2", "gluon"))


def score_config_space(capability: int) -> tuple:
    """The score kernel's configs on a GPU of this compute capability: the Triton ones, then on sm_90
    the Gluon ones."""
    return SCORE_CONFIG_SPACE + (SCORE_GLUON_CONFIGS if capability == 90 else ())


def score_space_for(q, k, scores, fp8: bool, unmeasured: bool = False, on_gpu: bool | None = None) -> list[str]:
    """Names of the score configs for this call: `score_config_space` of the target's capability, less
    the Gluon ones off a GPU (the interpreter cannot run them), where that kernel does not take the call
    (`gluon_scores.gluon_scores_supported`: FP8, d_I > 128, H_I > 64, ...), with DSA_KERNELS_GLUON=0,
    or, until a GPU has run them, without DSA_KERNELS_GLUON_SCORES=1 (`unmeasured=True` keeps them
    regardless of that opt-in: a forced config, gpu-check's checks). on_gpu: whether the launch runs
    compiled on a GPU (default: q on CUDA, not interpreted)."""
    cap = target_capability(q)
    on_gpu = (q.is_cuda and not interpreted()) if on_gpu is None else on_gpu
    names = [name for name, kind in score_config_space(cap) if kind != "gluon"]
    gluon = [name for name, kind in score_config_space(cap) if kind == "gluon"]
    if gluon and on_gpu:  # a Gluon kernel runs only compiled, on the GPU
        from ..sparse_mla.kernel import gluon_enabled
        from .gluon_scores import gluon_scores_enabled, gluon_scores_supported

        if not gluon_enabled():  # DSA_KERNELS_GLUON=0: no Gluon kernel anywhere, forced checks included
            return names
        if (unmeasured or gluon_scores_enabled()) and gluon_scores_supported(q, k, scores, fp8, cap) is None:
            names += gluon
    return names


def forced_score_config() -> str | None:
    """The score config forced by DSA_INDEX_SCORES_CONFIG (a name of `score_config_space`, e.g.
    "gluon-keys-rows"): it runs untimed and unverified wherever the score kernel runs. None: the
    autotuner chooses (the default off the GPU)."""
    return os.environ.get("DSA_INDEX_SCORES_CONFIG", "").strip() or None


def _score_chunk(q, k, w, doc_start, positions, r0, r1, k0, k_end, qs=None, ks=None, key_span=None,
                 score_dtype=torch.float32, config: str | None = None):
    """The chunk's score block; config: one of `score_config_space`, or None: DSA_INDEX_SCORES_CONFIG if
    set, else autotuned on a GPU over `score_space_for` (the Gluon configs only with
    DSA_KERNELS_GLUON_SCORES=1), the default off it."""
    B = q.shape[0]
    shape = (B, r1 - r0, k_end - k0)
    scores = torch.empty(shape, dtype=score_dtype, device=q.device)

    def build(name, out=scores):
        return plan_scores(q, k, w, doc_start, out, positions, r0, r1, k0, qs, ks, key_span, name)

    def verify(name):  # the config's block against the default's, before it may be timed
        ref = torch.empty(shape, dtype=score_dtype, device=q.device)
        got = torch.empty_like(ref)
        build(SCORE_CONFIG_SPACE[0][0], ref).run()
        build(name, got).run()
        fin = torch.isfinite(ref)
        if not torch.equal(fin, torch.isfinite(got)):
            return False
        if not bool(fin.any()):
            return True
        scale = float(ref[fin].float().abs().max().clamp_min(1e-30))
        return float((got[fin].float() - ref[fin].float()).abs().max()) <= SCORE_VERIFY_RTOL[score_dtype] * scale

    config = config or forced_score_config()
    if config is not None:
        launch = build(config)
    else:
        on_gpu = q.is_cuda and not interpreted()
        names = score_space_for(q, k, scores, qs is not None)
        key = (pow2(r1 - r0), pow2(k_end - k0), q.shape[2], q.shape[3], str(q.dtype), str(score_dtype))
        if len(names) > len(SCORE_CONFIG_SPACE):  # the Gluon configs joined (opt-in): their own entry
            key += ("+".join(names),)
        _, launch = autotune.pick("indexer_scores", key, names, build, on_gpu,
                                  autotune.device_id(q) if on_gpu else "", verify=verify)
    launch.run()
    return scores


# The select's paths (`_select_chunk`'s `path`): "radix" (the Triton radix select over
# `select_config_space`), "composite" (torch.topk on composite int64 keys, `composite.py`),
# "fix-ties" (torch.topk on the fp32 scores, rows tied at the k-th score redone by the composite
# path; `composite.topk_fix_ties`), None (all: the autotuner verifies the torch paths' index sets
# against the radix default and times every candidate).
# "repair" (torch.topk on the scores, k + 1 picks, then one Triton repair kernel: ties across the
# k-th score, runs of equal scores and non-finite picks fixed on the device, no host sync;
# `repair.topk_repair`), "repair-count" (torch.topk for k picks, a tie count pass over the scores,
# the repair kernel: torch.topk's sort of its picks sized for k, not k + 1; `repair.topk_repair_count`).
SELECT_PATHS = ("radix", "composite", "fix-ties", "repair", "repair-count")
COMPOSITE_CONFIG = "torch-topk-composite"  # the composite path's name in the autotuning space
FIX_TIES_CONFIG = "torch-topk-fix-ties"
REPAIR_CONFIG = "torch-topk-repair"
REPAIR_COUNT_CONFIG = "torch-topk-repair-count"
# config name -> (module, function): the torch.topk paths, each `topk_from_scores`' contract
TORCH_SELECTS = {COMPOSITE_CONFIG: ("composite", "topk_composite"), FIX_TIES_CONFIG: ("composite", "topk_fix_ties"),
                 REPAIR_CONFIG: ("repair", "topk_repair"), REPAIR_COUNT_CONFIG: ("repair", "topk_repair_count")}
PATH_CONFIGS = {"composite": COMPOSITE_CONFIG, "fix-ties": FIX_TIES_CONFIG, "repair": REPAIR_CONFIG,
                "repair-count": REPAIR_COUNT_CONFIG}
WRITES_EVERY_SLOT = {REPAIR_CONFIG, REPAIR_COUNT_CONFIG}  # paths that fill the outputs given (no prefill, no copy)


class _CompositeSelect:
    """A torch.topk path as a launch the autotuner can plan, verify and time: run() writes the
    sorted selection into idx / val."""

    def __init__(self, scores, idx, val, k0: int, topk: int, name: str = COMPOSITE_CONFIG):
        self.scores, self.idx, self.val, self.k0, self.topk, self.name = scores, idx, val, k0, topk, name
        self.kernel, self.num_warps, self.args = None, 0, {}

    def run(self) -> None:
        import importlib

        module, fn = TORCH_SELECTS[self.name]
        select = getattr(importlib.import_module(f"{__package__}.{module}"), fn)
        if self.name in WRITES_EVERY_SLOT:
            select(self.scores, self.topk, self.k0, out=(self.idx, self.val))
            return
        i, v = select(self.scores, self.topk, self.k0)
        self.idx.copy_(i)
        self.val.copy_(v)


def _select_chunk(scores: torch.Tensor, k0: int, topk: int, block: int | None = None,
                  cap: int = CANDIDATE_CAP, bin_count_out: list | None = None, path: str | None = None,
                  out: tuple[torch.Tensor, torch.Tensor] | None = None):
    """-> (idx, val) [B, C, topk] sorted as the reference; bin_count_out (a list) receives the
    kernel's per-row candidate counts [B, C] (-1: the row's threshold bin overflowed `cap` and
    took the streaming path; nothing when a torch.topk path ran). path: one of SELECT_PATHS, or
    None: on a GPU the autotuner picks among the radix configs and the four torch.topk paths by
    timing (each verified against the radix default first); off the GPU the radix default runs.
    out: (idx int32, val fp32) [B, C, topk] to write (e.g. slices of the driver's outputs; every
    slot is written) and return; None: new tensors. The radix select writes into prefilled scratch
    (-1 / -inf: it writes only the selected slots) and its stable sort lands in `out`; the
    torch.topk paths write `out` themselves (no prefill)."""
    if path is not None and path not in SELECT_PATHS:
        raise ValueError(f"select path must be one of {SELECT_PATHS} or None (autotuned); got {path!r}")
    B, C, W_LEN = scores.shape
    shape, dev = (B, C, topk), scores.device

    def outputs(fill: bool = True):
        if not fill:  # a path that writes every slot
            return (torch.empty(shape, dtype=torch.int32, device=dev),
                    torch.empty(shape, dtype=torch.float32, device=dev))
        return (torch.full(shape, -1, dtype=torch.int32, device=dev),
                torch.full(shape, float("-inf"), dtype=torch.float32, device=dev))

    if out is not None and (tuple(out[0].shape) != shape or tuple(out[1].shape) != shape
                            or out[0].dtype != torch.int32 or out[1].dtype != torch.float32):
        raise ValueError(f"out must be (int32, float32) tensors of shape {list(shape)}; got "
                         f"{[(tuple(t.shape), t.dtype) for t in out]}")
    dest = out if out is not None else outputs(fill=False)
    # the paths write contiguous rows (repair views them as [B * C, topk]): a strided slice of the
    # driver's outputs (B > 1) takes a contiguous copy
    target = dest if all(t.is_contiguous() for t in dest) else outputs(fill=False)
    scratch = []  # the radix select's prefilled (idx, val), made when a radix launch is planned
    space = {cfg[0]: cfg for cfg in select_config_space(target_capability(scores))}
    names = list(space) if path in (None, "radix") else []
    names += [PATH_CONFIGS[p] for p in SELECT_PATHS[1:] if path in (None, p)]
    buffers = []

    def build(name, idx=None, val=None):  # timing runs write the same selection into idx / val again
        if name in TORCH_SELECTS:
            return _CompositeSelect(scores, *((idx, val) if idx is not None else target), k0, topk, name)
        if idx is None:
            if not scratch:
                scratch.extend(outputs())
            idx, val = scratch
        if not buffers:
            buffers.extend(candidate_buffers(B, C, cap, dev))
        return plan_select(scores, idx, val, *buffers, k0, topk, config=space[name])

    def verify(name):  # the config's selection against the default's, before it may be timed
        picks = []
        for n in (names[0], name):
            i, v = outputs()
            build(n, i, v).run()
            picks.append(torch.sort(i, dim=-1).values)
        return bool(torch.equal(*picks))

    if block is not None:  # tests: this score block at the default's warps, no timing
        scratch.extend(outputs())
        buffers.extend(candidate_buffers(B, C, cap, dev))
        launch = plan_select(scores, *scratch, *buffers, k0, topk, block)
    else:
        on_gpu = scores.is_cuda and not interpreted()
        kernel = "indexer_topk_select" if path is None else f"indexer_topk_select_{path}"
        _, launch = autotune.pick(kernel, (pow2(C), pow2(W_LEN), topk, str(scores.dtype), "+".join(names)),
                                  names, build, on_gpu, autotune.device_id(scores) if on_gpu else "",
                                  verify=verify)
    launch.run()
    if not isinstance(launch, _CompositeSelect):  # the radix select: its scratch, sorted into target
        if bin_count_out is not None:
            bin_count_out.append(buffers[2])
        # each run of equal selected scores is in index order (above-bin keys, then the bin's picks; the
        # two never tie): a stable descending sort keeps ties at the lower index
        idx, val = launch.args["OUT_I"], launch.args["OUT_V"]
        order = torch.empty(shape, dtype=torch.int64, device=dev)
        torch.sort(val, dim=-1, descending=True, stable=True, out=(target[1], order))
        torch.gather(idx, -1, order, out=target[0])
    if target is not dest:
        dest[0].copy_(target[0])
        dest[1].copy_(target[1])
    return dest


def _query_positions(query_positions, Tq: int, T: int, device) -> tuple[torch.Tensor, np.ndarray]:
    """-> (positions on the device as int32 [Tq], the same on the host as int64). The host copy is
    read once per positions tensor (`host_values`: every layer of a forward gets the same one)."""
    if query_positions is None:
        pos = np.arange(Tq, dtype=np.int64)
        pos_dev = torch.arange(Tq, device=device, dtype=torch.int32)
    else:
        if tuple(query_positions.shape) != (Tq,):
            raise ValueError(f"query_positions must be [Tq] = [{Tq}] (one global position per query row); "
                             f"got shape {tuple(query_positions.shape)}")
        pos = host_values(query_positions)
        pos_dev = query_positions.detach().to(device=device, dtype=torch.int32)
    if Tq and (pos.min() < 0 or pos.max() >= T):
        raise ValueError(f"query_positions must lie in [0, {T}) (the key sequence length); "
                         f"got [{int(pos.min())}, {int(pos.max())}]")
    return pos_dev, pos


def _score_inputs(op: str, q: torch.Tensor, k: torch.Tensor, fp8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The score kernel's q / k: fp32 on the compiled path -> bf16 (fp32 tl.dot would be TF32;
    `compute_dtype` warns once); the FP8 path quantizes from the caller's values instead."""
    cdt = None if fp8 else compute_dtype(op, q, k)
    return kernel_input(q, cdt), kernel_input(k, cdt)


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
    query_positions: torch.Tensor | None = None,
    key_span: int | None = None,
    score_dtype: torch.dtype = torch.float32,
    select: str | None = None,
    ue8m0: bool = False,
    overlap: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `indexer_topk_ref` (with `query_positions`: as
    `indexer_topk_at_positions_ref`: q [B, Tq, H_I, D_I] and w [B, Tq, H_I] hold the queries at
    these global positions [Tq] of the sequence k [B, T, D_I] / doc_start [B, T] describe);
    `fp8=True` scores with e4m3 q/k (per-token, per-128-channel scales; q's per head too;
    `ue8m0=True`: power-of-two scales), as `fp8.index_scores_fp8_block`.
    score_dtype=torch.bfloat16 keeps the score block in bf16 (half its bytes) and selects on
    those rounded scores in two 8-bit radix passes instead of three 11-bit ones: the selection
    is then `topk_from_scores` of the bf16-rounded scores (same tie and non-finite rules), not
    of the fp32 scores; the returned scores are the bf16 values. Default fp32: exactly the
    reference. select: the selection path (`_select_chunk`: "radix", "composite", "fix-ties",
    "repair", "repair-count", None = autotuned). overlap: each chunk's select on a side stream
    while the next chunk's scores run on the caller's (`pipeline.py`; two score blocks alive);
    None: `DSA_INDEXER_OVERLAP` (default 0: off until measured). Bitwise the same outputs either way."""
    if score_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"score_dtype must be torch.float32 or torch.bfloat16; got {score_dtype}")
    if select is not None and select not in SELECT_PATHS:
        raise ValueError(f"select must be one of {SELECT_PATHS} or None (autotuned); got {select!r}")
    B, Tq, HI, DI = q.shape
    T = k.shape[1]
    q, k = _score_inputs("indexer_topk", q, k, fp8)
    w = w.float().contiguous()
    starts_at = window_starts(doc_start)  # before .contiguous(): the memo is the caller's tensor's
    doc_start = doc_start.contiguous()
    pos_dev, pos = _query_positions(query_positions, Tq, T, q.device)
    qs = ks = None
    if fp8:  # one pass each (`quant.py`: read q_I / k_I once, write e4m3 and the scales)
        (q, qs), (k, ks) = quantize_rows_triton(q, ue8m0), quantize_rows_triton(k, ue8m0)
    chunk = chunk_size or max(1, min(Tq, score_budget_elems // max(B * T, 1)))
    # key window start per position (min over the batch), from doc_start's host copy: read once per
    # doc_start tensor (`host_values`), so once per forward, not per layer
    windows = chunk_windows(pos, starts_at[pos], chunk)  # [(r0, r1, k0, k_end)], planned on the host
    out_idx = torch.empty((B, Tq, topk), dtype=torch.int32, device=q.device)
    out_val = torch.empty((B, Tq, topk), dtype=torch.float32, device=q.device)

    def score(win):
        r0, r1, k0, k_end = win
        return _score_chunk(q, k, w, doc_start, pos_dev, r0, r1, k0, k_end, qs, ks, key_span, score_dtype)

    def select_into(scores, win):  # the chunk's selection written straight into its rows of the outputs
        r0, r1, k0, _ = win
        _select_chunk(scores, k0, topk, path=select, out=(out_idx[:, r0:r1], out_val[:, r0:r1]))

    run_chunks(windows, score, select_into, overlap_enabled(overlap), q.device)
    return out_idx, out_val


def index_scores_triton(q, k, w, doc_start, q0: int, q1: int, fp8: bool = False, key_span: int | None = None,
                        score_dtype: torch.dtype = torch.float32, ue8m0: bool = False, config: str | None = None):
    """Masked scores of queries [q0, q1) over their key window (testing / benchmarking helper)
    -> ([B, C, W] fp32 with -inf, k0). config: one of `score_config_space` (None: DSA_INDEX_SCORES_CONFIG,
    else autotuned)."""
    q, k = _score_inputs("index_scores", q, k, fp8)
    qs = ks = None
    if fp8:
        (q, qs), (k, ks) = quantize_rows_triton(q, ue8m0), quantize_rows_triton(k, ue8m0)
    k0 = int(doc_start[:, q0:q1].min())
    pos = torch.arange(q.shape[1], device=q.device, dtype=torch.int32)
    return _score_chunk(q, k, w.float().contiguous(), doc_start.contiguous(), pos, q0, q1, k0, q1, qs, ks,
                        key_span, score_dtype, config), k0
