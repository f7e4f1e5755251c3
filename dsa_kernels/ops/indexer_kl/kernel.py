"""Fused indexer KL losses (report eqs. 3 and 4): Triton.

Specification: `indexer_kl.sparse_indexer_kl_ref` / `dense_indexer_kl_ref`. For one query row,
with p the head-averaged main-attention probabilities (target, no gradient) and I the indexer
scores over the row's keys,

    KL = sum_{p>0} p (log p - I) + P * logsumexp(I),     P = sum p  (= 1 up to rounding)
    dKL/dI = P * softmax(I) - p

so a row needs one streaming pass for (A = sum p log p, B = sum p I, P, online logsumexp of I)
and, for the gradient, a second pass once logsumexp(I) is known. The autograd forward launches
the kernels without their gradient pass (GRAD=False); backward launches them again with it and
scales dq_I, dk_I, dw by grad_output, so no gradient tensor is kept from forward to backward and
nothing of size [T, T] or [heads, T, K] is kept either. The gradient dots take operands at the
inputs' precision (bf16 -> tensor cores with fp32 accumulation; fp32 -> IEEE fp32, never TF32).
Each program walks only up to its row's last valid slot (`slot_counts`).

Sparse (eq. 4), per chunk of tokens: `_sparse_kl_target_kernel` forms the target Sigma_h P at
the selected slots once per token (`exp(scale q_h . kv[s] - lse_h)` from the main-attention
forward's lse; per head block the query stays resident while the selected KV rows stream past;
head blocks added in a [B, C, K] fp32 scratch in order), then `_sparse_kl_kernel` (one program
per token) reads p = Sigma_h P / H from that scratch in both passes; I = sum_j w_j ReLU(q_I,j .
k_I[s]) with all indexer heads of the token as the M dimension of one dot. dk_I of the selected
rows is scattered with atomic adds.

Dense (eq. 3), flash-style: kernel 1 computes each main head's log-sum-exp over the row's
causal + document window (online, never storing logits); kernel 2 (one program per block of
BLOCK_M queries) walks key tiles, rebuilding the head-averaged target tile from those lse values
and the indexer score tile, and keeps per-row running statistics; its second pass (gradient)
recomputes the tiles, forms g = P softmax(I) - p and adds dq_I into the program's own rows
(atomic adds that nothing else touches: no read-back, so no [BLOCK_M, D_I] fp32 old values in
registers), dw into its own rows too (but a plain read-modify-write), and dk_I for the key
tile over all indexer heads before one atomic add. Its dots have M = 64 (64 query rows, 8 warps): wgmma on sm_90a
with bf16 inputs. Memory: O(T * heads) (the lse table and the gradients).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._triton_common import Launch, pow2, target_capability
# the target Sigma_h P at the slots is the attention's quantity: its kernel lives with sparse MLA
from ..sparse_mla.target import TARGET_CHUNK_ELEMS, _sparse_kl_target_kernel, plan_sparse_kl_target, sparse_target_blocks  # noqa: F401

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


# ----------------------------------------------------------------------------- row statistics
# Shared by the sparse kernel (one token's [BLOCK_K] slots: AXIS = 0, scalar statistics) and the
# dense ones (`_dense_kl_kernel`, fused.py's; [BLOCK_M, BLOCK_N] tiles: AXIS = 1, [BLOCK_M]
# statistics). AXIS is the key axis the statistics sum over.
@triton.jit
def _online_lse_step(m_i, l_i, sc, AXIS: tl.constexpr):
    """One tile of a running (natural-log) logsumexp of the indexer scores sc (-inf = no key) ->
    (m_i, l_i); a row without a finite score so far keeps m_i = -inf, without NaN."""
    m_new = tl.maximum(m_i, tl.max(sc, AXIS))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(sc - tl.expand_dims(m_safe, AXIS)), AXIS)
    return m_new, l_i


@triton.jit
def _kl_sums_step(a_sum, b_sum, p_sum, n_valid, p, sc, valid, AXIS: tl.constexpr):
    """One tile's A = sum p log p, B = sum p I (over p > 0), P = sum p and the valid keys' count,
    added to the running sums -> (a_sum, b_sum, p_sum, n_valid)."""
    pos = p > 0
    a_sum += tl.sum(tl.where(pos, p * tl.log(tl.where(pos, p, 1.0)), 0.0), AXIS)
    b_sum += tl.sum(tl.where(pos, p * tl.where(valid, sc, 0.0), 0.0), AXIS)
    p_sum += tl.sum(p, AXIS)
    n_valid += tl.sum(valid.to(tl.int32), AXIS)
    return a_sum, b_sum, p_sum, n_valid


@triton.jit
def _kl_values(a_sum, b_sum, p_sum, n_valid, lse_i):
    """-> (KL = A - B + P lse_I, 0 for a row without a valid key; KL to the uniform distribution
    over the row's valid keys, A + log(count))."""
    kl = tl.where(n_valid > 0, a_sum - b_sum + p_sum * lse_i, 0.0)
    klu = a_sum + tl.log(tl.maximum(n_valid, 1).to(tl.float32))
    return kl, klu


@triton.jit
def _kl_finish(m_i, l_i, a_sum, b_sum, p_sum, n_valid):
    """A row's statistics -> (lse_I (0 for a row without a valid key), KL, KL to uniform)."""
    has = n_valid > 0
    lse_i = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), 0.0)
    kl, klu = _kl_values(a_sum, b_sum, p_sum, n_valid, lse_i)
    return lse_i, kl, klu


# ----------------------------------------------------------------------------- sparse (eq. 4)
@triton.jit
def _sparse_kl_kernel(
    QI, KI, WI, IDX, NSLOT, P_SUM,
    KL, KLU, DQI, DKI, DWI,
    stride_qib, stride_qit, stride_qih,
    stride_kib, stride_kit,
    stride_wib, stride_wit,
    stride_ib, stride_it,
    stride_nb,
    stride_pb, stride_pt,
    stride_dkb, stride_dkt,
    t0, T, N_KEYS, HI, inv_h,
    DI: tl.constexpr,
    GRAD: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_HI: tl.constexpr, BLOCK_DI: tl.constexpr,
):
    """KL of token t0 + program against its target p = inv_h * P_SUM[slot] (from
    `_sparse_kl_target_kernel`) -> KL, KLU [B, T]; with GRAD also dq_I, dk_I (atomics), dw."""
    c = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    t = t0 + c
    offs_j = tl.arange(0, BLOCK_HI)
    mask_j = offs_j < HI
    offs_di = tl.arange(0, BLOCK_DI)
    mask_di = offs_di < DI
    qi = tl.load(QI + b * stride_qib + t * stride_qit + offs_j[:, None] * stride_qih + offs_di[None, :],
                 mask=mask_j[:, None] & mask_di[None, :], other=0.0)
    wi = tl.load(WI + b * stride_wib + t * stride_wit + offs_j, mask=mask_j, other=0.0).to(tl.float32)
    idx_base = IDX + b * stride_ib + t * stride_it
    ki_base = KI + b * stride_kib
    p_base = P_SUM + b * stride_pb + c * stride_pt
    n_slots = tl.load(NSLOT + b * stride_nb + t)  # slots after the last valid one are all -1

    m_i = float("-inf")
    l_i = 0.0
    a_sum = 0.0
    b_sum = 0.0
    p_sum = 0.0
    n_valid = 0
    for k0 in range(0, n_slots, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(idx_base + offs_k, mask=offs_k < n_slots, other=-1)
        valid = (idx >= 0) & (idx < N_KEYS)  # out of range: an empty slot (`check_indices`)
        safe = tl.where(valid, idx, 0).to(tl.int64)
        # target: head-averaged main-attention probabilities at the selected keys
        p = tl.load(p_base + offs_k, mask=offs_k < n_slots, other=0.0) * inv_h
        # indexer scores at the selected keys
        ki = tl.load(ki_base + safe[:, None] * stride_kit + offs_di[None, :],
                     mask=valid[:, None] & mask_di[None, :], other=0.0)
        a = tl.dot(qi, tl.trans(ki))  # [BLOCK_HI, BLOCK_K]
        sc = tl.sum(wi[:, None] * tl.maximum(a, 0.0), 0)
        sc = tl.where(valid, sc, float("-inf"))
        m_i, l_i = _online_lse_step(m_i, l_i, sc, 0)
        a_sum, b_sum, p_sum, n_valid = _kl_sums_step(a_sum, b_sum, p_sum, n_valid, p, sc, valid, 0)

    lse_i, kl, klu = _kl_finish(m_i, l_i, a_sum, b_sum, p_sum, n_valid)
    tl.store(KL + b * T + t, kl)
    tl.store(KLU + b * T + t, klu)

    if GRAD:
        dqi = tl.zeros([BLOCK_HI, BLOCK_DI], dtype=tl.float32)
        dwi = tl.zeros([BLOCK_HI], dtype=tl.float32)
        for k0 in range(0, n_slots, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            idx = tl.load(idx_base + offs_k, mask=offs_k < n_slots, other=-1)
            valid = (idx >= 0) & (idx < N_KEYS)
            safe = tl.where(valid, idx, 0).to(tl.int64)
            p = tl.load(p_base + offs_k, mask=offs_k < n_slots, other=0.0) * inv_h
            ki = tl.load(ki_base + safe[:, None] * stride_kit + offs_di[None, :],
                         mask=valid[:, None] & mask_di[None, :], other=0.0)
            a = tl.dot(qi, tl.trans(ki))
            relu = tl.maximum(a, 0.0)
            sc = tl.sum(wi[:, None] * relu, 0)
            g = tl.where(valid, p_sum * tl.exp(sc - lse_i) - p, 0.0)  # dKL / dI
            dwi += tl.sum(relu * g[None, :], 1)
            # gradient dots at the inputs' precision (bf16 operands -> tensor cores, fp32
            # accumulation; fp32 inputs -> IEEE fp32, never TF32)
            da = tl.where(a > 0, wi[:, None] * g[None, :], 0.0).to(ki.dtype)  # [BLOCK_HI, BLOCK_K]
            dqi += tl.dot(da, ki, input_precision="ieee")
            # dk_I^T = q_I^T da, D_I (128) on M: a wgmma. da^T q_I would put the 32 slots on M,
            # below wgmma's 64 (it ran as 32 mma.sync).
            dk_t = tl.dot(tl.trans(qi), da, input_precision="ieee")  # [BLOCK_DI, BLOCK_K]
            # dk_I rows are global key positions: DKI has k_I's N_KEYS rows, not the T query rows;
            # relaxed: nothing reads them before the launch ends (vector `red` adds)
            tl.atomic_add(DKI + b * stride_dkb + safe[None, :] * stride_dkt + offs_di[:, None], dk_t,
                          mask=valid[None, :] & mask_di[:, None], sem="relaxed")
        tl.store(DQI + ((b * T + t) * HI + offs_j[:, None]) * DI + offs_di[None, :], dqi,
                 mask=mask_j[:, None] & mask_di[None, :])
        tl.store(DWI + (b * T + t) * HI + offs_j, dwi, mask=mask_j)


# ----------------------------------------------------------------------------- dense (eq. 3)
@triton.jit
def _query_block(DS, b, pid_m, stride_db, T, Q0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The prologue of the dense kernels (`_dense_lse_kernel`, `_dense_kl_kernel` and `fused.py`'s):
    query block pid_m of batch row b, its rows at positions Q0 + offs_m (masked past T) ->
    (offs_m, mask_m, ds, start, hi): the rows' doc starts (DS [B, N]; a masked row reads int32 max)
    and the key tiles they see, [start, hi) in steps of BLOCK_N, from the block's first doc start
    (rounded down to a tile) to its last row's causal end."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < T
    ds = tl.load(DS + b * stride_db + Q0 + offs_m, mask=mask_m, other=2147483647).to(tl.int32)
    lo = tl.min(ds, 0)
    hi = Q0 + tl.minimum(pid_m * BLOCK_M + BLOCK_M, T)
    start = (lo // BLOCK_N) * BLOCK_N
    return offs_m, mask_m, ds, start, hi


@triton.jit
def _dense_lse_kernel(
    QM, KM, DS, LSE2,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_db,
    T, H, scale_log2,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """lse2[b, h, t] = log2 sum_s exp2(scale_log2 * q[t,h] . k[s,h]) over doc_start[t] <= s <= t."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m, mask_m, ds, start, hi = _query_block(DS, b, pid_m, stride_db, T, 0, BLOCK_M, BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    q_base = QM + b * stride_qb + h * stride_qh
    k_base = KM + b * stride_kb + h * stride_kh
    for n0 in range(start, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        s = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            mask_d = offs_d < D
            q = tl.load(q_base + offs_m[:, None].to(tl.int64) * stride_qt + offs_d[None, :],
                        mask=mask_m[:, None] & mask_d[None, :], other=0.0)
            k = tl.load(k_base + offs_n[:, None].to(tl.int64) * stride_kt + offs_d[None, :],
                        mask=(offs_n < T)[:, None] & mask_d[None, :], other=0.0)
            s += tl.dot(q, tl.trans(k))
        valid = (offs_n[None, :] <= offs_m[:, None]) & (offs_n[None, :] >= ds[:, None])
        s = tl.where(valid, s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), 1)
        m_i = m_new
    lse2 = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("inf"))
    tl.store(LSE2 + bh.to(tl.int64) * T + offs_m, lse2, mask=mask_m)


@triton.jit
def _target_tile(
    QM, KM, LSE2, b, offs_m, mask_m, offs_n, mask_n, valid,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    T, H, scale_log2, inv_h,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """The head-averaged target tile p [M, N] (0 where not valid): every main head's q k^T (D in
    BLOCK_D slices) against the key tile offs_n, exp2'd against the head's lse (LSE2, log2 domain)."""
    p = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for h in range(H):
        s = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            mask_d = offs_d < D
            q = tl.load(QM + b * stride_qb + offs_m[:, None].to(tl.int64) * stride_qt + h * stride_qh + offs_d[None, :],
                        mask=mask_m[:, None] & mask_d[None, :], other=0.0)
            k = tl.load(KM + b * stride_kb + offs_n[:, None].to(tl.int64) * stride_kt + h * stride_kh + offs_d[None, :],
                        mask=mask_n[:, None] & mask_d[None, :], other=0.0)
            s += tl.dot(q, tl.trans(k))
        lse2 = tl.load(LSE2 + (b * H + h) * T + offs_m, mask=mask_m, other=float("inf"))
        p += tl.exp2(s * scale_log2 - lse2[:, None])
    return tl.where(valid, p * inv_h, 0.0)


@triton.jit
def _dense_tiles(
    QM, KM, QI, KI, WI, LSE2,
    b, offs_m, mask_m, offs_n, ds,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_qib, stride_qit, stride_qih,
    stride_kib, stride_kit,
    stride_wib, stride_wit,
    T, Q0, N_KEYS, H, HI, scale_log2, inv_h,
    D: tl.constexpr, DI: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DI: tl.constexpr,
):
    """-> (p [M, N] head-averaged target, I [M, N] indexer scores (-inf masked), valid [M, N]).
    Query row m is at position Q0 + m; key rows are positions [0, N_KEYS)."""
    valid = (offs_n[None, :] <= (Q0 + offs_m)[:, None]) & (offs_n[None, :] >= ds[:, None]) & mask_m[:, None]
    mask_n = offs_n < N_KEYS
    p = _target_tile(QM, KM, LSE2, b, offs_m, mask_m, offs_n, mask_n, valid,
                     stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                     T, H, scale_log2, inv_h, D, BLOCK_M, BLOCK_N, BLOCK_D)
    offs_di = tl.arange(0, BLOCK_DI)
    mask_di = offs_di < DI
    ki = tl.load(KI + b * stride_kib + offs_n[:, None].to(tl.int64) * stride_kit + offs_di[None, :],
                 mask=mask_n[:, None] & mask_di[None, :], other=0.0)
    sc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for j in range(HI):
        qi = tl.load(QI + b * stride_qib + offs_m[:, None].to(tl.int64) * stride_qit + j * stride_qih + offs_di[None, :],
                     mask=mask_m[:, None] & mask_di[None, :], other=0.0)
        wj = tl.load(WI + b * stride_wib + offs_m.to(tl.int64) * stride_wit + j, mask=mask_m, other=0.0).to(tl.float32)
        sc += wj[:, None] * tl.maximum(tl.dot(qi, tl.trans(ki)), 0.0)
    sc = tl.where(valid, sc, float("-inf"))
    return p, sc, valid, ki


@triton.jit
def _dense_kl_stats(
    QM, KM, QI, KI, WI, LSE2, KL, KLU, LSEI, PSUM, b, offs_m, mask_m, ds, start, hi,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_qib, stride_qit, stride_qih, stride_kib, stride_kit, stride_wib, stride_wit,
    T, Q0, N_KEYS, H, HI, scale_log2, inv_h,
    D: tl.constexpr, DI: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DI: tl.constexpr,
):
    """The statistics pass of `_dense_kl_kernel` over key tiles [start, hi): stores each row's KL,
    KL to uniform, indexer logsumexp and target mass; -> (lse_i, p_sum)."""
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    a_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    p_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    n_valid = tl.zeros([BLOCK_M], dtype=tl.int32)
    for n0 in range(start, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        p, sc, valid, ki = _dense_tiles(
            QM, KM, QI, KI, WI, LSE2, b, offs_m, mask_m, offs_n, ds,
            stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
            stride_qib, stride_qit, stride_qih, stride_kib, stride_kit, stride_wib, stride_wit,
            T, Q0, N_KEYS, H, HI, scale_log2, inv_h, D, DI, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DI)
        m_i, l_i = _online_lse_step(m_i, l_i, sc, 1)
        a_sum, b_sum, p_sum, n_valid = _kl_sums_step(a_sum, b_sum, p_sum, n_valid, p, sc, valid, 1)

    lse_i, kl, klu = _kl_finish(m_i, l_i, a_sum, b_sum, p_sum, n_valid)
    tl.store(KL + b * T + offs_m, kl, mask=mask_m)
    tl.store(KLU + b * T + offs_m, klu, mask=mask_m)
    tl.store(LSEI + b * T + offs_m, lse_i, mask=mask_m)
    tl.store(PSUM + b * T + offs_m, p_sum, mask=mask_m)
    return lse_i, p_sum


@triton.jit
def _dense_kl_kernel(
    QM, KM, QI, KI, WI, DS, LSE2,
    KL, KLU, LSEI, PSUM, DQI, DKI, DWI,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_qib, stride_qit, stride_qih,
    stride_kib, stride_kit,
    stride_wib, stride_wit,
    stride_db,
    T, Q0, N_KEYS, H, HI, scale_log2, inv_h,
    D: tl.constexpr, DI: tl.constexpr, GRAD: tl.constexpr, STATS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_HI: tl.constexpr, BLOCK_DI: tl.constexpr,
):
    """T query rows at positions Q0 + row (Q0 = 0, N_KEYS = T: the whole sequence; under context
    parallelism a run of a rank's queries over the N_KEYS gathered keys). STATS: the statistics
    pass (KL, KL to uniform, and each row's indexer logsumexp and target mass into LSEI / PSUM);
    without it those two are read from LSEI / PSUM (the forward's), so the gradient pass (GRAD)
    alone forms the main scores once more."""
    pid_m = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_m, mask_m, ds, start, hi = _query_block(DS, b, pid_m, stride_db, T, Q0, BLOCK_M, BLOCK_N)

    if STATS:
        lse_i, p_sum = _dense_kl_stats(
            QM, KM, QI, KI, WI, LSE2, KL, KLU, LSEI, PSUM, b, offs_m, mask_m, ds, start, hi,
            stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
            stride_qib, stride_qit, stride_qih, stride_kib, stride_kit, stride_wib, stride_wit,
            T, Q0, N_KEYS, H, HI, scale_log2, inv_h, D, DI, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DI)
    else:
        lse_i = tl.load(LSEI + b * T + offs_m, mask=mask_m, other=0.0)
        p_sum = tl.load(PSUM + b * T + offs_m, mask=mask_m, other=0.0)

    if GRAD:
        offs_di = tl.arange(0, BLOCK_DI)
        mask_di = offs_di < DI
        rows_mask = mask_m[:, None] & mask_di[None, :]
        for n0 in range(start, hi, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            p, sc, valid, ki = _dense_tiles(
                QM, KM, QI, KI, WI, LSE2, b, offs_m, mask_m, offs_n, ds,
                stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                stride_qib, stride_qit, stride_qih, stride_kib, stride_kit, stride_wib, stride_wit,
                T, Q0, N_KEYS, H, HI, scale_log2, inv_h, D, DI, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DI)
            g = tl.where(valid, p_sum[:, None] * tl.exp(sc - lse_i[:, None]) - p, 0.0)  # dKL / dI
            dk_t = tl.zeros([BLOCK_DI, BLOCK_N], dtype=tl.float32)  # dk_I of the key tile, transposed
            for j in range(HI):
                qi = tl.load(QI + b * stride_qib + offs_m[:, None].to(tl.int64) * stride_qit + j * stride_qih + offs_di[None, :],
                             mask=rows_mask, other=0.0)  # [BLOCK_M, BLOCK_DI]
                wj = tl.load(WI + b * stride_wib + offs_m.to(tl.int64) * stride_wit + j, mask=mask_m, other=0.0).to(tl.float32)
                a = tl.dot(qi, tl.trans(ki))  # [BLOCK_M, BLOCK_N]
                # dw: read-modify-write of rows owned by this program (no [M, H_I] registers)
                dw_ptrs = DWI + (b * T + offs_m) * HI + j
                dw_old = tl.load(dw_ptrs, mask=mask_m, other=0.0)
                tl.store(dw_ptrs, dw_old + tl.sum(g * tl.maximum(a, 0.0), 1), mask=mask_m)
                # gradient dots on the inputs' dtype (bf16 operands -> tensor cores, fp32 accumulation;
                # the entry point never gives compiled kernels fp32 operands: `compute_dtype`)
                da = tl.where(a > 0, g * wj[:, None], 0.0).to(ki.dtype)  # [BLOCK_M, BLOCK_N]
                # dq_I: rows owned by this program, added without reading them back (a load of the
                # old [BLOCK_M, D_I] values beside the new ones spilled); one program per row, so
                # the additions happen in program order (deterministic)
                tl.atomic_add(DQI + ((b * T + offs_m[:, None]) * HI + j) * DI + offs_di[None, :],
                              tl.dot(da, ki, input_precision="ieee"), mask=rows_mask, sem="relaxed")
                # transposed, [BLOCK_DI, BLOCK_N] = q_I^T da: M = D_I = 128 (wgmma), where da^T q_I
                # would have M = BLOCK_N = 32 (mma.sync)
                dk_t += tl.dot(tl.trans(qi), da, input_precision="ieee")
            tl.atomic_add(DKI + (b * N_KEYS + offs_n[None, :].to(tl.int64)) * DI + offs_di[:, None], dk_t,
                          mask=(offs_n < N_KEYS)[None, :] & mask_di[:, None], sem="relaxed")


# ----------------------------------------------------------------------------- launch plans
def sparse_blocks(K: int, HI: int, DI: int) -> dict:
    return dict(BLOCK_K=min(pow2(K), 32), BLOCK_HI=pow2(HI), BLOCK_DI=pow2(DI))


def plan_sparse_kl(qi, ki, wi, idx, n_slots, p_sum, t0: int, H: int, kl, klu, dq, dk, dw, grad: bool) -> Launch:
    """qi [B, T, H_I, D_I] (T query rows), ki [B, N, D_I] (N key rows, N >= T: under context
    parallelism the gathered sequence), wi [B, T, H_I] fp32, idx [B, T, K] int32 key rows (-1
    empty; outside [0, N) read as empty), p_sum [B, C, K] fp32 (query rows [t0, t0 + C), from
    `plan_sparse_kl_target`), H main heads -> kl, klu [B, T] fp32 and, with grad, dq
    [B, T, H_I, D_I], dk [B, N, D_I] (k_I's shape; zeroed; atomics at the key rows), dw
    [B, T, H_I] fp32 (rows of those tokens written)."""
    B, T, HI, DI = qi.shape
    K = idx.shape[-1]
    C = p_sum.shape[1]
    return Launch(
        _sparse_kl_kernel, (C, B),
        dict(
            QI=qi, KI=ki, WI=wi, IDX=idx, NSLOT=n_slots, P_SUM=p_sum,
            KL=kl, KLU=klu, DQI=dq, DKI=dk, DWI=dw,
            stride_qib=qi.stride(0), stride_qit=qi.stride(1), stride_qih=qi.stride(2),
            stride_kib=ki.stride(0), stride_kit=ki.stride(1),
            stride_wib=wi.stride(0), stride_wit=wi.stride(1),
            stride_ib=idx.stride(0), stride_it=idx.stride(1),
            stride_nb=n_slots.stride(0),
            stride_pb=p_sum.stride(0), stride_pt=p_sum.stride(1),
            stride_dkb=dk.stride(0) if grad else 0, stride_dkt=dk.stride(1) if grad else 0,
            t0=t0, T=T, N_KEYS=ki.shape[1], HI=HI, inv_h=1.0 / H,
            DI=DI, GRAD=grad,
            **sparse_blocks(K, HI, DI),
        ),
        # sm_90a: 4 warps, 214 / 221 registers (Triton 3.9 / 3.6), 2 CTAs an SM, every dot a
        # wgmma with no replicated tile (8 warps: 150 registers, 1 CTA, narrower m64n16 tiles
        # replicated x1.25). sm_100 (3.9): 8 warps, 107 registers; 4 warps spilled 16 B.
        num_warps=8 if target_capability(qi) >= 100 else 4,
    )


def dense_blocks(T: int, D: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D) of `_dense_kl_kernel` (8 warps, 1 stage). 64 query rows: the M
    side of its big dots is 64, one warp group's wgmma tile on sm_90a (the 32 x 32 tiles before
    compiled to 0 wgmma; dk_I is formed transposed, M = D_I). The compile report at the 671B
    shapes, gradient pass, dq_I added with atomics (a read-modify-write of the [64, 128] fp32
    dq_I rows spilled 56-184 B): 64 x 32, 1 stage: 0 spills, 46 wgmma, 0 mma.sync; 234-238
    registers (Triton 3.9 sm_90a), 255 (3.6 sm_90a), 186-204 (3.9 sm_100). 2 stages spilled
    48-80 B under 3.6 and 64 B on sm_100; 64 x 64 spilled under both versions."""
    return min(pow2(T), 64), min(pow2(T), 32), min(pow2(D), 64)


def plan_dense_lse(qm, km, ds, lse2, scale: float) -> Launch:
    """qm [B, T, H, D], km [B, T, H or 1, D], ds [B, T] -> lse2 [B, H, T] fp32 (log2 domain)."""
    B, T, H, D = qm.shape
    # its own 64 x 64 tiles (0 spills; at 32 x 32 ptxas reported a 32-byte spill in the MHA form)
    block_m, block_n, block_d = min(pow2(T), 64), min(pow2(T), 64), min(pow2(D), 64)
    return Launch(
        _dense_lse_kernel, (triton.cdiv(T, block_m), B * H),
        dict(
            QM=qm, KM=km, DS=ds, LSE2=lse2,
            stride_qb=qm.stride(0), stride_qt=qm.stride(1), stride_qh=qm.stride(2),
            stride_kb=km.stride(0), stride_kt=km.stride(1), stride_kh=0 if km.shape[2] == 1 else km.stride(2),
            stride_db=ds.stride(0),
            T=T, H=H, scale_log2=scale * LOG2E,
            D=D, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        ),
        num_warps=4,
    )


def dense_kl_inputs(q_idx, k_idx, w_idx, q_main, k_main, doc_start, lse_main):
    """The dense KL launches' operands from an entry point's tensors (detached): q_I, k_I, q, k in
    the compute dtype (fp32 on the compiled path -> bf16: fp32 dots would be TF32; `compute_dtype`),
    w fp32, the doc starts contiguous and, given lse_main [B, T, H] (natural log), its log2-domain
    [B, H, T] table with a row without keys at +inf (p = 0), as the lse kernel writes it (None
    without it) -> (qi, ki, wi, qm, km, ds, lse2)."""
    from ..._triton_common import compute_dtype, kernel_input

    cdt = compute_dtype("dense_indexer_kl", q_idx, k_idx, q_main, k_main)
    qi, ki = kernel_input(q_idx.detach(), cdt), kernel_input(k_idx.detach(), cdt)
    wi = w_idx.detach().float().contiguous()
    qm, km = kernel_input(q_main.detach(), cdt), kernel_input(k_main.detach(), cdt)
    lse2 = None
    if lse_main is not None:
        lse2 = (lse_main.detach().float() * LOG2E).transpose(1, 2).contiguous()
        lse2 = lse2.masked_fill_(lse2 == float("-inf"), float("inf"))
    return qi, ki, wi, qm, km, doc_start.contiguous(), lse2


def dense_kl_buffers(qi, n_keys: int, need: bool, zero: bool = True):
    """The dense KL launches' fp32 outputs for the query rows of qi [B, T, H_I, D_I] over n_keys key
    rows: kl, klu [B, T] (zeroed; left empty with zero=False) and, with need, the zeroed gradients
    (dq [B, T, H_I, D_I], dk [B, n_keys, D_I], dw [B, T, H_I]); without need kl stands in for them
    (the launch does not write them) -> (kl, klu, (dq, dk, dw))."""
    B, T, HI, DI = qi.shape
    new, dev = torch.zeros if zero else torch.empty, qi.device
    kl, klu = (new((B, T), dtype=torch.float32, device=dev) for _ in range(2))
    if not need:
        return kl, klu, (kl, kl, kl)
    return kl, klu, tuple(torch.zeros(shape, dtype=torch.float32, device=dev)
                          for shape in ((B, T, HI, DI), (B, n_keys, DI), (B, T, HI)))


def dense_kl_strides(qm, km, qi, ki, wi, ds) -> dict:
    """The strides `_dense_kl_kernel` and `fused.py`'s kernel take: qm [B, T, H, D], km [B, N, H or
    1, D] (the shared MQA key: head stride 0), qi [B, T, H_I, D_I], ki [B, N, D_I], wi [B, T, H_I],
    ds [B, N]."""
    return dict(
        stride_qb=qm.stride(0), stride_qt=qm.stride(1), stride_qh=qm.stride(2),
        stride_kb=km.stride(0), stride_kt=km.stride(1), stride_kh=0 if km.shape[2] == 1 else km.stride(2),
        stride_qib=qi.stride(0), stride_qit=qi.stride(1), stride_qih=qi.stride(2),
        stride_kib=ki.stride(0), stride_kit=ki.stride(1),
        stride_wib=wi.stride(0), stride_wit=wi.stride(1),
        stride_db=ds.stride(0),
    )


def plan_dense_kl(qm, km, qi, ki, wi, ds, lse2, kl, klu, dq, dk, dw, scale: float, grad: bool, q0: int = 0,
                  row_stats=None, stats: bool = True) -> Launch:
    """Eq. 3 per query row from the lse table: -> kl, klu [B, T] and, with grad, dq [B, T, H_I, D_I]
    and dk [B, N, D_I] (zeroed), dw [B, T, H_I] fp32. The T query rows (qm, qi, wi, lse2) are at
    positions q0 + row; the key rows (km, ki) and ds [B, N] are positions [0, N), N >= q0 + T.
    row_stats = (lse_i, p_sum) [B, T] fp32: written by the statistics pass (stats=True), read by a
    gradient-only launch (stats=False, grad=True: the backward after a statistics forward)."""
    if row_stats is None:
        row_stats = (torch.empty_like(kl), torch.empty_like(kl))
    if not stats and not grad:
        raise ValueError("plan_dense_kl: a launch without the statistics pass must run the gradient pass")
    B, T, H, D = qm.shape
    HI, DI = qi.shape[2], qi.shape[3]
    block_m, block_n, block_d = dense_blocks(T, D)
    return Launch(
        _dense_kl_kernel, (triton.cdiv(T, block_m), B),
        dict(
            QM=qm, KM=km, QI=qi, KI=ki, WI=wi, DS=ds, LSE2=lse2,
            KL=kl, KLU=klu, LSEI=row_stats[0], PSUM=row_stats[1], DQI=dq, DKI=dk, DWI=dw,
            **dense_kl_strides(qm, km, qi, ki, wi, ds),
            T=T, Q0=q0, N_KEYS=km.shape[1], H=H, HI=HI, scale_log2=scale * LOG2E, inv_h=1.0 / H,
            D=D, DI=DI, GRAD=grad, STATS=stats,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
            BLOCK_HI=pow2(HI), BLOCK_DI=pow2(DI),
        ),
        num_warps=8, num_stages=1,
    )
