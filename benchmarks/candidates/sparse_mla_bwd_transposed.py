"""Candidate sparse MLA backward, keys on the rows: measured beside the shipped one by
`benchmarks/kernel_variants.py`, not shipped (docs/kernels.md "Backward v2").

The shipped backward (`dsa_kernels.ops.sparse_mla.kernel._sparse_mla_bwd_kernel`) runs 16-key
tiles in two column parts per 64-head block, re-reads q and dO pieces per tile (81 MB per token
at the 671B shapes) and lowers its [16, 128] dkv products to mma.sync. This one follows TileLang's
schedule as far as Triton's registers and shared memory allow, transposed so that every product
has wgmma's M >= 64:
- one program per (token, head block of BLOCK_H heads); q and dO read once and resident, their
  rows interleaved (row 2h = q of head h, row 2h + 1 = dO of head h);
- 64-key tiles, the selected rows gathered once per tile, as eight latent pieces + rope;
- one product per piece gives S^T and dP^T together ([BLOCK_K, 2 BLOCK_H], interleaved columns);
  P^T and dS^T from the saved lse and delta;
- one product per piece gives dkv = dS^T q + P^T dO ([BLOCK_K, 64], by the interleaved
  [dS^T | P^T]), added at the selected rows with fp32 relaxed atomics (vectorized);
- dq^T += kv^T dS^T ([576, BLOCK_H] fp32 accumulators).
Nothing is recomputed (issued FLOPs = useful) and there is no mma.sync. At 32 heads it reads 9.75
MB per token (TileLang's design: 5.01) but spills (Triton 3.9 / 3.6: 912 / 1304 B at one stage;
two stages need 236 KB of shared memory, over Hopper's 227). At 16 heads with two stages it passes
the compile gate (no spill under 3.6 or 3.9, 203 KB) but reads 19 MB per token and doubles the
atomics (37.7 MB per token). Which is fastest, and against the shipped kernel, only a GPU can say.

Same contract as the shipped atomic backward: q [B, T, H, D], kv [B, N, D], indices [B, T, K]
int32 (-1 or any out-of-range value = empty slot), n_slots [B, T] int32 (`slot_counts`), dout
[B, T, H, D_V], lse / delta [B, T, H] fp32; writes dq [B, T, H, D] (q's dtype) and adds into
dkv [B, N, D] fp32 (zeroed by the caller).
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsa_kernels._triton_common import Launch, pow2
from dsa_kernels.ops.sparse_mla.kernel import LOG2E, _grid, _int32_rows


@triton.jit
def _sparse_mla_bwd_transposed_kernel(
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
    # program (x, y) -> (token, head block), the head block fastest; y = b
    pid = tl.program_id(0)
    hb = pid % N_HB
    t = (pid // N_HB).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = (offs_h < H) | EVEN_H
    # the latent dims as eight 64-column pieces (c0..c7) and the rope dims (r): separate tensors
    # (Triton cannot slice a tile). 64 columns: the dq^T products' M (wgmma), and the atomics'
    # layout conversion stays at 16 KB of shared memory
    BLOCK_C: tl.constexpr = BLOCK_DV // 8
    offs_c = tl.arange(0, BLOCK_C)
    m0 = offs_c < D_V
    m1 = BLOCK_C + offs_c < D_V
    m2 = 2 * BLOCK_C + offs_c < D_V
    m3 = 3 * BLOCK_C + offs_c < D_V
    m4 = 4 * BLOCK_C + offs_c < D_V
    m5 = 5 * BLOCK_C + offs_c < D_V
    m6 = 6 * BLOCK_C + offs_c < D_V
    m7 = 7 * BLOCK_C + offs_c < D_V
    offs_r = tl.arange(0, BLOCK_DR)
    mr = offs_r < D_R

    # q and dO of the head block, interleaved by rows: row 2h = q[head h], row 2h + 1 = dO[head h]
    # ([2 BLOCK_H, columns]; dO has no rope columns: zeros there). Read once, resident. With them
    # one product gives S^T and dP^T together, and one gives dS^T q + P^T dO.
    offs_j = tl.arange(0, 2 * BLOCK_H)
    head_j = hb * BLOCK_H + offs_j // 2
    is_q = (offs_j % 2) == 0
    mask_j = ((head_j < H) | EVEN_H)[:, None]
    q_j = Q + b * stride_qb + t * stride_qt + head_j[:, None] * stride_qh
    do_j = DO + b * stride_dob + t * stride_dot + head_j[:, None] * stride_doh
    qd_j = tl.where(is_q[:, None], q_j, do_j)
    x0 = tl.load(qd_j + offs_c[None, :], mask=mask_j & m0[None, :], other=0.0)  # [2 BLOCK_H, BLOCK_C]
    x1 = tl.load(qd_j + BLOCK_C + offs_c[None, :], mask=mask_j & m1[None, :], other=0.0)
    x2 = tl.load(qd_j + 2 * BLOCK_C + offs_c[None, :], mask=mask_j & m2[None, :], other=0.0)
    x3 = tl.load(qd_j + 3 * BLOCK_C + offs_c[None, :], mask=mask_j & m3[None, :], other=0.0)
    x4 = tl.load(qd_j + 4 * BLOCK_C + offs_c[None, :], mask=mask_j & m4[None, :], other=0.0)
    x5 = tl.load(qd_j + 5 * BLOCK_C + offs_c[None, :], mask=mask_j & m5[None, :], other=0.0)
    x6 = tl.load(qd_j + 6 * BLOCK_C + offs_c[None, :], mask=mask_j & m6[None, :], other=0.0)
    x7 = tl.load(qd_j + 7 * BLOCK_C + offs_c[None, :], mask=mask_j & m7[None, :], other=0.0)
    xr = tl.load(q_j + D_V + offs_r[None, :], mask=mask_j & is_q[:, None] & mr[None, :], other=0.0)
    stat = b * stride_lb + t * stride_lt + offs_h
    lse = tl.load(LSE + stat, mask=mask_h, other=float("-inf"))
    delta = tl.load(DELTA + stat, mask=mask_h, other=0.0)
    # p = exp2(s*log2e - lse*log2e); an empty (or padded) row has lse = -inf -> p = 0
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)

    dq0 = tl.zeros([BLOCK_C, BLOCK_H], dtype=tl.float32)  # dq^T by piece
    dq1 = tl.zeros([BLOCK_C, BLOCK_H], dtype=tl.float32)
    dq2 = tl.zeros([BLOCK_C, BLOCK_H], dtype=tl.float32)
    dq3 = tl.zeros([BLOCK_C, BLOCK_H], dtype=tl.float32)
    dq4 = tl.zeros([BLOCK_C, BLOCK_H], dtype=tl.float32)
    dq5 = tl.zeros([BLOCK_C, BLOCK_H], dtype=tl.float32)
    dq6 = tl.zeros([BLOCK_C, BLOCK_H], dtype=tl.float32)
    dq7 = tl.zeros([BLOCK_C, BLOCK_H], dtype=tl.float32)
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
        kv4 = tl.load(rows + 4 * BLOCK_C + offs_c[None, :], mask=vk & m4[None, :], other=0.0)
        kv5 = tl.load(rows + 5 * BLOCK_C + offs_c[None, :], mask=vk & m5[None, :], other=0.0)
        kv6 = tl.load(rows + 6 * BLOCK_C + offs_c[None, :], mask=vk & m6[None, :], other=0.0)
        kv7 = tl.load(rows + 7 * BLOCK_C + offs_c[None, :], mask=vk & m7[None, :], other=0.0)
        kvr = tl.load(rows + D_V + offs_r[None, :], mask=vk & mr[None, :], other=0.0)
        # [S^T | dP^T] interleaved: column 2h = kv . q_h (all dims), 2h + 1 = v . dO_h (latent)
        sdp = tl.dot(kv0, tl.trans(x0))
        sdp += tl.dot(kv1, tl.trans(x1))
        sdp += tl.dot(kv2, tl.trans(x2))
        sdp += tl.dot(kv3, tl.trans(x3))
        sdp += tl.dot(kv4, tl.trans(x4))
        sdp += tl.dot(kv5, tl.trans(x5))
        sdp += tl.dot(kv6, tl.trans(x6))
        sdp += tl.dot(kv7, tl.trans(x7))
        sdp += tl.dot(kvr, tl.trans(xr))
        s, dp = tl.split(tl.reshape(sdp, [BLOCK_K, BLOCK_H, 2]))
        p = tl.where(vk, tl.exp2(s * scale_log2 - lse2[None, :]), 0.0)
        ds = p * (dp - delta[None, :]) * scale  # d loss / d (q . kv), transposed
        ds_c = ds.to(x0.dtype)
        # [dS^T | P^T] interleaved the same way: one product per piece gives dS^T q + P^T dO
        dsp = tl.reshape(tl.join(ds, p), [BLOCK_K, 2 * BLOCK_H]).to(x0.dtype)
        # per piece: dkv[idx] += dS^T q + P^T dO (one product), dq^T += kv^T dS^T
        drows = DKV + b * stride_dkb + tl.where(valid, idx, 0).to(tl.int64)[:, None] * stride_dkt
        tl.atomic_add(drows + offs_c[None, :], tl.dot(dsp, x0), mask=vk & m0[None, :], sem="relaxed")
        dq0 += tl.dot(tl.trans(kv0), ds_c)
        tl.atomic_add(drows + BLOCK_C + offs_c[None, :], tl.dot(dsp, x1), mask=vk & m1[None, :], sem="relaxed")
        dq1 += tl.dot(tl.trans(kv1), ds_c)
        tl.atomic_add(drows + 2 * BLOCK_C + offs_c[None, :], tl.dot(dsp, x2), mask=vk & m2[None, :], sem="relaxed")
        dq2 += tl.dot(tl.trans(kv2), ds_c)
        tl.atomic_add(drows + 3 * BLOCK_C + offs_c[None, :], tl.dot(dsp, x3), mask=vk & m3[None, :], sem="relaxed")
        dq3 += tl.dot(tl.trans(kv3), ds_c)
        tl.atomic_add(drows + 4 * BLOCK_C + offs_c[None, :], tl.dot(dsp, x4), mask=vk & m4[None, :], sem="relaxed")
        dq4 += tl.dot(tl.trans(kv4), ds_c)
        tl.atomic_add(drows + 5 * BLOCK_C + offs_c[None, :], tl.dot(dsp, x5), mask=vk & m5[None, :], sem="relaxed")
        dq5 += tl.dot(tl.trans(kv5), ds_c)
        tl.atomic_add(drows + 6 * BLOCK_C + offs_c[None, :], tl.dot(dsp, x6), mask=vk & m6[None, :], sem="relaxed")
        dq6 += tl.dot(tl.trans(kv6), ds_c)
        tl.atomic_add(drows + 7 * BLOCK_C + offs_c[None, :], tl.dot(dsp, x7), mask=vk & m7[None, :], sem="relaxed")
        dq7 += tl.dot(tl.trans(kv7), ds_c)
        tl.atomic_add(drows + D_V + offs_r[None, :], tl.dot(dsp, xr), mask=vk & mr[None, :], sem="relaxed")
        dqr += tl.dot(tl.trans(kvr), ds_c)

    # dq^T [columns, heads] -> dq[b, t, head, column]
    dq_rows = DQ + b * stride_dqb + t * stride_dqt + offs_h[None, :] * stride_dqh
    hm = mask_h[None, :]
    out_ty = DQ.dtype.element_ty
    tl.store(dq_rows + offs_c[:, None], dq0.to(out_ty), mask=m0[:, None] & hm)
    tl.store(dq_rows + BLOCK_C + offs_c[:, None], dq1.to(out_ty), mask=m1[:, None] & hm)
    tl.store(dq_rows + 2 * BLOCK_C + offs_c[:, None], dq2.to(out_ty), mask=m2[:, None] & hm)
    tl.store(dq_rows + 3 * BLOCK_C + offs_c[:, None], dq3.to(out_ty), mask=m3[:, None] & hm)
    tl.store(dq_rows + 4 * BLOCK_C + offs_c[:, None], dq4.to(out_ty), mask=m4[:, None] & hm)
    tl.store(dq_rows + 5 * BLOCK_C + offs_c[:, None], dq5.to(out_ty), mask=m5[:, None] & hm)
    tl.store(dq_rows + 6 * BLOCK_C + offs_c[:, None], dq6.to(out_ty), mask=m6[:, None] & hm)
    tl.store(dq_rows + 7 * BLOCK_C + offs_c[:, None], dq7.to(out_ty), mask=m7[:, None] & hm)
    tl.store(dq_rows + D_V + offs_r[:, None], dqr.to(out_ty), mask=mr[:, None] & hm)


def plan_bwd(q, kv, indices, n_slots, dout, lse, delta, dq, dkv, scale: float, d_v: int,
             block_h: int = 32, block_k: int = 64, num_stages: int = 1, num_warps: int | None = None) -> Launch:
    """The candidate's launch (the shipped `plan_bwd`'s atomic arguments). One stage at 32 heads
    (two need 236 KB of shared memory, Hopper has 227); 16 heads fit two (203 KB)."""
    B, T, H, D = q.shape
    bh = min(pow2(H), block_h)
    blocks = dict(BLOCK_H=bh, BLOCK_K=block_k, BLOCK_DV=pow2(d_v, 128), BLOCK_DR=pow2(max(D - d_v, 1)),
                  EVEN_H=H % bh == 0)
    n_hb = triton.cdiv(H, bh)
    _int32_rows(kv, "backward (transposed candidate)")
    if lse.stride() != delta.stride():
        raise ValueError(f"sparse_mla backward: lse {lse.stride()} and delta {delta.stride()} must share strides")
    return Launch(
        _sparse_mla_bwd_transposed_kernel, _grid(n_hb * T, B, "backward (transposed candidate)"),
        dict(
            Q=q, KV=kv, IDX=indices, NSLOT=n_slots, DO=dout, LSE=lse, DELTA=delta, DQ=dq, DKV=dkv,
            stride_qb=q.stride(0), stride_qt=q.stride(1), stride_qh=q.stride(2),
            stride_kvb=kv.stride(0), stride_kvt=kv.stride(1),
            stride_ib=indices.stride(0), stride_it=indices.stride(1),
            stride_nb=n_slots.stride(0),
            stride_dob=dout.stride(0), stride_dot=dout.stride(1), stride_doh=dout.stride(2),
            stride_lb=lse.stride(0), stride_lt=lse.stride(1),
            stride_dqb=dq.stride(0), stride_dqt=dq.stride(1), stride_dqh=dq.stride(2),
            stride_dkb=dkv.stride(0), stride_dkt=dkv.stride(1),
            H=H, N_HB=n_hb, N_KV=kv.shape[1], scale=scale, scale_log2=scale * LOG2E,
            D_V=d_v, D_R=D - d_v, **blocks,
        ),
        num_warps=num_warps or (8 if blocks["BLOCK_DV"] >= 256 else 4), num_stages=num_stages,
    )
