"""Sparse MLA (MQA / absorbed mode) over top-k indices: Triton forward and backward.

Specification: `reference.sparse_mla_ref`. Shapes: q [B, T, H, D] with D = D_V + D_R
(576 = 512 latent + 64 rope in the 671B model), kv [B, T, D], indices [B, T, K] int32 (-1 empty).

Forward (one program per (head block of 64, value split, token), head block fastest in the
grid so the programs of one token, which gather the same KV rows, run together): q of the head
block stays resident; the selected slots are walked in 64-key tiles up to the row's last valid
slot (`slot_counts`: the launcher's per-row count, so the -1 tail of a short row costs nothing);
each tile gathers the selected rows of `kv = [latent | k_rope]` once for all heads of the block
(the MQA saving), computes the logits over all 576 dims and keeps an online softmax (log2
domain). The 512-dim value is split across SPLIT_V = 2 programs (each owns 256 output columns
and recomputes the logits), so the [64, 256] fp32 accumulator fits in registers without spills
(FlashMLA splits it across two warp groups of one CTA; Triton cannot share the logits between
warp groups, so the split is across programs). Empty slots (-1) are masked before the load
(never read as row 0); a row with no valid slot returns out = 0 and lse = -inf with no NaN.

Backward (one program per (head block of 64, column part, token), 32-key tiles): delta =
rowsum(dO * O) - dlse is computed in PyTorch; per key tile the logits and dP = dO V^T are formed
over all dims in 64-channel pieces (q and dO pieces stream from L2, nothing large stays in
registers), p is recomputed from the saved lse, dS = p (dP - delta) scale. Each of SPLIT = 2
parts owns half of the latent columns (part 0 also the rope columns): it accumulates its slice
of dq in registers (written once) and scatters its slice of dkv[idx] = dS^T q + p^T dO (latent)
and dS^T q_rope (rope) with fp32 atomic adds, because a key row is selected by many queries.
The summation order of those atomics is not deterministic; under
`torch.use_deterministic_algorithms(True)` the backward instead stages each contribution
(DETERMINISTIC=True: one add per address of a zeroed [head blocks, B, C, K, D] buffer, query
chunk by chunk)
and reduces them in a fixed order (head blocks summed in order, then `index_add_`, which is
deterministic on CUDA in that mode). Duplicated indices in a row add twice (as in the reference).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._triton_common import Launch, pow2

LOG2E = 1.4426950408889634


@triton.jit
def _sparse_mla_fwd_kernel(
    Q, KV, IDX, NSLOT, O, LSE,
    stride_qb, stride_qt, stride_qh,
    stride_kvb, stride_kvt,
    stride_ib, stride_it,
    stride_nb,
    stride_ob, stride_ot, stride_oh,
    stride_lb, stride_lt,
    H, scale_log2,
    D_V: tl.constexpr, D_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
    SPLIT_V: tl.constexpr,
):
    pid = tl.program_id(0)
    hb = pid // SPLIT_V
    sv = pid % SPLIT_V
    t = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    DVS: tl.constexpr = BLOCK_DV // SPLIT_V  # value columns owned by this program
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_dr = tl.arange(0, BLOCK_DR)
    mask_dr = offs_dr < D_R
    # the latent dims in two column sets: `own` (this program's value columns) and `rest`
    # (the other programs' columns; with SPLIT_V = 1 it is empty and masked off). The logits
    # need both, the value only `own`, so every gathered KV element is loaded once.
    offs_o = sv * DVS + tl.arange(0, DVS)
    offs_x = ((sv + 1) % SPLIT_V) * DVS + tl.arange(0, DVS)
    mask_o = offs_o < D_V
    mask_x = (offs_x < D_V) & (SPLIT_V == 2)

    q_ptrs = Q + b * stride_qb + t * stride_qt + offs_h[:, None] * stride_qh
    q_o = tl.load(q_ptrs + offs_o[None, :], mask=mask_h[:, None] & mask_o[None, :], other=0.0)
    q_x = tl.load(q_ptrs + offs_x[None, :], mask=mask_h[:, None] & mask_x[None, :], other=0.0)
    qr = tl.load(q_ptrs + D_V + offs_dr[None, :], mask=mask_h[:, None] & mask_dr[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, DVS], dtype=tl.float32)
    kv_base = KV + b * stride_kvb
    idx_base = IDX + b * stride_ib + t * stride_it
    n_slots = tl.load(NSLOT + b * stride_nb + t)  # slots after the last valid one are all -1
    for k0 in range(0, n_slots, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(idx_base + offs_k, mask=offs_k < n_slots, other=-1)
        valid = idx >= 0
        rows = kv_base + tl.where(valid, idx, 0).to(tl.int64)[:, None] * stride_kvt
        kv_o = tl.load(rows + offs_o[None, :], mask=valid[:, None] & mask_o[None, :], other=0.0)
        kv_x = tl.load(rows + offs_x[None, :], mask=valid[:, None] & mask_x[None, :], other=0.0)
        kvr = tl.load(rows + D_V + offs_dr[None, :], mask=valid[:, None] & mask_dr[None, :], other=0.0)
        s = tl.dot(q_o, tl.trans(kv_o)) + tl.dot(q_x, tl.trans(kv_x)) + tl.dot(qr, tl.trans(kvr))
        s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv_o.dtype), kv_o)
        m_i = m_new

    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    o_ptrs = O + b * stride_ob + t * stride_ot + offs_h[:, None] * stride_oh + offs_o[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=mask_h[:, None] & mask_o[None, :])
    if sv == 0:
        lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        tl.store(LSE + b * stride_lb + t * stride_lt + offs_h, lse, mask=mask_h)


@triton.jit
def _sparse_mla_bwd_kernel(
    Q, KV, IDX, NSLOT, DO, LSE, DELTA, DQ, DKV, STAGE,
    stride_qb, stride_qt, stride_qh,
    stride_kvb, stride_kvt,
    stride_ib, stride_it,
    stride_nb,
    stride_dob, stride_dot, stride_doh,
    stride_lb, stride_lt,
    stride_dkb, stride_dkt,
    stride_sh, stride_sb, stride_st, stride_sk,
    H, T0, scale, scale_log2,
    D_V: tl.constexpr, D_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
    BLOCK_D: tl.constexpr, SPLIT: tl.constexpr, DETERMINISTIC: tl.constexpr,
):
    pid = tl.program_id(0)
    hb = pid // SPLIT
    part = pid % SPLIT
    tc = tl.program_id(1).to(tl.int64)  # token within this launch's chunk [T0, T0 + grid)
    t = T0 + tc
    b = tl.program_id(2).to(tl.int64)
    DVS: tl.constexpr = BLOCK_DV // SPLIT  # latent columns of dq / dkv owned by this program
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_c = part * DVS + tl.arange(0, DVS)
    mask_c = offs_c < D_V
    offs_dr = tl.arange(0, BLOCK_DR)
    mask_dr = offs_dr < D_R
    offs_d = tl.arange(0, BLOCK_D)
    mch = mask_h[:, None] & mask_c[None, :]
    mrh = mask_h[:, None] & mask_dr[None, :]

    q_rows = Q + b * stride_qb + t * stride_qt + offs_h[:, None] * stride_qh
    do_rows = DO + b * stride_dob + t * stride_dot + offs_h[:, None] * stride_doh
    q_c = tl.load(q_rows + offs_c[None, :], mask=mch, other=0.0)  # [BLOCK_H, DVS]
    do_c = tl.load(do_rows + offs_c[None, :], mask=mch, other=0.0)
    qr = tl.load(q_rows + D_V + offs_dr[None, :], mask=mrh, other=0.0)
    stat = b * stride_lb + t * stride_lt + offs_h
    lse = tl.load(LSE + stat, mask=mask_h, other=float("-inf"))
    delta = tl.load(DELTA + stat, mask=mask_h, other=0.0)
    # p = exp2(s*log2e - lse*log2e); an empty (or padded) row has lse = -inf -> p = 0
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)

    dq_c = tl.zeros([BLOCK_H, DVS], dtype=tl.float32)
    dq_r = tl.zeros([BLOCK_H, BLOCK_DR], dtype=tl.float32)
    kv_base = KV + b * stride_kvb
    dkv_base = DKV + b * stride_dkb
    idx_base = IDX + b * stride_ib + t * stride_it
    n_slots = tl.load(NSLOT + b * stride_nb + t)
    for k0 in range(0, n_slots, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(idx_base + offs_k, mask=offs_k < n_slots, other=-1)
        valid = idx >= 0
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
        ds_c = ds.to(q_c.dtype)
        kv_c = tl.load(rows + offs_c[None, :], mask=valid[:, None] & mask_c[None, :], other=0.0)
        dq_c += tl.dot(ds_c, kv_c)
        dkv_c = tl.dot(tl.trans(ds_c), q_c) + tl.dot(tl.trans(p.to(do_c.dtype)), do_c)  # [BLOCK_K, DVS]
        if DETERMINISTIC:
            # this (head block, token, slot)'s own row of the zeroed stage: each address receives
            # exactly one add, so the value is exact and the order does not matter
            stage_tok = STAGE + hb * stride_sh + b * stride_sb + tc * stride_st  # scalar pointer
            drows = stage_tok + (offs_k * stride_sk)[:, None]  # int32 offsets: K * D < 2^31
        else:
            drows = dkv_base + tl.where(valid, idx, 0).to(tl.int64)[:, None] * stride_dkt
        tl.atomic_add(drows + offs_c[None, :], dkv_c, mask=valid[:, None] & mask_c[None, :], sem="relaxed")
        if part == 0:
            dq_r += tl.dot(ds_c, kvr)
            dkv_r = tl.dot(tl.trans(ds_c), qr)
            tl.atomic_add(drows + D_V + offs_dr[None, :], dkv_r, mask=valid[:, None] & mask_dr[None, :],
                          sem="relaxed")

    dq_rows = DQ + b * stride_qb + t * stride_qt + offs_h[:, None] * stride_qh
    tl.store(dq_rows + offs_c[None, :], dq_c.to(DQ.dtype.element_ty), mask=mch)
    if part == 0:
        tl.store(dq_rows + D_V + offs_dr[None, :], dq_r.to(DQ.dtype.element_ty), mask=mrh)


def slot_counts(indices: torch.Tensor) -> torch.Tensor:
    """[B, T, K] int -> [B, T] int32: 1 + the position of each row's last valid slot (0 if none).
    The kernels walk only these slots: a short row's -1 tail costs nothing."""
    K = indices.shape[-1]
    pos = torch.arange(1, K + 1, device=indices.device, dtype=torch.int32)
    return torch.where(indices >= 0, pos, 0).amax(dim=-1).to(torch.int32).contiguous()


def fwd_blocks(H: int, D_V: int, D_R: int) -> dict:
    block_dv = pow2(D_V)
    return dict(BLOCK_H=min(pow2(H), 64), BLOCK_K=64, BLOCK_DV=block_dv, BLOCK_DR=pow2(max(D_R, 1)),
                SPLIT_V=2 if block_dv >= 512 else 1)


def bwd_blocks(H: int, D_V: int, D_R: int, deterministic: bool = False) -> dict:
    block_dv = pow2(D_V)
    # deterministic: 16-key tiles (with 32 the stage addressing spilled 68-104 B in the compile report)
    return dict(BLOCK_H=min(pow2(H), 64), BLOCK_K=16 if deterministic else 32, BLOCK_DV=block_dv,
                BLOCK_DR=pow2(max(D_R, 1)), BLOCK_D=min(block_dv, 64), SPLIT=2 if block_dv >= 512 else 1)


def plan_fwd(q, kv, indices, n_slots, out, lse, scale: float, d_v: int) -> Launch:
    """The forward launch for q [B, T, H, D], kv [B, T, D], indices [B, T, K] int32, n_slots
    [B, T] int32 (`slot_counts`), out [B, T, H, d_v], lse [B, T, H] fp32."""
    B, T, H, D = q.shape
    blocks = fwd_blocks(H, d_v, D - d_v)
    return Launch(
        _sparse_mla_fwd_kernel, (triton.cdiv(H, blocks["BLOCK_H"]) * blocks["SPLIT_V"], T, B),
        dict(
            Q=q, KV=kv, IDX=indices, NSLOT=n_slots, O=out, LSE=lse,
            stride_qb=q.stride(0), stride_qt=q.stride(1), stride_qh=q.stride(2),
            stride_kvb=kv.stride(0), stride_kvt=kv.stride(1),
            stride_ib=indices.stride(0), stride_it=indices.stride(1),
            stride_nb=n_slots.stride(0),
            stride_ob=out.stride(0), stride_ot=out.stride(1), stride_oh=out.stride(2),
            stride_lb=lse.stride(0), stride_lt=lse.stride(1),
            H=H, scale_log2=scale * LOG2E,
            D_V=d_v, D_R=D - d_v, **blocks,
        ),
        # two stages: the 64-key tile of 576 dims (72 KB) double-buffered plus q fit in 227 KB
        num_warps=8 if blocks["BLOCK_DV"] >= 256 else 4, num_stages=2,
    )


def plan_bwd(q, kv, indices, n_slots, dout, lse, delta, dq, dkv, scale: float, d_v: int,
             t0: int = 0, n_tokens: int | None = None, stage=None) -> Launch:
    """The backward launch for tokens [t0, t0 + n_tokens): dq [B, T, H, D] (q's dtype) and either
    dkv [B, T, D] fp32 (zeroed, atomics) or, deterministic, stage [head blocks, B, C, K, D] fp32
    (C >= n_tokens, zeroed) receiving every (head block, token, slot)'s dkv contribution."""
    B, T, H, D = q.shape
    det = stage is not None
    blocks = bwd_blocks(H, d_v, D - d_v, det)
    st = stage if det else dkv
    return Launch(
        _sparse_mla_bwd_kernel, (triton.cdiv(H, blocks["BLOCK_H"]) * blocks["SPLIT"], T - t0 if n_tokens is None else n_tokens, B),
        dict(
            Q=q, KV=kv, IDX=indices, NSLOT=n_slots, DO=dout, LSE=lse, DELTA=delta, DQ=dq, DKV=dkv, STAGE=st,
            stride_qb=q.stride(0), stride_qt=q.stride(1), stride_qh=q.stride(2),
            stride_kvb=kv.stride(0), stride_kvt=kv.stride(1),
            stride_ib=indices.stride(0), stride_it=indices.stride(1),
            stride_nb=n_slots.stride(0),
            stride_dob=dout.stride(0), stride_dot=dout.stride(1), stride_doh=dout.stride(2),
            stride_lb=lse.stride(0), stride_lt=lse.stride(1),
            stride_dkb=dkv.stride(0), stride_dkt=dkv.stride(1),
            stride_sh=st.stride(0) if det else 0, stride_sb=st.stride(1) if det else 0,
            stride_st=st.stride(2) if det else 0, stride_sk=st.stride(3) if det else 0,
            H=H, T0=t0, scale=scale, scale_log2=scale * LOG2E,
            D_V=d_v, D_R=D - d_v, **blocks, DETERMINISTIC=det,
        ),
        num_warps=8 if blocks["BLOCK_DV"] >= 256 else 4,
    )


def sparse_mla_fwd(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, n_slots: torch.Tensor,
                   scale: float, d_v: int):
    B, T, H, D = q.shape
    out = torch.empty((B, T, H, d_v), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, T, H), dtype=torch.float32, device=q.device)
    if B * T == 0 or H == 0:
        return out, lse
    plan_fwd(q, kv, indices, n_slots, out, lse, scale, d_v).run()
    return out, lse


def sparse_mla_bwd(q, kv, indices, n_slots, out, lse, dout, dlse, scale: float, d_v: int):
    dout = dout.contiguous()
    delta = (dout.float() * out.float()).sum(-1)
    if dlse is not None:
        delta = delta - torch.where(torch.isfinite(lse), dlse.float(), torch.zeros_like(delta))
    delta = delta.contiguous()
    dq = torch.empty_like(q)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    if q.shape[0] * q.shape[1] == 0 or q.shape[2] == 0:
        return dq.zero_(), dkv.to(kv.dtype)
    if not torch.are_deterministic_algorithms_enabled():
        plan_bwd(q, kv, indices, n_slots, dout, lse, delta, dq, dkv, scale, d_v).run()
        return dq, dkv.to(kv.dtype)
    # deterministic: per query chunk, stage every contribution, sum the head blocks in order, then
    # index_add_ into dkv (deterministic on CUDA under torch.use_deterministic_algorithms), chunk
    # after chunk; slower and needs the stage buffer, but bitwise reproducible
    B, T, H, D = q.shape
    K = indices.shape[-1]
    n_hb = triton.cdiv(H, bwd_blocks(H, d_v, D - d_v)["BLOCK_H"])
    chunk = deterministic_chunk(B, T, K, D, n_hb)
    stage = torch.empty((n_hb, B, chunk, K, D), dtype=torch.float32, device=q.device)
    for t0 in range(0, T, chunk):
        c = min(chunk, T - t0)
        stage.zero_()
        plan_bwd(q, kv, indices, n_slots, dout, lse, delta, dq, dkv, scale, d_v, t0, c, stage).run()
        contrib = stage[:, :, :c].sum(0)  # [B, c, K, D]
        idx = indices[:, t0:t0 + c]
        for b in range(B):
            valid = idx[b] >= 0
            dkv[b].index_add_(0, idx[b][valid].long(), contrib[b][valid])
    return dq, dkv.to(kv.dtype)


DETERMINISTIC_STAGE_ELEMS = 1 << 26  # fp32 elements of the deterministic backward's stage (256 MB)


def deterministic_chunk(B: int, T: int, K: int, D: int, n_hb: int) -> int:
    """Query tokens per chunk of the deterministic backward (its stage is [n_hb, B, C, K, D])."""
    return max(1, min(T, DETERMINISTIC_STAGE_ELEMS // max(n_hb * B * K * D, 1)))
