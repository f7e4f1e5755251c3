"""Sparse MLA (MQA / absorbed mode) over top-k indices: Triton forward and backward.

Specification: `reference.sparse_mla_ref`. Shapes: q [B, T, H, D] with D = D_V + D_R
(576 = 512 latent + 64 rope in the 671B model), kv [B, N, D] (N >= T under context parallelism:
the keys of the whole sequence, the queries this rank's), indices [B, T, K] int32.

Grid: (tokens x head blocks [x parts], B); program x = (token * head blocks + head block) [*
parts + part], so the head block (and part) is fastest: the programs of one token, which gather
the same KV rows, run together. Tokens are on x because CUDA's grid y / z stop at 65,535 while x
goes to 2^31 - 1: any token count launches (T = 128K at H = 128: forward x = 262,144, backward
524,288); B (y) stays small.

Indices: a slot is valid when 0 <= idx < N (N = kv.shape[1]); -1 marks an empty slot and any
other out-of-range value is read as empty too (masked before the load and before the atomics,
never an illegal address). `slot_counts` uses the same rule, so the kernels walk each row only
up to its last valid slot and a short row's tail costs nothing. The entry point's
`check_indices` turns out-of-range values into an error under DSA_KERNELS_CHECK=1.

Forward (one program per (token, head block of 64); FlashMLA's schedule as far as Triton goes):
q of the head block stays resident (shared memory); the selected slots are walked in 16-key tiles;
each tile gathers the selected rows of `kv = [latent | k_rope]` once for all heads of the block
(the MQA saving) and uses them twice, for the logits over all 576 dims (computed once) and for
the value product. The 512 latent columns are four 128-column quarters, each its own tensor,
dot and [64, 128] fp32 accumulator (Triton cannot slice a tile), so the logits, P and the
gathered rows are shared by the whole value and nothing is recomputed: the tl.dot FLOPs equal
the useful ones, and each selected row is read once per head block (FlashMLA's traffic). Online
softmax in the log2 domain from a finite running max, so a row with no valid slot returns
out = 0 and lse = -inf with no NaN. Triton's layout for a dot that feeds another dot puts all 8
warps on M, so the [64, 16] logits tile is computed by both warp groups (the report's
`replication` column: x1.53 of the useful FLOPs on the tensor cores); FlashMLA avoids that with
one producer and two consumer warp groups, which Triton proper does not express.

KL target (`TARGET`, issue 31 item 4; docs/kernels.md "The sparse KL's target"): with a target
buffer the forward walks the slots a second time once each head's lse is final, recomputes the
logits and adds Sigma_h P of its head block per slot into P_SUM (`sparse_mla_fwd(p_sum=...)`, the
"forward-pass" way; the default "target-kernel" way runs indexer_kl's target kernel after it).

Backward (one program per (head block of 64, column half, token), 16-key tiles): delta =
rowsum(dO * O) - dlse is computed in PyTorch in bounded token chunks (`bwd_delta`); per key
tile the logits and dP = dO V^T are formed over all dims in 64-channel pieces (q and dO pieces
stream from L2, nothing large stays in registers), p is recomputed from the saved lse,
dS = p (dP - delta) scale. Each of SPLIT = 2 parts owns half of the latent columns (part 0 also
the rope columns): it accumulates its slice of dq in registers (written once) and scatters its
slice of dkv[idx] = dS^T q + p^T dO (latent) and dS^T q_rope (rope) with fp32 atomic adds,
because a key row is selected by many queries. The summation order of those atomics is not
deterministic; under `torch.use_deterministic_algorithms(True)` the backward instead runs in
(token chunk, slot window) blocks (`sparse_mla_bwd_deterministic`). Duplicated indices in a row
add twice (as in the reference).

Interleaved backward (`_sparse_mla_bwd_interleaved_kernel`, the second config of the atomic
backward's autotuning space on Hopper, `bwd_config_space`): one program per (token, 32 heads), q
and dO resident as one operand of 64 interleaved rows (the logits' M, so every product is a wgmma
while the key tiles stay at 32), each selected row gathered once per 32 heads, nothing
recomputed; see its own comment and docs/kernels.md "Backward v2". On a GPU `sparse_mla_bwd`
verifies it against the split kernel and times both once per shape (`dsa_kernels.autotune`);
elsewhere the split kernel runs. On sm_90 the Gluon backward (`gluon_bwd.py`, 64 heads a CTA, a gather
producer warp group, `BWD_GLUON_CONFIGS`) follows in that space, verified and timed the same way.
"""

from __future__ import annotations

import contextlib
import contextvars
import os

import torch
import triton
import triton.language as tl

from ... import autotune
from ..._triton_common import Launch, env_flag, interpreted, pow2, row_dot, target_capability
from .launch_args import _bwd_args, _fwd_args

LOG2E = 1.4426950408889634
GRID_X_MAX, GRID_YZ_MAX = 2**31 - 1, 65535  # CUDA's grid limits (x; y and z)


@triton.jit
def _fwd_tile_logits(k0, n_slots, idx_base, kv_base, stride_kvt, N_KV, scale_log2, q0, q1, q2, q3, qr,
                     c0, c1, c2, c3, m0, m1, m2, m3, offs_c, offs_r, mr, D_V: tl.constexpr, BLOCK_K: tl.constexpr):
    """The forward's key tile at slots [k0, k0 + BLOCK_K) of a row of n_slots: its selected rows
    gathered (the four latent quarters kv0..kv3 [BLOCK_K, BLOCK_C] at columns c0..c3, the rope part
    [BLOCK_K, BLOCK_DR]) and the logits over all 576 dims in the log2 domain, s [BLOCK_H, BLOCK_K]
    (-inf at empty slots), from the resident q quarters q0..q3 [BLOCK_H, BLOCK_C] and rope qr.
    -> (offs_k, valid, kv0, kv1, kv2, kv3, s)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    idx = tl.load(idx_base + offs_k, mask=offs_k < n_slots, other=-1)
    valid = (idx >= 0) & (idx < N_KV)  # out of range = empty slot (never an illegal address)
    # row offsets in int32 (the launcher checks N * stride < 2^31): fewer live registers
    rows = kv_base + (tl.where(valid, idx, 0) * stride_kvt)[:, None]
    vk = valid[:, None]
    kv0 = tl.load(rows + c0 + offs_c[None, :], mask=vk & m0[None, :], other=0.0)
    kv1 = tl.load(rows + c1 + offs_c[None, :], mask=vk & m1[None, :], other=0.0)
    kv2 = tl.load(rows + c2 + offs_c[None, :], mask=vk & m2[None, :], other=0.0)
    kv3 = tl.load(rows + c3 + offs_c[None, :], mask=vk & m3[None, :], other=0.0)
    kvr = tl.load(rows + D_V + offs_r[None, :], mask=vk & mr[None, :], other=0.0)
    s = tl.dot(q0, tl.trans(kv0))
    s += tl.dot(q1, tl.trans(kv1))
    s += tl.dot(q2, tl.trans(kv2))
    s += tl.dot(q3, tl.trans(kv3))
    s += tl.dot(qr, tl.trans(kvr))
    s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
    return offs_k, valid, kv0, kv1, kv2, kv3, s


@triton.jit
def _sparse_mla_fwd_kernel(
    Q, KV, IDX, NSLOT, O, LSE, P_SUM,
    stride_qb, stride_qt, stride_qh,
    stride_kvb, stride_kvt,
    stride_ib, stride_it,
    stride_nb,
    stride_ob, stride_ot, stride_oh,
    stride_lb, stride_lt,
    stride_pb, stride_pt,
    H, N_KV, N_HB, scale_log2,
    D_V: tl.constexpr, D_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
    EVEN_H: tl.constexpr, VALUE_SPLIT: tl.constexpr, TARGET: tl.constexpr = False,
):
    # program (x, y) -> (token, head block, value part), the part fastest, then the head block; y = b.
    # VALUE_SPLIT = 1 (sm_90): one program owns the four value quarters. VALUE_SPLIT = 2 (sm_100,
    # whose tensor memory holds 512 fp32 columns: four [64, 128] accumulators and the logits do
    # not fit): part v owns quarters 2v, 2v + 1 and both parts compute the logits.
    pid = tl.program_id(0)
    part = pid % VALUE_SPLIT
    hb = (pid // VALUE_SPLIT) % N_HB
    t = (pid // (VALUE_SPLIT * N_HB)).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = (offs_h < H) | EVEN_H  # EVEN_H (H % BLOCK_H == 0): no head mask, fewer live predicates
    mh = mask_h[:, None]
    # the latent dims as four column quarters (c0..c3) and the rope dims (r): separate tensors,
    # so each dot, accumulator and store is a [., BLOCK_C] piece (Triton cannot slice a tile)
    # Quarter j starts at column c_j; with VALUE_SPLIT = 2 the order is rotated so that this part's
    # own two quarters come first (j = 0, 1): every quarter is still loaded once per tile.
    BLOCK_C: tl.constexpr = BLOCK_DV // 4
    offs_c = tl.arange(0, BLOCK_C)
    c0 = ((part * 2) % 4) * BLOCK_C
    c1 = ((part * 2 + 1) % 4) * BLOCK_C
    c2 = ((part * 2 + 2) % 4) * BLOCK_C
    c3 = ((part * 2 + 3) % 4) * BLOCK_C
    m0 = c0 + offs_c < D_V
    m1 = c1 + offs_c < D_V
    m2 = c2 + offs_c < D_V
    m3 = c3 + offs_c < D_V
    offs_r = tl.arange(0, BLOCK_DR)
    mr = offs_r < D_R

    q_ptrs = Q + b * stride_qb + t * stride_qt + offs_h[:, None] * stride_qh
    q0 = tl.load(q_ptrs + c0 + offs_c[None, :], mask=mh & m0[None, :], other=0.0)
    q1 = tl.load(q_ptrs + c1 + offs_c[None, :], mask=mh & m1[None, :], other=0.0)
    q2 = tl.load(q_ptrs + c2 + offs_c[None, :], mask=mh & m2[None, :], other=0.0)
    q3 = tl.load(q_ptrs + c3 + offs_c[None, :], mask=mh & m3[None, :], other=0.0)
    qr = tl.load(q_ptrs + D_V + offs_r[None, :], mask=mh & mr[None, :], other=0.0)

    # running max starts finite: a row with no valid slot keeps p = 0 and never forms -inf - -inf
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc0 = tl.zeros([BLOCK_H, BLOCK_C], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_H, BLOCK_C], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_H, BLOCK_C], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_H, BLOCK_C], dtype=tl.float32)
    kv_base = KV + b * stride_kvb
    idx_base = IDX + b * stride_ib + t * stride_it
    n_slots = tl.load(NSLOT + b * stride_nb + t)  # slots after the last valid one are all empty
    for k0 in range(0, n_slots, BLOCK_K):
        # the tile's selected rows, gathered once for all heads of the block and used by the
        # logits and the value product alike
        offs_k, valid, kv0, kv1, kv2, kv3, s = _fwd_tile_logits(
            k0, n_slots, idx_base, kv_base, stride_kvt, N_KV, scale_log2, q0, q1, q2, q3, qr,
            c0, c1, c2, c3, m0, m1, m2, m3, offs_c, offs_r, mr, D_V, BLOCK_K)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p_c = p.to(kv0.dtype)  # one P for the value quarters (all four, or this part's two)
        acc0 = acc0 * alpha[:, None] + tl.dot(p_c, kv0)
        acc1 = acc1 * alpha[:, None] + tl.dot(p_c, kv1)
        if VALUE_SPLIT == 1:
            acc2 = acc2 * alpha[:, None] + tl.dot(p_c, kv2)
            acc3 = acc3 * alpha[:, None] + tl.dot(p_c, kv3)
        m_i = m_new

    has = l_i > 0
    inv_l = 1.0 / tl.where(has, l_i, 1.0)
    o_ptrs = O + b * stride_ob + t * stride_ot + offs_h[:, None] * stride_oh + offs_c[None, :]
    tl.store(o_ptrs + c0, (acc0 * inv_l[:, None]).to(O.dtype.element_ty), mask=mh & m0[None, :])
    tl.store(o_ptrs + c1, (acc1 * inv_l[:, None]).to(O.dtype.element_ty), mask=mh & m1[None, :])
    if VALUE_SPLIT == 1:
        tl.store(o_ptrs + c2, (acc2 * inv_l[:, None]).to(O.dtype.element_ty), mask=mh & m2[None, :])
        tl.store(o_ptrs + c3, (acc3 * inv_l[:, None]).to(O.dtype.element_ty), mask=mh & m3[None, :])
    if part == 0:
        lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        tl.store(LSE + b * stride_lb + t * stride_lt + offs_h, lse, mask=mask_h)
        if TARGET:
            # the sparse indexer KL's target (eq. 4): Sigma_h P[t, slot] = sum_h exp2(s_h - lse2_h) over
            # this block's heads, a second walk over the slots now that each head's lse is final (an
            # online softmax cannot sum heads earlier: each head's rescaling differs). The rows are
            # gathered again (the block's other head blocks gather the same rows at the same time:
            # L2), the logits recomputed with q still resident; the head sum stays in registers and
            # one fp32 value per slot is added to P_SUM [B, T, K] (zeroed; with <= 2 head blocks the
            # two addends onto 0 give the same bits in either order).
            lse2 = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("inf"))
            p_base = P_SUM + b * stride_pb + t * stride_pt
            for k0 in tl.range(0, n_slots, BLOCK_K, num_stages=1):
                offs_k, valid, kv0, kv1, kv2, kv3, s = _fwd_tile_logits(
                    k0, n_slots, idx_base, kv_base, stride_kvt, N_KV, scale_log2, q0, q1, q2, q3, qr,
                    c0, c1, c2, c3, m0, m1, m2, m3, offs_c, offs_r, mr, D_V, BLOCK_K)
                p = tl.where(mh, tl.exp2(s - lse2[:, None]), 0.0)
                tl.atomic_add(p_base + offs_k, tl.sum(p, 0), mask=offs_k < n_slots, sem="relaxed")


@triton.jit
def _bwd_row_stats(LSE, DELTA, b, t, offs_h, mask_h, stride_lb, stride_lt):
    """The backward's per-head statistics of token t, heads offs_h [BLOCK_H]: lse2 = lse log2(e) (the
    saved lse in the log2 domain, +inf for an empty or padded row, so p = exp2(s log2(e) - lse2) = 0
    there) and delta = rowsum(dO * O) - dlse (0 for a padded head). -> (lse2, delta), each [BLOCK_H] fp32."""
    stat = b * stride_lb + t * stride_lt + offs_h
    lse = tl.load(LSE + stat, mask=mask_h, other=float("-inf"))
    delta = tl.load(DELTA + stat, mask=mask_h, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    return lse2, delta


@triton.jit
def _sparse_mla_bwd_kernel(
    Q, KV, IDX, NSLOT, DO, LSE, DELTA, DQ, DKV,
    stride_qb, stride_qt, stride_qh,
    stride_kvb, stride_kvt,
    stride_ib, stride_it,
    stride_nb,
    stride_dob, stride_dot, stride_doh,
    stride_lb, stride_lt,
    stride_dqb, stride_dqt, stride_dqh,
    stride_dkb, stride_dkt, stride_sh, stride_sk,
    H, N_HB, N_KV, T0, K_LO, K_HI, scale, scale_log2,
    D_V: tl.constexpr, D_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
    BLOCK_D: tl.constexpr, SPLIT: tl.constexpr, DETERMINISTIC: tl.constexpr,
):
    # This launch covers tokens [T0, T0 + C) (C = grid x / parts) and slots [K_LO, K_HI) of each row.
    # DETERMINISTIC=False: DQ = dq [B, T, H, D] (q's dtype, written once), DKV = dkv [B, N, D]
    #   fp32, zeroed, receiving relaxed atomic adds at the selected rows.
    # DETERMINISTIC=True: DQ = an fp32 accumulator [B, C, H, D] of the token chunk (read,
    #   added to, written back: each address is owned by one program, windows launch in order),
    #   DKV = the stage [head blocks, B, C, K_HI - K_LO, D] fp32 (strides sh, dkb, dkt, sk):
    #   each (head block, token, slot)'s contribution stored at its own address.
    # program (x, y) -> (token, head block, column part), the part fastest, then the head block; y = b
    pid = tl.program_id(0)
    part = pid % SPLIT
    hb = (pid // SPLIT) % N_HB
    tc = (pid // (SPLIT * N_HB)).to(tl.int64)  # token within this launch's chunk
    b = tl.program_id(1).to(tl.int64)
    t = T0 + tc
    DVS: tl.constexpr = BLOCK_DV // SPLIT  # latent columns of dq / dkv owned by this program
    DVH: tl.constexpr = DVS // 2  # ... handled as two halves (a, b): see the dkv products below
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_a = part * DVS + tl.arange(0, DVH)
    offs_b = offs_a + DVH
    mask_a = offs_a < D_V
    mask_b = offs_b < D_V
    offs_dr = tl.arange(0, BLOCK_DR)
    mask_dr = offs_dr < D_R
    offs_d = tl.arange(0, BLOCK_D)
    mrh = mask_h[:, None] & mask_dr[None, :]

    q_rows = Q + b * stride_qb + t * stride_qt + offs_h[:, None] * stride_qh
    do_rows = DO + b * stride_dob + t * stride_dot + offs_h[:, None] * stride_doh
    q_a = tl.load(q_rows + offs_a[None, :], mask=mask_h[:, None] & mask_a[None, :], other=0.0)  # [BLOCK_H, DVH]
    q_b = tl.load(q_rows + offs_b[None, :], mask=mask_h[:, None] & mask_b[None, :], other=0.0)
    do_a = tl.load(do_rows + offs_a[None, :], mask=mask_h[:, None] & mask_a[None, :], other=0.0)
    do_b = tl.load(do_rows + offs_b[None, :], mask=mask_h[:, None] & mask_b[None, :], other=0.0)
    qr = tl.load(q_rows + D_V + offs_dr[None, :], mask=mrh, other=0.0)
    lse2, delta = _bwd_row_stats(LSE, DELTA, b, t, offs_h, mask_h, stride_lb, stride_lt)

    dq_a = tl.zeros([BLOCK_H, DVH], dtype=tl.float32)
    dq_b = tl.zeros([BLOCK_H, DVH], dtype=tl.float32)
    dq_r = tl.zeros([BLOCK_H, BLOCK_DR], dtype=tl.float32)
    kv_base = KV + b * stride_kvb
    idx_base = IDX + b * stride_ib + t * stride_it
    k_end = tl.minimum(tl.load(NSLOT + b * stride_nb + t), K_HI)
    for k0 in range(K_LO, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(idx_base + offs_k, mask=offs_k < k_end, other=-1)
        valid = (idx >= 0) & (idx < N_KV)  # out of range = empty slot
        rows = kv_base + tl.where(valid, idx, 0).to(tl.int64)[:, None] * stride_kvt
        # logits and dP = dO V^T over all latent dims, in BLOCK_D-channel pieces
        s = tl.zeros([BLOCK_H, BLOCK_K], dtype=tl.float32)
        dp = tl.zeros([BLOCK_H, BLOCK_K], dtype=tl.float32)
        for d0 in range(0, BLOCK_DV, BLOCK_D):
            dm = (d0 + offs_d) < D_V
            kvd = tl.load(rows + d0 + offs_d[None, :], mask=valid[:, None] & dm[None, :], other=0.0)
            qd = tl.load(q_rows + d0 + offs_d[None, :], mask=mask_h[:, None] & dm[None, :], other=0.0)
            dod = tl.load(do_rows + d0 + offs_d[None, :], mask=mask_h[:, None] & dm[None, :], other=0.0)
            s += tl.dot(qd, tl.trans(kvd))
            dp += tl.dot(dod, tl.trans(kvd))
        kvr = tl.load(rows + D_V + offs_dr[None, :], mask=valid[:, None] & mask_dr[None, :], other=0.0)
        s += tl.dot(qr, tl.trans(kvr))
        p = tl.exp2(s * scale_log2 - lse2[:, None])
        p = tl.where(valid[None, :], p, 0.0)
        ds = p * (dp - delta[:, None]) * scale  # d loss / d (q . kv)
        ds_c = ds.to(q_a.dtype)
        p_c = p.to(do_a.dtype)
        if DETERMINISTIC:  # this (head block, token, slot)'s own row of the stage
            drows = DKV + hb * stride_sh + b * stride_dkb + tc * stride_dkt + ((offs_k - K_LO) * stride_sk)[:, None]
        else:  # the selected rows of dkv
            drows = DKV + b * stride_dkb + tl.where(valid, idx, 0).to(tl.int64)[:, None] * stride_dkt
        # dq += dS kv and dkv[idx] += dS^T q + p^T dO, one column half at a time: the [BLOCK_K, DVH]
        # products (and their q / dO operands) of one half are dead before the other's start
        kv_a = tl.load(rows + offs_a[None, :], mask=valid[:, None] & mask_a[None, :], other=0.0)
        dq_a += tl.dot(ds_c, kv_a)
        dkv_a = tl.dot(tl.trans(ds_c), q_a) + tl.dot(tl.trans(p_c), do_a)  # [BLOCK_K, DVH]
        _scatter(drows + offs_a[None, :], dkv_a, valid[:, None] & mask_a[None, :], DETERMINISTIC)
        kv_b = tl.load(rows + offs_b[None, :], mask=valid[:, None] & mask_b[None, :], other=0.0)
        dq_b += tl.dot(ds_c, kv_b)
        dkv_b = tl.dot(tl.trans(ds_c), q_b) + tl.dot(tl.trans(p_c), do_b)
        _scatter(drows + offs_b[None, :], dkv_b, valid[:, None] & mask_b[None, :], DETERMINISTIC)
        if part == 0:
            dq_r += tl.dot(ds_c, kvr)
            dkv_r = tl.dot(tl.trans(ds_c), qr)
            _scatter(drows + D_V + offs_dr[None, :], dkv_r, valid[:, None] & mask_dr[None, :], DETERMINISTIC)

    dq_tok = tc if DETERMINISTIC else t
    dq_rows = DQ + b * stride_dqb + dq_tok * stride_dqt + offs_h[:, None] * stride_dqh
    _store_dq(dq_rows + offs_a[None, :], dq_a, mask_h[:, None] & mask_a[None, :], DETERMINISTIC)
    _store_dq(dq_rows + offs_b[None, :], dq_b, mask_h[:, None] & mask_b[None, :], DETERMINISTIC)
    if part == 0:
        _store_dq(dq_rows + D_V + offs_dr[None, :], dq_r, mrh, DETERMINISTIC)


@triton.jit
def _sparse_mla_bwd_interleaved_kernel(
    Q, KV, IDX, NSLOT, DO, LSE, DELTA, DQ, DKV,
    stride_qb, stride_qt, stride_qh,
    stride_kvb, stride_kvt,
    stride_ib, stride_it,
    stride_nb,
    stride_dob, stride_dot, stride_doh,
    stride_lb, stride_lt,
    stride_dqb, stride_dqt, stride_dqh,
    stride_dkb, stride_dkt,
    H, N_HB, N_KV, scale, scale_log2,
    D_V: tl.constexpr, D_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
    EVEN_H: tl.constexpr,
):
    # The atomic backward on TileLang's schedule, in Triton's terms (DETERMINISTIC=False's contract:
    # dq [B, T, H, D] written once, dkv [B, N, D] fp32 zeroed, receiving relaxed atomic adds):
    # - one program per (token, head block of BLOCK_H = 32); q and dO read once and resident in one
    #   operand X [2 BLOCK_H, D] whose rows interleave them in groups of 16: rows 16g .. 16g + 7
    #   are q of heads 8g .. 8g + 7, rows 16g + 8 .. 16g + 15 dO of the same heads (zeros in the
    #   rope columns). 64 rows: the logits' M is 64 (wgmma) with the keys on N, so the key tiles
    #   stay small (32 keys: 36 KB a stage) and nothing spills;
    # - per key tile the selected rows are gathered once (four 128-column latent quarters + rope);
    #   [S | dP] = X kv^T sums one product per quarter ([2 BLOCK_H, BLOCK_K]); in wgmma's
    #   accumulator layout a thread holds rows r and r + 8, so S and dP of a head are in the same
    #   thread and the split (and the join back) moves no data;
    # - P from the saved lse, dS = P (dP - delta) scale (eq. of the forward's softmax);
    # - per quarter dkv^T = X^T [dS | P] (= q^T dS + dO^T P, one product, M = 128 columns: the two
    #   warp groups take 64 each), added at the selected rows by vectorized fp32 atomics;
    #   dq^T += kv^T dS^T ([576, BLOCK_H] fp32 accumulators: 72 registers a thread at 8 warps).
    # Nothing is recomputed; the gathered rows are read once per 32 heads (9.4 MB per token at
    # the 671B shapes, TileLang's 64-head blocks read 4.7 MB). 32-key tiles x 2 stages pass the
    # compile gate under Triton 3.6 and 3.9 (docs/kernels.md "Backward v2").
    pid = tl.program_id(0)
    hb = pid % N_HB
    t = (pid // N_HB).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = (offs_h < H) | EVEN_H
    BLOCK_C: tl.constexpr = BLOCK_DV // 4
    offs_c = tl.arange(0, BLOCK_C)
    m0 = offs_c < D_V
    m1 = BLOCK_C + offs_c < D_V
    m2 = 2 * BLOCK_C + offs_c < D_V
    m3 = 3 * BLOCK_C + offs_c < D_V
    offs_r = tl.arange(0, BLOCK_DR)
    mr = offs_r < D_R
    # X's rows (see above): row j holds head 8 (j // 16) + j % 8, q if j % 16 < 8 else dO
    offs_j = tl.arange(0, 2 * BLOCK_H)
    head_j = hb * BLOCK_H + (offs_j // 16) * 8 + offs_j % 8
    is_q = (offs_j % 16) < 8
    mask_j = ((head_j < H) | EVEN_H)[:, None]
    q_j = Q + b * stride_qb + t * stride_qt + head_j[:, None] * stride_qh
    do_j = DO + b * stride_dob + t * stride_dot + head_j[:, None] * stride_doh
    qd_j = tl.where(is_q[:, None], q_j, do_j)
    x0 = tl.load(qd_j + offs_c[None, :], mask=mask_j & m0[None, :], other=0.0)  # [2 BLOCK_H, BLOCK_C]
    x1 = tl.load(qd_j + BLOCK_C + offs_c[None, :], mask=mask_j & m1[None, :], other=0.0)
    x2 = tl.load(qd_j + 2 * BLOCK_C + offs_c[None, :], mask=mask_j & m2[None, :], other=0.0)
    x3 = tl.load(qd_j + 3 * BLOCK_C + offs_c[None, :], mask=mask_j & m3[None, :], other=0.0)
    xr = tl.load(q_j + D_V + offs_r[None, :], mask=mask_j & is_q[:, None] & mr[None, :], other=0.0)
    lse2, delta = _bwd_row_stats(LSE, DELTA, b, t, offs_h, mask_h, stride_lb, stride_lt)

    dq0 = tl.zeros([BLOCK_C, BLOCK_H], dtype=tl.float32)  # dq^T by quarter [128 columns, heads]
    dq1 = tl.zeros([BLOCK_C, BLOCK_H], dtype=tl.float32)
    dq2 = tl.zeros([BLOCK_C, BLOCK_H], dtype=tl.float32)
    dq3 = tl.zeros([BLOCK_C, BLOCK_H], dtype=tl.float32)
    dqr = tl.zeros([BLOCK_DR, BLOCK_H], dtype=tl.float32)
    kv_base = KV + b * stride_kvb
    idx_base = IDX + b * stride_ib + t * stride_it
    k_end = tl.load(NSLOT + b * stride_nb + t)
    for k0 in range(0, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(idx_base + offs_k, mask=offs_k < k_end, other=-1)
        valid = (idx >= 0) & (idx < N_KV)  # out of range = empty slot
        vk = valid[:, None]
        rows = kv_base + (tl.where(valid, idx, 0) * stride_kvt)[:, None]  # int32 offsets (checked)
        kv0 = tl.load(rows + offs_c[None, :], mask=vk & m0[None, :], other=0.0)  # [BLOCK_K, BLOCK_C]
        kv1 = tl.load(rows + BLOCK_C + offs_c[None, :], mask=vk & m1[None, :], other=0.0)
        kv2 = tl.load(rows + 2 * BLOCK_C + offs_c[None, :], mask=vk & m2[None, :], other=0.0)
        kv3 = tl.load(rows + 3 * BLOCK_C + offs_c[None, :], mask=vk & m3[None, :], other=0.0)
        kvr = tl.load(rows + D_V + offs_r[None, :], mask=vk & mr[None, :], other=0.0)
        sdp = tl.dot(x0, tl.trans(kv0))  # [2 BLOCK_H, BLOCK_K]: S rows and dP rows as X's
        sdp += tl.dot(x1, tl.trans(kv1))
        sdp += tl.dot(x2, tl.trans(kv2))
        sdp += tl.dot(x3, tl.trans(kv3))
        sdp += tl.dot(xr, tl.trans(kvr))
        # rows (g, q / dO, i) -> S and dP of head 8g + i, each [BLOCK_H, BLOCK_K]
        s, dp = tl.split(tl.permute(tl.reshape(sdp, [BLOCK_H // 8, 2, 8, BLOCK_K]), (0, 2, 3, 1)))
        s = tl.reshape(s, [BLOCK_H, BLOCK_K])
        dp = tl.reshape(dp, [BLOCK_H, BLOCK_K])
        p = tl.where(valid[None, :], tl.exp2(s * scale_log2 - lse2[:, None]), 0.0)
        ds = p * (dp - delta[:, None]) * scale  # d loss / d (q . kv)
        ds_t = tl.trans(ds.to(x0.dtype))  # [BLOCK_K, BLOCK_H]
        # [dS | P] with X's row order: row (g, 0, i) = dS of head 8g + i, (g, 1, i) = its P
        dsp = tl.join(tl.reshape(ds, [BLOCK_H // 8, 8, BLOCK_K]), tl.reshape(p, [BLOCK_H // 8, 8, BLOCK_K]))
        dsp = tl.reshape(tl.permute(dsp, (0, 3, 1, 2)), [2 * BLOCK_H, BLOCK_K]).to(x0.dtype)
        drows = (DKV + b * stride_dkb + tl.where(valid, idx, 0).to(tl.int64) * stride_dkt)[None, :]
        vkt = valid[None, :]
        # per quarter: dkv[idx]^T += q^T dS + dO^T P (one product), dq^T += kv^T dS^T
        tl.atomic_add(drows + offs_c[:, None], tl.dot(tl.trans(x0), dsp), mask=vkt & m0[:, None], sem="relaxed")
        dq0 += tl.dot(tl.trans(kv0), ds_t)
        tl.atomic_add(drows + BLOCK_C + offs_c[:, None], tl.dot(tl.trans(x1), dsp), mask=vkt & m1[:, None], sem="relaxed")
        dq1 += tl.dot(tl.trans(kv1), ds_t)
        tl.atomic_add(drows + 2 * BLOCK_C + offs_c[:, None], tl.dot(tl.trans(x2), dsp), mask=vkt & m2[:, None], sem="relaxed")
        dq2 += tl.dot(tl.trans(kv2), ds_t)
        tl.atomic_add(drows + 3 * BLOCK_C + offs_c[:, None], tl.dot(tl.trans(x3), dsp), mask=vkt & m3[:, None], sem="relaxed")
        dq3 += tl.dot(tl.trans(kv3), ds_t)
        tl.atomic_add(drows + D_V + offs_r[:, None], tl.dot(tl.trans(xr), dsp), mask=vkt & mr[:, None], sem="relaxed")
        dqr += tl.dot(tl.trans(kvr), ds_t)

    # dq^T [columns, heads] -> dq[b, t, head, column]
    dq_rows = DQ + b * stride_dqb + t * stride_dqt + offs_h[None, :] * stride_dqh
    hm = mask_h[None, :]
    out_ty = DQ.dtype.element_ty
    tl.store(dq_rows + offs_c[:, None], dq0.to(out_ty), mask=m0[:, None] & hm)
    tl.store(dq_rows + BLOCK_C + offs_c[:, None], dq1.to(out_ty), mask=m1[:, None] & hm)
    tl.store(dq_rows + 2 * BLOCK_C + offs_c[:, None], dq2.to(out_ty), mask=m2[:, None] & hm)
    tl.store(dq_rows + 3 * BLOCK_C + offs_c[:, None], dq3.to(out_ty), mask=m3[:, None] & hm)
    tl.store(dq_rows + D_V + offs_r[:, None], dqr.to(out_ty), mask=mr[:, None] & hm)


@triton.jit
def _scatter(ptrs, val, mask, DETERMINISTIC: tl.constexpr):
    """dkv contributions: deterministic -> plain stores into the stage (one writer per address);
    else relaxed fp32 atomic adds into dkv (a key row is selected by many queries)."""
    if DETERMINISTIC:
        tl.store(ptrs, val, mask=mask)
    else:
        tl.atomic_add(ptrs, val, mask=mask, sem="relaxed")


@triton.jit
def _store_dq(ptrs, val, mask, DETERMINISTIC: tl.constexpr):
    """dq: written once (q's dtype); deterministic -> added to the chunk's fp32 accumulator (what
    the earlier slot windows left; this program is the only one touching these addresses)."""
    if DETERMINISTIC:
        val += tl.load(ptrs, mask=mask, other=0.0)
    tl.store(ptrs, val.to(ptrs.dtype.element_ty), mask=mask)


SLOT_COUNT_CHUNK_ELEMS = 1 << 26  # index elements per token chunk of `slot_counts` (its temporaries)


def slot_counts(indices: torch.Tensor, n_keys: int | None = None) -> torch.Tensor:
    """[B, T, K] int -> [B, T] int32: 1 + the position of each row's last valid slot (0 if none).
    Valid: idx >= 0, and idx < n_keys when n_keys is given (the kernels' rule: out of range =
    empty). The kernels walk only these slots: a short row's empty tail costs nothing.
    Token chunk by chunk, so its [C, K] temporaries stay bounded (not [T, K] int32: 1 GB at 128K)."""
    B, T, K = indices.shape
    counts = torch.zeros((B, T), dtype=torch.int32, device=indices.device)
    if K == 0:
        return counts
    pos = torch.arange(1, K + 1, device=indices.device, dtype=torch.int32)
    chunk = max(1, SLOT_COUNT_CHUNK_ELEMS // max(B * K, 1))
    for t0 in range(0, T, chunk):
        sel = indices[:, t0:t0 + chunk]
        valid = sel >= 0
        if n_keys is not None:
            valid &= sel < n_keys
        counts[:, t0:t0 + chunk] = torch.where(valid, pos, 0).amax(dim=-1)
    return counts


def fwd_blocks(H: int, D_V: int, D_R: int, capability: int = 90, block_k: int = 16) -> dict:
    """One program per (token, head block of up to 64[, value part]): the logits once per program,
    the value in four column quarters (so BLOCK_DV >= 64: quarters of >= 16, tl.dot's minimum).
    Key tiles (`block_k`, from the autotuning space): at the 671B shapes, sm_90a, Triton 3.9: 16 keys
    248 registers, no spill (32 keys: 255 + 216 B spill); Triton 3.6: 198 at 16 keys, 226 at 32
    (its default there: 1.55x faster on an H200). On sm_100 (capability >= 100) the value
    is split across two programs (VALUE_SPLIT = 2): Triton keeps tcgen05 accumulators in tensor
    memory (512 fp32 columns per SM), which four [64, 128] accumulators plus the logits overflow
    (Triton 3.9 then compiles the kernel to a lone `trap`). `dsa-train kernels report` shows the
    current figures."""
    block_h = min(pow2(H), 64)
    return dict(BLOCK_H=block_h, BLOCK_K=block_k, BLOCK_DV=pow2(D_V, 64), BLOCK_DR=pow2(max(D_R, 1)),
                EVEN_H=H % block_h == 0, VALUE_SPLIT=2 if capability >= 100 else 1)


# The forward's autotuning space (`dsa_kernels.autotune`), per architecture: (name, key tile,
# pipeline stages), the first the default. Every config passes the compile gate at the 671B shapes
# (the registry compiles each one): sm_90a under Triton 3.6 and 3.9, sm_100 under 3.9. Under Triton
# 3.6 (torch 2.11's) Hopper takes 32-key tiles: 226 / 232 registers (2 / 3 stages), no spill, and
# measured on an H200 (T = 32K, k = 2048; docs/kernels.md "Measured on a GPU") 99 / 97 ms against
# 154 ms for 16-key tiles. Triton 3.9 spills at 32 keys (255 registers + 216 B), so its Hopper
# space keeps 16-key tiles.
FWD_CONFIG_SPACE = {
    90: (("k16-s2", 16, 2), ("k16-s3", 16, 3)),
    100: (("k16-s2", 16, 2), ("k32-s2", 32, 2)),
}
FWD_CONFIG_SPACE_TRITON_36 = {90: (("k32-s2", 32, 2), ("k32-s3", 32, 3))}


def fwd_config_space(capability: int, triton_version: str | None = None) -> tuple:
    """The configs `sparse_mla_fwd` times on a GPU of this compute capability (Hopper's below 100)
    with this Triton (default: the installed one)."""
    return _config_space(capability, triton_version, FWD_CONFIG_SPACE, FWD_CONFIG_SPACE_TRITON_36,
                         FWD_GLUON_CONFIGS, FWD_GLUON_CONFIGS_TRITON_36)


def _config_space(capability: int, triton_version: str | None, space_by_arch: dict, space_by_arch_36: dict,
                  gluon: tuple, gluon_36: tuple) -> tuple:
    """An autotuning space for this compute capability (Hopper's below 100) and Triton (default: the
    installed one): the arch's Triton configs (`space_by_arch_36`'s under Triton 3.6 where it has the
    arch), then on sm_90 the Gluon configs (`gluon_36` under 3.6; wgmma, sm_90a only: never the default)."""
    arch = 100 if capability >= 100 else 90
    version = triton.__version__ if triton_version is None else triton_version
    if version.startswith("3.6.") and arch in space_by_arch_36:
        space = space_by_arch_36[arch]
    else:
        space = space_by_arch[arch]
    if capability == 90:
        space = space + (gluon_36 if version.startswith("3.6.") else gluon)
    return space


# The Gluon forward (`gluon_fwd.py`, FlashMLA's schedule: a cp.async producer warp group, two wgmma
# consumer warp groups) as configs of the sm_90 space: (name, key tile, ring stages). "gluon": each
# tile's PV wgmma waited for at the tile's end; "gluon-pv": left in flight under the next tile's
# logits (no spill under Triton 3.6 only: 3.9 spills 120 B, so 3.9's space leaves it out). Both
# rescale O on every tile with FlashAttention-3's stale max (the per-CTA skip branch spilled 80 B
# under 3.6). A call the kernel does not take (`gluon_fwd.gluon_fwd_supported`: H % 64, d_v, rope
# 64, 16-bit) drops them from its space; on a GPU each is verified against the default before it is
# timed (`sparse_mla_fwd`).
FWD_GLUON_CONFIGS = (("gluon", 64, 2),)
FWD_GLUON_CONFIGS_TRITON_36 = (("gluon", 64, 2), ("gluon-pv", 64, 2))


def is_gluon_config(config: tuple) -> bool:
    return config[0].startswith("gluon")


def bwd_blocks(H: int, D_V: int, D_R: int) -> dict:
    block_dv = pow2(D_V, 32)  # a program's columns come in two halves of >= 16 (tl.dot's minimum)
    # 16-key tiles: with 32 the backward spilled under Triton 3.6 for sm_90a (268 B with the
    # 0 <= idx < N mask). At 16 keys, sm_90a: 246 registers (3.9), 255 (3.6, no headroom), 0 spill.
    # If a change makes it spill, num_stages=1 gave 226 / 220 (loses the d-loop's prefetch).
    return dict(BLOCK_H=min(pow2(H), 64), BLOCK_K=16, BLOCK_DV=block_dv,
                BLOCK_DR=pow2(max(D_R, 1)), BLOCK_D=min(block_dv, 64), SPLIT=2 if block_dv >= 512 else 1)


# The atomic backward's autotuning space (`dsa_kernels.autotune`), per architecture: (name, schedule,
# keys per tile, stages), the first the default. "split": `_sparse_mla_bwd_kernel` (measured on an
# H200: 712 ms at T = 32K, k = 2048). "interleaved": `_sparse_mla_bwd_interleaved_kernel` at 32-key
# tiles and 2 stages (32 heads a program): only wgmma, nothing recomputed, 9.75 MB read per token
# (the split kernel: 81 MB), no spill under Triton 3.6 or 3.9 (sm_100: tcgen05.mma, no spill);
# not yet timed on a GPU, so a GPU decides (docs/kernels.md "Backward v2").
BWD_CONFIG_SPACE = {
    90: (("split-k16", "split", None, None), ("interleaved-h32-k32-s2", "interleaved", 32, 2)),
    100: (("split-k16", "split", None, None), ("interleaved-h32-k32-s2", "interleaved", 32, 2)),
}
# Under Triton 3.6 (the GPU image's) Hopper's space also holds the split kernel at 32-key tiles and 3
# stages: measured on an H200 at 478 ms against the 16-key default's 709-727 ms (96 vs 64 TFLOPS,
# docs/kernels.md "Measured on a GPU"), it spills 46 B there (255 registers). The compile gate allows
# that spill for this config alone (`compile_report.ALLOWED_SPILLS`, with the measurement); its
# output is verified against the default's before it is timed, like every config.
BWD_CONFIG_SPACE_TRITON_36 = {90: BWD_CONFIG_SPACE[90] + (("split-k32-s3", "split", 32, 3),)}


# The Gluon backward (`gluon_bwd.py`, issue 31: q / dO resident in shared memory, a cp.async producer
# warp group, two wgmma consumer warp groups, dq in registers, dkv^T by fp32 atomics; 64 heads a CTA)
# as configs of sm_90's atomic space: (name, "gluon", keys per tile, ring stages), after the Triton
# configs, never the default; the name's "-c64" / "-c128" is the columns of one dkv^T product
# (`gluon_bwd.DKV_CHUNK`), a final "-p" pipelines the dkv products (chunk c + 1's wgmma in flight while
# chunk c's atomics issue, the first chunk under dq's wait: `PIPELINE_DKV`). "gluon-k32-c64" and
# "gluon-k32-c64-p" compile without spill under Triton 3.6 and 3.9; "gluon-k32-c128" (each warp group
# reads only its half of q^T / dO^T for dkv) only under 3.6 (3.9 spills 48 B), so 3.9's space leaves it out.
# A final "-v2" / "-v4" is "gluon-k32-c64" with dkv added by vector reductions (`red.global.add.v2 / .v4.f32`,
# `gluon_bwd.DKV_VEC`: half / a quarter of the reduction instructions, the accumulator moved within each
# warp first), no spill under either Triton. Unmeasured on a GPU: on a GPU each is verified against
# the default before it is timed (`sparse_mla_bwd`); a call the kernel does not take
# (`gluon_bwd.gluon_bwd_supported`) or DSA_KERNELS_GLUON=0 drops them (`bwd_space_for`).
BWD_GLUON_CONFIGS = (("gluon-k32-c64", "gluon", 32, 2), ("gluon-k32-c64-p", "gluon", 32, 2),
                     ("gluon-k32-c64-v2", "gluon", 32, 2), ("gluon-k32-c64-v4", "gluon", 32, 2))
BWD_GLUON_CONFIGS_TRITON_36 = BWD_GLUON_CONFIGS + (("gluon-k32-c128", "gluon", 32, 2),)


def bwd_config_space(capability: int, triton_version: str | None = None) -> tuple:
    """The atomic backward's configs `sparse_mla_bwd` times on a GPU of this compute capability
    with this Triton (default: the installed one); on sm_90 the Gluon configs follow the Triton ones."""
    return _config_space(capability, triton_version, BWD_CONFIG_SPACE, BWD_CONFIG_SPACE_TRITON_36,
                         BWD_GLUON_CONFIGS, BWD_GLUON_CONFIGS_TRITON_36)


def bwd_space_for(q, kv, d_v: int, unmeasured: bool = False) -> dict:
    """{name: config} of the atomic backward's space for this call: `bwd_config_space` of the GPU's
    capability, less the Gluon configs where that kernel does not take the call, DSA_KERNELS_GLUON=0,
    or, until a GPU has run them, without DSA_KERNELS_GLUON_BWD=1 (`gluon_bwd_enabled`).
    `unmeasured=True` keeps them regardless of that opt-in (a forced config; gpu-check's checks)."""
    cap = target_capability(q)
    space = {cfg[0]: cfg for cfg in bwd_config_space(cap)}
    if any(is_gluon_config(c) for c in space.values()):
        from .gluon_bwd import gluon_bwd_supported

        opted_in = gluon_bwd_enabled() or unmeasured
        if not gluon_enabled() or not opted_in or gluon_bwd_supported(q, kv, d_v, cap) is not None:
            space = {n: c for n, c in space.items() if not is_gluon_config(c)}
    return space


def gluon_bwd_enabled() -> bool:
    """The Gluon backward's configs join sm_90's autotuned backward space only with
    DSA_KERNELS_GLUON_BWD=1, until a GPU session has run them: the autotuner's verification catches
    a wrong result, not a hang (a producer / consumer handshake that deadlocks), and no GPU has run
    this kernel yet (the Gluon forward was opt-in the same way until GPU session 2 measured it).
    Forcing one (`force_bwd_config`, DSA_SPARSE_MLA_BWD_CONFIG) and gpu-check's correctness checks
    run them without the opt-in."""
    return env_flag("DSA_KERNELS_GLUON_BWD", "0")


_FORCED_BWD: contextvars.ContextVar[str | None] = contextvars.ContextVar("dsa_sparse_mla_bwd_config", default=None)


def forced_bwd_config() -> str | None:
    """The atomic backward config forced by `force_bwd_config` or DSA_SPARSE_MLA_BWD_CONFIG (a name of
    the backward's space, e.g. "gluon-k32-c64"): it runs untimed and unverified (gpu-check's Gluon
    checks compare it with the reference themselves). None: the autotuner chooses. The deterministic
    mode (torch.use_deterministic_algorithms) ignores it: it has its own kernel."""
    return _forced_config(_FORCED_BWD, "DSA_SPARSE_MLA_BWD_CONFIG")


def force_bwd_config(name: str | None):
    """Context manager: the atomic backward runs config `name` (None: the autotuner chooses)."""
    return _forcing_config(_FORCED_BWD, name)


def _forced_config(forced: contextvars.ContextVar, env: str) -> str | None:
    """The config name set in `forced` (by a `force_*_config` block), else environment variable `env`; None if neither."""
    return forced.get() or os.environ.get(env) or None


@contextlib.contextmanager
def _forcing_config(forced: contextvars.ContextVar, name: str | None):
    token = forced.set(name)
    try:
        yield
    finally:
        forced.reset(token)


def plan_bwd_config(config: tuple, q, kv, indices, n_slots, dout, lse, delta, dq, dkv, scale: float,
                    d_v: int) -> Launch:
    """The atomic backward's launch for one config of `bwd_config_space`."""
    name, schedule, block_k, stages = config
    if schedule == "gluon":
        from .gluon_bwd import BLOCK_H as GLUON_BLOCK_H, plan_bwd_gluon

        B, T, H, _ = q.shape
        _int32_rows(kv, "backward (Gluon)")
        _int32_rows(dkv, "backward (Gluon)")
        grid = _grid(triton.cdiv(H, GLUON_BLOCK_H) * T, B, "backward (Gluon)")
        return plan_bwd_gluon(q, kv, indices, n_slots, dout, lse, delta, dq, dkv, scale, d_v, grid,
                              block_k=block_k, stages=stages, dkv_chunk=128 if "-c128" in name else 64,
                              pipeline_dkv="p" in name.split("-")[3:],
                              dkv_vec=4 if name.endswith("-v4") else 2 if name.endswith("-v2") else 1)
    if schedule == "split":
        return plan_bwd(q, kv, indices, n_slots, dout, lse, delta, dq, dkv, scale, d_v, block_k=block_k,
                        num_stages=stages)
    return plan_bwd_interleaved(q, kv, indices, n_slots, dout, lse, delta, dq, dkv, scale, d_v,
                                block_k=block_k, num_stages=stages)


# A config whose dkv or dq differs from the default's by more than this (max |a - b| / max |b|, both
# fp32 sums of the same products in another order) on the first call is left out of the timing.
# dq is compared on about BWD_VERIFY_DQ_TOKENS tokens spread over the sequence (every H and column:
# 75 MB of fp32 at the 671B shapes, where the whole dq would be 4.8 GB).
BWD_VERIFY_TOL = 1e-3
BWD_VERIFY_DQ_TOKENS = 256


def _close(got: torch.Tensor, ref: torch.Tensor) -> bool:
    return bool((got - ref).abs().max() <= BWD_VERIFY_TOL * ref.abs().max().clamp_min(1e-30))


def _grid(x: int, y: int, what: str) -> tuple:
    """(x, y) grid: x = tokens x head blocks x parts (CUDA allows 2^31 - 1), y = batch (65,535)."""
    if x > GRID_X_MAX or y > GRID_YZ_MAX:
        raise ValueError(f"sparse_mla {what}: grid ({x}, {y}) exceeds CUDA's limits (x <= 2^31 - 1, y <= 65535); "
                         f"split the call into fewer tokens or a smaller batch")
    return (max(x, 1), max(y, 1))


def _int32_rows(kv, what: str) -> None:
    """The kernels form gathered row offsets as idx * stride in int32: the largest must fit."""
    if kv.shape[1] * kv.stride(1) >= 2**31:
        raise ValueError(f"sparse_mla {what}: kv has {kv.shape[1]} rows of stride {kv.stride(1)}; row offsets "
                         f"beyond 2^31 elements are not supported: split the batch or the sequence")


def plan_fwd(q, kv, indices, n_slots, out, lse, scale: float, d_v: int, config: tuple | None = None,
             p_sum: torch.Tensor | None = None) -> Launch:
    """The forward launch for q [B, T, H, D], kv [B, N, D], indices [B, T, K] int32, n_slots
    [B, T] int32 (`slot_counts`), out [B, T, H, d_v], lse [B, T, H] fp32; `config`: one of
    `fwd_config_space` (default: its first). p_sum [B, T, K] fp32, zeroed (Triton configs only):
    also the sparse KL's target Sigma_h P per slot (`TARGET`, a second walk over the slots)."""
    B, T, H, D = q.shape
    cap = target_capability(q)
    if config is not None and is_gluon_config(config):
        if p_sum is not None:
            raise ValueError(f"sparse_mla forward: config {config[0]} (Gluon) does not emit the KL target; "
                             f"plan a Triton config, or form the target with indexer_kl's target kernel")
        from .gluon_fwd import BLOCK_H as GLUON_BLOCK_H, plan_fwd_gluon

        _int32_rows(kv, "forward (Gluon)")
        grid = _grid(triton.cdiv(H, GLUON_BLOCK_H) * T, B, "forward (Gluon)")
        return plan_fwd_gluon(q, kv, indices, n_slots, out, lse, scale, d_v, grid, pipeline_pv=config[0] == "gluon-pv")
    _, block_k, stages = config or fwd_config_space(cap)[0]
    blocks = fwd_blocks(H, d_v, D - d_v, cap, block_k)
    n_hb = triton.cdiv(H, blocks["BLOCK_H"])
    _int32_rows(kv, "forward")
    return Launch(
        _sparse_mla_fwd_kernel, _grid(n_hb * blocks["VALUE_SPLIT"] * T, B, "forward"),
        dict(
            **_fwd_args(q, kv, indices, n_slots, out, lse), P_SUM=lse if p_sum is None else p_sum,
            stride_pb=0 if p_sum is None else p_sum.stride(0), stride_pt=0 if p_sum is None else p_sum.stride(1),
            H=H, N_KV=kv.shape[1], N_HB=n_hb, scale_log2=scale * LOG2E,
            D_V=d_v, D_R=D - d_v, **blocks, TARGET=p_sum is not None,
        ),
        # two stages: the 16-key tile of 576 dims (18 KB) double-buffered beside q (72 KB): 110 KB
        # (32 keys: 147 KB; three stages of 32: 184 KB, within Hopper's 227 KB)
        num_warps=8 if blocks["BLOCK_DV"] >= 256 else 4, num_stages=stages,
    )


def plan_bwd(q, kv, indices, n_slots, dout, lse, delta, dq, dkv, scale: float, d_v: int,
             t0: int = 0, n_tokens: int | None = None, k_lo: int = 0, k_hi: int | None = None,
             stage=None, block_k: int | None = None, num_stages: int | None = None) -> Launch:
    """The backward launch for tokens [t0, t0 + n_tokens) and slots [k_lo, k_hi).
    block_k / num_stages (atomic launches only, a config of `bwd_config_space`): the key tile and
    the pipeline stages instead of `bwd_blocks`' 16 keys and Triton's default stages.
    Atomic (stage None): dq [B, T, H, D] (q's dtype), dkv [B, N, D] fp32 zeroed.
    Deterministic: dq = the chunk's fp32 accumulator [B, >= n_tokens, H, D], and
    stage [head blocks, B, n_tokens, k_hi - k_lo, D] fp32 receiving every (head block, token,
    slot)'s dkv contribution (dkv is not touched)."""
    B, T, H, D = q.shape
    det = stage is not None
    n_tok = T - t0 if n_tokens is None else n_tokens
    k_hi = indices.shape[-1] if k_hi is None else k_hi
    blocks = bwd_blocks(H, d_v, D - d_v)
    if (block_k is not None or num_stages is not None) and det:
        raise ValueError("block_k / num_stages are configs of the atomic backward, not the deterministic one")
    if block_k is not None:
        blocks["BLOCK_K"] = block_k
    n_parts = triton.cdiv(H, blocks["BLOCK_H"]) * blocks["SPLIT"]
    if det:
        dk = dict(DKV=stage, stride_dkb=stage.stride(1), stride_dkt=stage.stride(2),
                  stride_sh=stage.stride(0), stride_sk=stage.stride(3))
    else:
        dk = dict(DKV=dkv, stride_dkb=dkv.stride(0), stride_dkt=dkv.stride(1), stride_sh=0, stride_sk=0)
    return Launch(
        _sparse_mla_bwd_kernel, _grid(n_parts * n_tok, B, "backward"),
        dict(
            **_bwd_args(q, kv, indices, n_slots, dout, lse, delta, dq), **dk,
            H=H, N_HB=n_parts // blocks["SPLIT"], N_KV=kv.shape[1], T0=t0, K_LO=k_lo, K_HI=k_hi,
            scale=scale, scale_log2=scale * LOG2E,
            D_V=d_v, D_R=D - d_v, **blocks, DETERMINISTIC=det,
        ),
        num_warps=8 if blocks["BLOCK_DV"] >= 256 else 4,
        # deterministic: no software pipelining (with Triton's default 3 stages it spilled 32-72 B)
        num_stages=1 if det else num_stages,
    )


def plan_bwd_interleaved(q, kv, indices, n_slots, dout, lse, delta, dq, dkv, scale: float, d_v: int,
                         block_k: int = 32, num_stages: int = 2, num_warps: int = 8) -> Launch:
    """The interleaved backward's launch (`plan_bwd`'s atomic arguments): 32 heads a program
    whatever H is (2 x 32 interleaved q / dO rows are its products' M; a smaller H leaves rows
    masked), `block_k` keys a tile. The default is the autotuning config: 32 keys, 2 stages, 8 warps
    (170 KB of shared memory, no spill under Triton 3.6 / 3.9); `benchmarks/kernel_variants.py`
    times others."""
    B, T, H, D = q.shape
    bh = 32
    blocks = dict(BLOCK_H=bh, BLOCK_K=block_k, BLOCK_DV=pow2(d_v, 128), BLOCK_DR=pow2(max(D - d_v, 1)),
                  EVEN_H=H % bh == 0)
    n_hb = triton.cdiv(H, bh)
    _int32_rows(kv, "backward (interleaved)")
    return Launch(
        _sparse_mla_bwd_interleaved_kernel, _grid(n_hb * T, B, "backward (interleaved)"),
        dict(
            **_bwd_args(q, kv, indices, n_slots, dout, lse, delta, dq),
            DKV=dkv, stride_dkb=dkv.stride(0), stride_dkt=dkv.stride(1),
            H=H, N_HB=n_hb, N_KV=kv.shape[1], scale=scale, scale_log2=scale * LOG2E,
            D_V=d_v, D_R=D - d_v, **blocks,
        ),
        num_warps=num_warps, num_stages=num_stages,
    )


def _launch(launch: Launch) -> None:
    """Runs a planned launch (tests swap it to measure the launchers' allocations on the meta device)."""
    launch.run()


def sparse_mla_fwd(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, n_slots: torch.Tensor,
                   scale: float, d_v: int, p_sum: torch.Tensor | None = None):
    """-> out, lse. p_sum [B, T, K] fp32, zeroed: also fills it with the sparse KL's target, Sigma_h P
    per slot (by the forward launch itself where `fwd_target` says so, else by indexer_kl's target
    kernel after the forward)."""
    B, T, H, D = q.shape
    out = torch.empty((B, T, H, d_v), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, T, H), dtype=torch.float32, device=q.device)
    if B * T == 0 or H == 0:
        return out, lse
    space = fwd_space_for(q, kv, d_v)
    on_gpu = q.is_cuda and not interpreted()

    def build(name):
        return plan_fwd(q, kv, indices, n_slots, out, lse, scale, d_v, space[name])

    forced = forced_fwd_config()
    if forced is not None:  # DSA_SPARSE_MLA_FWD_CONFIG / force_fwd_config: this config, untimed
        if forced not in space:
            raise ValueError(f"sparse_mla forward: config {forced!r} (DSA_SPARSE_MLA_FWD_CONFIG) is not in this "
                             f"call's space {list(space)}; unset it or pick one of those")
        name = forced
    else:  # chosen (and timed) on the plain forward: the target pass does not change the ranking's inputs
        name, _ = autotune.pick("sparse_mla_fwd", (H, D, d_v, pow2(indices.shape[-1])), list(space), build,
                                on_gpu, autotune.device_id(q) if on_gpu else "",
                                verify=lambda name: fwd_verify(q, kv, indices, n_slots, scale, d_v, space, name))
    if p_sum is None:
        _launch(build(name))
        return out, lse
    # the KL target: the chosen forward, then indexer_kl's target kernel (the default), or the Triton
    # forward's own TARGET pass where `fwd_target` allows it; a GPU times both once per shape
    tspace = target_space(space[name], H)
    tkey = (name, H, D, d_v, pow2(indices.shape[-1]))
    forced_t = os.environ.get("DSA_SPARSE_MLA_TARGET") or None
    if forced_t is not None:  # this way, untimed (tests run both on the interpreter)
        if forced_t not in tspace:
            raise ValueError(f"sparse_mla forward: DSA_SPARSE_MLA_TARGET={forced_t!r} is not available with forward "
                             f"config {name!r} (choices: {list(tspace)}); unset it or pick one of those")
        _launch(plan_with_target(q, kv, indices, n_slots, out, lse, p_sum, scale, d_v, space[name], forced_t))
        return out, lse
    _, launch = autotune.pick(
        "sparse_mla_target", tkey, list(tspace), lambda n: plan_with_target(q, kv, indices, n_slots, out, lse, p_sum,
                                                                          scale, d_v, space[name], n),
        on_gpu, autotune.device_id(q) if on_gpu else "",
        verify=lambda n: target_verify(q, kv, indices, n_slots, scale, d_v, space[name], n))
    _launch(launch)
    return out, lse


# How the sparse MLA forward forms the sparse KL's target when asked (`sparse_mla_fwd(p_sum=...)`):
# "target-kernel" (the default): the chosen forward config, then indexer_kl's `_sparse_kl_target_kernel`
# (all 128 heads of the 671B model in one block: each selected row gathered once more per token);
# "forward-pass": the Triton forward's TARGET pass (no second launch, q still resident, but each row
# gathered again per 64-head block: x2 the target kernel's gathered bytes at H = 128). Which is faster
# is a GPU measurement (the report's roofline estimate favours the target kernel); the autotuner times
# both once per shape after checking that the forward pass's target agrees with the kernel's.
TARGET_CONFIGS = ("target-kernel", "forward-pass")
TARGET_VERIFY_TOL = 1e-4  # max |a - b| <= this x max |b| (fp32 sums of the same exps, other dot tilings)


def target_space(config: tuple, H: int) -> tuple:
    return TARGET_CONFIGS if fwd_target(config, H) else TARGET_CONFIGS[:1]


class LaunchSequence:
    """Launches run in order after zeroing `zero` (the target's buffer: the forward pass adds into it
    with atomics), one unit for the autotuner's timing (`run`)."""

    def __init__(self, launches: list, zero: torch.Tensor):
        self.launches, self.zero = launches, zero

    def run(self) -> None:
        self.zero.zero_()
        for launch in self.launches:
            launch.run()


def plan_with_target(q, kv, indices, n_slots, out, lse, p_sum, scale: float, d_v: int, config: tuple,
                     how: str) -> LaunchSequence:
    """The forward of `config` forming out, lse and the target p_sum [B, T, K] fp32 (`TARGET_CONFIGS`)."""
    if how == "forward-pass":
        return LaunchSequence([plan_fwd(q, kv, indices, n_slots, out, lse, scale, d_v, config, p_sum)], p_sum)
    from .target import plan_sparse_kl_target

    return LaunchSequence([plan_fwd(q, kv, indices, n_slots, out, lse, scale, d_v, config),
                           plan_sparse_kl_target(q, kv, indices, n_slots, lse, p_sum, 0, scale)], p_sum)


def target_verify(q, kv, indices, n_slots, scale: float, d_v: int, config: tuple, how: str) -> bool:
    """Whether `how`'s target agrees with the target kernel's (`TARGET_VERIFY_TOL`, no NaN) on the
    forward verification's probe tokens (`FWD_VERIFY_TOKENS`, the last and the first)."""
    B, T, H, _ = q.shape
    K = indices.shape[-1]
    probes = [slice(max(0, T - FWD_VERIFY_TOKENS), T)] + ([slice(0, FWD_VERIFY_TOKENS)] if T > FWD_VERIFY_TOKENS else [])
    for sl in probes:
        qs, ids, ns = q[:, sl], indices[:, sl], n_slots[:, sl]
        got = {}
        for n in (TARGET_CONFIGS[0], how):
            o = torch.empty((B, qs.shape[1], H, d_v), dtype=q.dtype, device=q.device)
            ls = torch.empty((B, qs.shape[1], H), dtype=torch.float32, device=q.device)
            ps = torch.empty((B, qs.shape[1], K), dtype=torch.float32, device=q.device)
            _launch(plan_with_target(qs, kv, ids, ns, o, ls, ps, scale, d_v, config, n))
            got[n] = ps
        ref, cand = got[TARGET_CONFIGS[0]], got[how]
        if bool(torch.isnan(cand).any()) or not bool(
                (cand - ref).abs().max() <= TARGET_VERIFY_TOL * ref.abs().max().clamp_min(1e-30)):
            return False
    return True


def fwd_target(config: tuple, H: int) -> bool:
    """Whether the forward launch of `config` can form the sparse KL's target itself (the Triton
    kernel's `TARGET` pass): not a Gluon config (that kernel has no target pass), and under
    torch.use_deterministic_algorithms at most two head blocks (the per-slot atomic adds onto zero
    are order-independent only for two addends)."""
    if is_gluon_config(config):
        return False
    n_hb = triton.cdiv(H, fwd_blocks(H, 64, 64)["BLOCK_H"])
    return n_hb <= 2 or not torch.are_deterministic_algorithms_enabled()


def fwd_space_for(q, kv, d_v: int) -> dict:
    """{name: config} of the forward's space for this call: `fwd_config_space` of the GPU's
    capability, less the Gluon configs where that kernel does not take the call."""
    cap = target_capability(q)
    space = {cfg[0]: cfg for cfg in fwd_config_space(cap)}
    if any(is_gluon_config(c) for c in space.values()):
        from .gluon_fwd import gluon_fwd_supported

        if not gluon_enabled() or gluon_fwd_supported(q, kv, d_v, cap) is not None:
            space = {n: c for n, c in space.items() if not is_gluon_config(c)}
    return space


def gluon_enabled() -> bool:
    """The Gluon configs are in sm_90's forward space (after the Triton ones, verified before timing)
    unless DSA_KERNELS_GLUON=0. Measured on an H200 (GPU session 2, docs/gpu-check/NVIDIA-H200/
    session-2): correct against the fp32 reference at T = 4K / 32K, no hang, 451 TFLOPS against the
    Triton forward's 180 at T = 32K. The switch is for a GPU or Triton build where they misbehave."""
    return env_flag("DSA_KERNELS_GLUON", "1")


_FORCED_FWD: contextvars.ContextVar[str | None] = contextvars.ContextVar("dsa_sparse_mla_fwd_config", default=None)


def forced_fwd_config() -> str | None:
    """The forward config forced by `force_fwd_config` or DSA_SPARSE_MLA_FWD_CONFIG (a name of the
    forward's space, e.g. "gluon"): it runs untimed and unverified (gpu-check's Gluon checks compare
    it with the reference themselves). None: the autotuner chooses."""
    return _forced_config(_FORCED_FWD, "DSA_SPARSE_MLA_FWD_CONFIG")


def force_fwd_config(name: str | None):
    """Context manager: the forward runs config `name` (None: the autotuner chooses)."""
    return _forcing_config(_FORCED_FWD, name)


# A forward config is verified against the default (the first Triton config) on two blocks of
# tokens before it may be timed: the last FWD_VERIFY_TOKENS (the longest rows: every tile of the
# pipeline) and the first FWD_VERIFY_TOKENS (short and empty rows). out: max |a - b| <=
# FWD_VERIFY_OUT_TOL x max |b| (bf16 outputs, P rounded to bf16 in both, summed in another order);
# lse: max |a - b| <= FWD_VERIFY_LSE_TOL x max(1, max |b|), and -inf exactly where the default has it.
FWD_VERIFY_TOKENS = 128
FWD_VERIFY_OUT_TOL = 2.0**-6
FWD_VERIFY_LSE_TOL = 1e-4


def fwd_verify(q, kv, indices, n_slots, scale: float, d_v: int, space: dict, name: str) -> bool:
    """Whether config `name`'s out / lse agree with the default's (`FWD_VERIFY_*`) on probe tokens.
    A config that fails to compile or launch counts as disagreeing (the autotuner leaves it out)."""
    B, T, H, _ = q.shape
    default = next(iter(space))
    probes = [slice(max(0, T - FWD_VERIFY_TOKENS), T)] + ([slice(0, FWD_VERIFY_TOKENS)] if T > FWD_VERIFY_TOKENS else [])
    for sl in probes:
        qs, ids, ns = q[:, sl], indices[:, sl], n_slots[:, sl]
        outs = {}
        for cfg in (default, name):
            o = torch.empty((B, qs.shape[1], H, d_v), dtype=q.dtype, device=q.device)
            ls = torch.empty((B, qs.shape[1], H), dtype=torch.float32, device=q.device)
            try:
                _launch(plan_fwd(qs, kv, ids, ns, o, ls, scale, d_v, space[cfg]))
            except Exception as err:  # a compile / launch failure of the candidate: left out
                if cfg == default:
                    raise
                import warnings

                warnings.warn(f"sparse_mla_fwd: config {name} failed: {type(err).__name__}: "
                              f"{str(err).strip().splitlines()[-1] if str(err).strip() else ''}", RuntimeWarning)
                return False
            outs[cfg] = (o.float(), ls)
        (o_ref, l_ref), (o_got, l_got) = outs[default], outs[name]
        if not fwd_outputs_close(o_got, o_ref, l_got, l_ref):
            return False
    return True


def fwd_outputs_close(out, ref_out, lse, ref_lse) -> bool:
    """The forward verification's criterion (`FWD_VERIFY_*`)."""
    if bool(torch.isnan(out).any()) or bool(torch.isnan(lse).any()):
        return False
    if not bool(((out - ref_out).abs().max() <= FWD_VERIFY_OUT_TOL * ref_out.abs().max().clamp_min(1e-30))):
        return False
    inf_ref = torch.isinf(ref_lse)
    if not torch.equal(torch.isinf(lse), inf_ref) or not torch.equal(lse[inf_ref], ref_lse[inf_ref]):
        return False
    fin = ~inf_ref
    if not bool(fin.any()):
        return True
    lse_scale = max(1.0, float(ref_lse[fin].abs().max()))
    return bool((lse[fin] - ref_lse[fin]).abs().max() <= FWD_VERIFY_LSE_TOL * lse_scale)


DELTA_CHUNK_ELEMS = 1 << 26  # fp32 elements of `bwd_delta`'s one temporary (256 MB)


def bwd_delta(out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None) -> torch.Tensor:
    """delta [B, T, H] fp32 = rowsum(dO * O) - dlse (dlse only where lse is finite), for
    out / dout [B, T, H, d_v]. The rowsum is `_triton_common.row_dot`, a token chunk at a time (its
    one temporary: at most DELTA_CHUNK_ELEMS fp32 elements)."""
    delta = row_dot(dout, out, DELTA_CHUNK_ELEMS)
    if dlse is not None:
        delta -= torch.where(torch.isfinite(lse), dlse.float(), 0.0)
    return delta


def sparse_mla_bwd(q, kv, indices, n_slots, out, lse, dout, dlse, scale: float, d_v: int):
    """-> dq [B, T, H, D] (q's dtype), dkv [B, N, D] (kv's dtype). Memory beyond those outputs:
    delta [B, T, H] fp32, dkv's fp32 accumulator [B, N, D] and `bwd_delta`'s one bounded chunk
    (measured in tests/test_kernels_sparse_mla_launch.py)."""
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    dq = torch.empty_like(q)
    B, T, H, D = q.shape
    if B * T == 0 or H == 0:
        return dq.zero_(), torch.zeros_like(kv)
    delta = bwd_delta(out, dout, lse, dlse)
    if torch.are_deterministic_algorithms_enabled():
        return dq, sparse_mla_bwd_deterministic(q, kv, indices, n_slots, dout, lse, delta, dq, scale, d_v)
    dkv = torch.empty(kv.shape, dtype=torch.float32, device=kv.device)
    space = bwd_space_for(q, kv, d_v)
    on_gpu = q.is_cuda and not interpreted()

    def build(name):  # timing runs into dq / dkv themselves: dq is overwritten, dkv zeroed below
        return plan_bwd_config(space[name], q, kv, indices, n_slots, dout, lse, delta, dq, dkv, scale, d_v)

    forced = forced_bwd_config()
    if forced is not None:  # DSA_SPARSE_MLA_BWD_CONFIG / force_bwd_config: this config, untimed
        space = bwd_space_for(q, kv, d_v, unmeasured=True)
        if forced not in space:
            raise ValueError(f"sparse_mla backward: config {forced!r} (DSA_SPARSE_MLA_BWD_CONFIG) is not in this "
                             f"call's space {list(space)}; unset it or pick one of those")
        _run_zeroed(build(forced), dkv)
        return dq, dkv.to(kv.dtype)

    def verify(name):  # the config's dkv and probed dq rows against the default's, before it may be timed
        probe = slice(None, None, max(1, T // BWD_VERIFY_DQ_TOKENS))
        ref = _run_zeroed(build(next(iter(space))), dkv).clone()
        ref_dq = dq[:, probe].to(torch.float32, copy=True)  # a copy also when dq is fp32
        got = _run_zeroed(build(name), dkv)
        return _close(got, ref) and _close(dq[:, probe].float(), ref_dq)

    _, launch = autotune.pick("sparse_mla_bwd", (H, D, d_v, pow2(indices.shape[-1])), list(space), build,
                              on_gpu, autotune.device_id(q) if on_gpu else "", verify=verify)
    _run_zeroed(launch, dkv)
    return dq, dkv.to(kv.dtype)


def _run_zeroed(launch: Launch, dkv: torch.Tensor) -> torch.Tensor:
    """Zeroes the fp32 dkv accumulator, then runs an atomic backward launch into it."""
    dkv.zero_()
    _launch(launch)
    return dkv


# The deterministic backward's stage: at most this many fp32 elements (256 MB), with slot windows
# sized so a token chunk holds about DETERMINISTIC_MIN_TOKENS tokens (enough programs to fill
# the GPU) however long the index lists are (CP's dense-at-positions lists are T = 128K wide).
DETERMINISTIC_STAGE_ELEMS = 1 << 26
DETERMINISTIC_MIN_TOKENS = 128


def deterministic_plan(B: int, T: int, K: int, D: int, n_hb: int, block_k: int) -> tuple[int, int]:
    """(tokens per chunk C, slots per window W) of the deterministic backward: its stage
    [n_hb, B, C, W, D] fp32 stays within DETERMINISTIC_STAGE_ELEMS; W is a multiple of block_k
    (at most K rounded up), chosen so that C >= min(T, DETERMINISTIC_MIN_TOKENS) when the budget
    allows a window of at least one tile."""
    per_token_slot = max(n_hb * B * D, 1)
    k_pad = triton.cdiv(max(K, 1), block_k) * block_k
    want_tokens = max(1, min(T, DETERMINISTIC_MIN_TOKENS))
    window = DETERMINISTIC_STAGE_ELEMS // (per_token_slot * want_tokens) // block_k * block_k
    window = max(block_k, min(k_pad, window))
    chunk = max(1, min(T, DETERMINISTIC_STAGE_ELEMS // (per_token_slot * window)))
    return chunk, window


def deterministic_layout(B: int, T: int, K: int, H: int, D: int, d_v: int) -> tuple[int, int, int]:
    """(head blocks, tokens per chunk, slots per window) of the deterministic backward for q
    [B, T, H, D] and K slots: the backward's head blocks (`bwd_blocks`) and `deterministic_plan`."""
    blocks = bwd_blocks(H, d_v, D - d_v)
    n_hb = triton.cdiv(H, blocks["BLOCK_H"])
    return (n_hb, *deterministic_plan(B, T, K, D, n_hb, blocks["BLOCK_K"]))


def sparse_mla_bwd_deterministic(q, kv, indices, n_slots, dout, lse, delta, dq, scale: float, d_v: int):
    """Bitwise-reproducible backward (no atomics): fills dq in place, returns dkv (kv's dtype).

    Tokens run in chunks of C and each chunk's slots in windows of W (`deterministic_plan`); one
    launch per (chunk, window), in a fixed order. A launch stores every (head block, token, slot)'s
    dkv contribution at its own address of the stage [head blocks, B, C, W, D] and adds its dq
    part into the chunk's fp32 accumulator (each dq address owned by one program). PyTorch then
    sums the stage's head blocks in order and `index_add_`s the window into an fp32 dkv with one
    spare row per batch (the destination of empty / out-of-range slots, whose stage rows the
    kernel never writes), deterministic on CUDA under torch.use_deterministic_algorithms. Windows
    past the chunk's longest row are skipped (one host sync per chunk)."""
    B, T, H, D = q.shape
    K, N = indices.shape[-1], kv.shape[1]
    n_hb, chunk, window = deterministic_layout(B, T, K, H, D, d_v)
    stage_buf = torch.empty(n_hb * B * min(chunk, T) * min(window, K) * D, dtype=torch.float32, device=q.device)
    dq_acc = torch.empty((B, min(chunk, T), H, D), dtype=torch.float32, device=q.device)
    dkv_acc = torch.zeros((B, N + 1, D), dtype=torch.float32, device=kv.device)  # row N: the spare row
    batch_base = (torch.arange(B, device=indices.device) * (N + 1))[:, None, None]
    for t0 in range(0, T, chunk):
        c = min(chunk, T - t0)
        k_end = int(n_slots[:, t0:t0 + c].max())
        dq_acc.zero_()
        for k_lo in range(0, k_end, window):
            w = min(window, k_end - k_lo)
            stage = stage_buf[: n_hb * B * c * w * D].view(n_hb, B, c, w, D)
            _launch(plan_bwd(q, kv, indices, n_slots, dout, lse, delta, dq_acc, None, scale, d_v,
                             t0, c, k_lo, k_lo + w, stage))
            for h in range(1, n_hb):  # head blocks summed in order
                stage[0].add_(stage[h])
            sel = indices[:, t0:t0 + c, k_lo:k_lo + w]
            rows = torch.where((sel >= 0) & (sel < N), sel.long(), N) + batch_base  # [B, c, w]
            dkv_acc.view(B * (N + 1), D).index_add_(0, rows.view(-1), stage[0].view(B * c * w, D))
        dq[:, t0:t0 + c].copy_(dq_acc[:, :c])
    return dkv_acc[:, :N].to(kv.dtype).contiguous()
