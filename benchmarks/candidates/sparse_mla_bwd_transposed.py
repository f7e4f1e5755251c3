"""Candidate sparse MLA backward, keys on the rows: measured beside the shipped one by
`benchmarks/kernel_variants.py`, not shipped (docs/kernels.md "Backward v2").

The shipped backward (`dsa_kernels.ops.sparse_mla.kernel._sparse_mla_bwd_kernel`) runs 16-key
tiles in two column parts per 64-head block, re-reads q and dO pieces per tile (81 MB per token
at the 671B shapes) and lowers its [16, 128] dkv products to mma.sync. This one is TileLang's
schedule as far as Triton's register allocation allows, transposed so every product has
wgmma's M >= 64:
- one program per (token, head block of BLOCK_H = 32), q and dO read once and resident;
- 64-key tiles, the selected rows gathered once per tile as four latent quarters + rope;
- S^T = kv q^T and dP^T = v dO^T ([BLOCK_K, BLOCK_H]); P^T, dS^T from the saved lse and delta;
- dkv[idx] += dS^T q + P^T dO per quarter ([BLOCK_K, 128], fp32 relaxed atomics, vectorized);
- dq^T += kv^T dS^T ([576, BLOCK_H] fp32 accumulators, 72 registers a thread at 8 warps).
At the 671B shapes (H = 128, k = 2048, sm_90a) its analysis: issued FLOPs = useful (1.44 GF per
token, nothing recomputed), 9.75 MB read per token (TileLang's design: 5.01), 0 mma.sync. It does
not pass the compile gate: 255 registers and 1.4-2.1 KB of spill (Triton 3.6 / 3.9, 1-2 stages),
so only a GPU measurement can say whether it beats the shipped kernel (the 32-key variant of the
shipped kernel spilled and was still 1.49x faster on an H200).

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
    mh = mask_h[:, None]
    # latent dims as four column quarters + the rope dims, separate tensors (no tile slicing)
    BLOCK_C: tl.constexpr = BLOCK_DV // 4
    offs_c = tl.arange(0, BLOCK_C)
    m0 = offs_c < D_V
    m1 = BLOCK_C + offs_c < D_V
    m2 = 2 * BLOCK_C + offs_c < D_V
    m3 = 3 * BLOCK_C + offs_c < D_V
    offs_r = tl.arange(0, BLOCK_DR)
    mr = offs_r < D_R

    # q and dO of the head block: read once, resident across the key loop
    q_rows = Q + b * stride_qb + t * stride_qt + offs_h[:, None] * stride_qh
    q0 = tl.load(q_rows + offs_c[None, :], mask=mh & m0[None, :], other=0.0)  # [BLOCK_H, BLOCK_C]
    q1 = tl.load(q_rows + BLOCK_C + offs_c[None, :], mask=mh & m1[None, :], other=0.0)
    q2 = tl.load(q_rows + 2 * BLOCK_C + offs_c[None, :], mask=mh & m2[None, :], other=0.0)
    q3 = tl.load(q_rows + 3 * BLOCK_C + offs_c[None, :], mask=mh & m3[None, :], other=0.0)
    qr = tl.load(q_rows + D_V + offs_r[None, :], mask=mh & mr[None, :], other=0.0)
    do_rows = DO + b * stride_dob + t * stride_dot + offs_h[:, None] * stride_doh
    do0 = tl.load(do_rows + offs_c[None, :], mask=mh & m0[None, :], other=0.0)
    do1 = tl.load(do_rows + BLOCK_C + offs_c[None, :], mask=mh & m1[None, :], other=0.0)
    do2 = tl.load(do_rows + 2 * BLOCK_C + offs_c[None, :], mask=mh & m2[None, :], other=0.0)
    do3 = tl.load(do_rows + 3 * BLOCK_C + offs_c[None, :], mask=mh & m3[None, :], other=0.0)
    stat = b * stride_lb + t * stride_lt + offs_h
    lse = tl.load(LSE + stat, mask=mask_h, other=float("-inf"))
    delta = tl.load(DELTA + stat, mask=mask_h, other=0.0)
    # p = exp2(s*log2e - lse*log2e); an empty (or padded) row has lse = -inf -> p = 0
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)

    dq0 = tl.zeros([BLOCK_C, BLOCK_H], dtype=tl.float32)  # dq^T by quarter
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
        # S^T over all dims, dP^T over the latent ones: [BLOCK_K, BLOCK_H]
        s = tl.dot(kv0, tl.trans(q0))
        s += tl.dot(kv1, tl.trans(q1))
        s += tl.dot(kv2, tl.trans(q2))
        s += tl.dot(kv3, tl.trans(q3))
        s += tl.dot(kvr, tl.trans(qr))
        dp = tl.dot(kv0, tl.trans(do0))
        dp += tl.dot(kv1, tl.trans(do1))
        dp += tl.dot(kv2, tl.trans(do2))
        dp += tl.dot(kv3, tl.trans(do3))
        p = tl.where(vk, tl.exp2(s * scale_log2 - lse2[None, :]), 0.0)
        ds_c = (p * (dp - delta[None, :]) * scale).to(q0.dtype)  # d loss / d (q . kv), transposed
        p_c = p.to(do0.dtype)
        drows = DKV + b * stride_dkb + tl.where(valid, idx, 0).to(tl.int64)[:, None] * stride_dkt
        # dkv[idx] += dS^T q + P^T dO, a quarter at a time; dq^T += kv^T dS^T
        tl.atomic_add(drows + offs_c[None, :], tl.dot(ds_c, q0) + tl.dot(p_c, do0),
                      mask=vk & m0[None, :], sem="relaxed")
        dq0 += tl.dot(tl.trans(kv0), ds_c)
        tl.atomic_add(drows + BLOCK_C + offs_c[None, :], tl.dot(ds_c, q1) + tl.dot(p_c, do1),
                      mask=vk & m1[None, :], sem="relaxed")
        dq1 += tl.dot(tl.trans(kv1), ds_c)
        tl.atomic_add(drows + 2 * BLOCK_C + offs_c[None, :], tl.dot(ds_c, q2) + tl.dot(p_c, do2),
                      mask=vk & m2[None, :], sem="relaxed")
        dq2 += tl.dot(tl.trans(kv2), ds_c)
        tl.atomic_add(drows + 3 * BLOCK_C + offs_c[None, :], tl.dot(ds_c, q3) + tl.dot(p_c, do3),
                      mask=vk & m3[None, :], sem="relaxed")
        dq3 += tl.dot(tl.trans(kv3), ds_c)
        tl.atomic_add(drows + D_V + offs_r[None, :], tl.dot(ds_c, qr), mask=vk & mr[None, :], sem="relaxed")
        dqr += tl.dot(tl.trans(kvr), ds_c)

    # dq^T [columns, heads] -> dq[b, t, head, column]
    dq_rows = DQ + b * stride_dqb + t * stride_dqt + offs_h[None, :] * stride_dqh
    hm = mask_h[None, :]
    out_ty = DQ.dtype.element_ty
    tl.store(dq_rows + offs_c[:, None], dq0.to(out_ty), mask=m0[:, None] & hm)
    tl.store(dq_rows + BLOCK_C + offs_c[:, None], dq1.to(out_ty), mask=m1[:, None] & hm)
    tl.store(dq_rows + 2 * BLOCK_C + offs_c[:, None], dq2.to(out_ty), mask=m2[:, None] & hm)
    tl.store(dq_rows + 3 * BLOCK_C + offs_c[:, None], dq3.to(out_ty), mask=m3[:, None] & hm)
    tl.store(dq_rows + D_V + offs_r[:, None], dqr.to(out_ty), mask=mr[:, None] & hm)


def plan_bwd(q, kv, indices, n_slots, dout, lse, delta, dq, dkv, scale: float, d_v: int,
             block_h: int = 32, block_k: int = 64, num_stages: int = 1, num_warps: int | None = None) -> Launch:
    """The candidate's launch (the shipped `plan_bwd`'s atomic arguments). One stage at 32 heads:
    two need 254 KB of shared memory (Hopper has 227); 16 heads fit two (217 KB)."""
    B, T, H, D = q.shape
    bh = min(pow2(H), block_h)
    blocks = dict(BLOCK_H=bh, BLOCK_K=block_k, BLOCK_DV=pow2(d_v, 64), BLOCK_DR=pow2(max(D - d_v, 1)),
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
