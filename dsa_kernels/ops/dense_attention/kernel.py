"""Dense causal attention with packed-document masks: Triton forward and backward (flash-style).

Specification: `reference.dense_attention_ref`. MHA form: per-head q/k [B, T, H, D] and v
[B, T, H, DV] (MLA: D = 192 = 128 nope + 64 rope, DV = 128). The head dim is split into two
power-of-two parts, A = the first DA columns and B = the remaining DB (192 = 128 + 64), each
with its own tile and dot, so no padding to 256 is loaded or multiplied.

Forward, one program per (query block of BLOCK_M rows, batch x head): walk the key tiles of
BLOCK_N keys from the block's first document start to its last row, online softmax in the log2
domain (running max m, sum l), out = acc / l and lse = ln-domain log-sum-exp. Nothing of size
[T, T] exists; the output and lse are written once. Masked entries (s > t or s < doc_start[t])
get -inf logits; a row whose keys in a tile are all masked (the fully masked first block of a
packed document) keeps m = -inf, and m is replaced by 0 before subtracting, so no
exp(-inf - (-inf)) = NaN. A row with no visible key at all ends with l = 0: out = 0, lse = -inf.

Backward (FlashAttention-2): delta = rowsum(dO * O) is formed in PyTorch (a token chunk at a
time, `_triton_common.row_dot`); P is recomputed from the saved lse. dK/dV: one program per (key
block, batch x head) walks the query blocks from the key block's diagonal to the end of the last key's document (`doc_end`); every key row belongs to
one program, so dK/dV are written once, no atomics. dQ: one program per (query block, batch x
head) walks the key tiles as the forward does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._triton_common import Launch, interpreted, pow2

LOG2E = 1.4426950408889634


DELTA_CHUNK_ELEMS = 1 << 24  # fp32 elements of the backward's rowsum(dO * O) temporary (64 MB; `row_dot`)


@triton.jit
def _head_dim_offsets(DA: tl.constexpr, DB: tl.constexpr, DV: tl.constexpr,
                      BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Column offsets [BLOCK_DA], [BLOCK_DB], [BLOCK_DV] of the head dim's parts A, B and of v, and
    their masks (< DA, DB, DV) -> (offs_da, offs_db, offs_dv, mask_da, mask_db, mask_dv)."""
    offs_da = tl.arange(0, BLOCK_DA)
    offs_db = tl.arange(0, BLOCK_DB)
    offs_dv = tl.arange(0, BLOCK_DV)
    return offs_da, offs_db, offs_dv, offs_da < DA, offs_db < DB, offs_dv < DV


@triton.jit
def _dense_attn_fwd_kernel(
    Q, K, V, DS, O, LSE,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ob, stride_ot, stride_oh,
    stride_lb, stride_lt,
    stride_db,
    T, H, scale_log2,
    DA: tl.constexpr, DB: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < T
    offs_da, offs_db, offs_dv, mask_da, mask_db, mask_dv = _head_dim_offsets(DA, DB, DV, BLOCK_DA, BLOCK_DB, BLOCK_DV)

    ds = tl.load(DS + b * stride_db + offs_m, mask=mask_m, other=2147483647).to(tl.int32)
    lo = tl.min(ds, 0)  # first key any row of the block sees
    hi = tl.minimum(pid_m * BLOCK_M + BLOCK_M, T)  # causal: past the block's last row nothing
    start = (lo // BLOCK_N) * BLOCK_N

    q_rows = Q + b * stride_qb + h * stride_qh + offs_m[:, None].to(tl.int64) * stride_qt
    qa = tl.load(q_rows + offs_da[None, :], mask=mask_m[:, None] & mask_da[None, :], other=0.0)
    qb = tl.load(q_rows + DA + offs_db[None, :], mask=mask_m[:, None] & mask_db[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    k_head = K + b * stride_kb + h * stride_kh
    v_head = V + b * stride_vb + h * stride_vh
    for n0 in range(start, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < T
        k_rows = k_head + offs_n[:, None].to(tl.int64) * stride_kt
        ka = tl.load(k_rows + offs_da[None, :], mask=mask_n[:, None] & mask_da[None, :], other=0.0)
        kb = tl.load(k_rows + DA + offs_db[None, :], mask=mask_n[:, None] & mask_db[None, :], other=0.0)
        s = tl.dot(qa, tl.trans(ka)) + tl.dot(qb, tl.trans(kb))  # [BLOCK_M, BLOCK_N] fp32
        valid = (offs_n[None, :] <= offs_m[:, None]) & (offs_n[None, :] >= ds[:, None])
        s = tl.where(valid, s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked so far: no NaN
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + offs_n[:, None].to(tl.int64) * stride_vt + offs_dv[None, :],
                    mask=mask_n[:, None] & mask_dv[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    has = l_i > 0
    l_safe = tl.where(has, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(has, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))  # ln 2
    o_rows = O + b * stride_ob + h * stride_oh + offs_m[:, None].to(tl.int64) * stride_ot
    tl.store(o_rows + offs_dv[None, :], out.to(O.dtype.element_ty), mask=mask_m[:, None] & mask_dv[None, :])
    tl.store(LSE + b * stride_lb + h + offs_m.to(tl.int64) * stride_lt, lse, mask=mask_m)


@triton.jit
def _dense_attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DS, DE, DK, DV_,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_dob, stride_dot, stride_doh,
    stride_lb, stride_lt,
    stride_db,
    T, H, scale, scale_log2,
    DA: tl.constexpr, DB: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """dK, dV of one key block (and head): dK/dV have the layouts of K/V."""
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < T
    offs_da, offs_db, offs_dv, mask_da, mask_db, mask_dv = _head_dim_offsets(DA, DB, DV, BLOCK_DA, BLOCK_DB, BLOCK_DV)

    k_rows = K + b * stride_kb + h * stride_kh + offs_n[:, None].to(tl.int64) * stride_kt
    ka = tl.load(k_rows + offs_da[None, :], mask=mask_n[:, None] & mask_da[None, :], other=0.0)
    kb = tl.load(k_rows + DA + offs_db[None, :], mask=mask_n[:, None] & mask_db[None, :], other=0.0)
    v_rows = V + b * stride_vb + h * stride_vh + offs_n[:, None].to(tl.int64) * stride_vt
    v = tl.load(v_rows + offs_dv[None, :], mask=mask_n[:, None] & mask_dv[None, :], other=0.0)

    # queries that can see this block: from its first key (causal) to the end of its last key's document
    last_key = tl.minimum(pid_n * BLOCK_N + BLOCK_N, T) - 1
    hi = tl.load(DE + b * stride_db + last_key).to(tl.int32)
    start = ((pid_n * BLOCK_N) // BLOCK_M) * BLOCK_M

    dka = tl.zeros([BLOCK_N, BLOCK_DA], dtype=tl.float32)
    dkb = tl.zeros([BLOCK_N, BLOCK_DB], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    q_head = Q + b * stride_qb + h * stride_qh
    do_head = DO + b * stride_dob + h * stride_doh
    for m0 in range(start, hi, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < T
        q_rows = q_head + offs_m[:, None].to(tl.int64) * stride_qt
        qa = tl.load(q_rows + offs_da[None, :], mask=mask_m[:, None] & mask_da[None, :], other=0.0)
        qb = tl.load(q_rows + DA + offs_db[None, :], mask=mask_m[:, None] & mask_db[None, :], other=0.0)
        do = tl.load(do_head + offs_m[:, None].to(tl.int64) * stride_dot + offs_dv[None, :],
                     mask=mask_m[:, None] & mask_dv[None, :], other=0.0)
        row = b * stride_lb + h + offs_m.to(tl.int64) * stride_lt
        lse = tl.load(LSE + row, mask=mask_m, other=float("-inf"))
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)  # no key: P = 0
        delta = tl.load(DELTA + row, mask=mask_m, other=0.0)
        ds_m = tl.load(DS + b * stride_db + offs_m, mask=mask_m, other=2147483647).to(tl.int32)
        # transposed tiles [BLOCK_N, BLOCK_M]: the key block is the MMA's M side (64 rows, wgmma)
        s_t = tl.dot(ka, tl.trans(qa)) + tl.dot(kb, tl.trans(qb))
        valid = (offs_n[:, None] <= offs_m[None, :]) & (offs_n[:, None] >= ds_m[None, :])
        p_t = tl.where(valid, tl.exp2(s_t * scale_log2 - lse2[None, :]), 0.0)
        dv += tl.dot(p_t.to(do.dtype), do)
        dp_t = tl.dot(v, tl.trans(do))  # [BLOCK_N, BLOCK_M]
        ds_t = p_t * (dp_t - delta[None, :])
        dka += tl.dot(ds_t.to(qa.dtype), qa)
        dkb += tl.dot(ds_t.to(qb.dtype), qb)
    dk_rows = DK + b * stride_kb + h * stride_kh + offs_n[:, None].to(tl.int64) * stride_kt
    tl.store(dk_rows + offs_da[None, :], (dka * scale).to(DK.dtype.element_ty), mask=mask_n[:, None] & mask_da[None, :])
    tl.store(dk_rows + DA + offs_db[None, :], (dkb * scale).to(DK.dtype.element_ty),
             mask=mask_n[:, None] & mask_db[None, :])
    dv_rows = DV_ + b * stride_vb + h * stride_vh + offs_n[:, None].to(tl.int64) * stride_vt
    tl.store(dv_rows + offs_dv[None, :], dv.to(DV_.dtype.element_ty), mask=mask_n[:, None] & mask_dv[None, :])


@triton.jit
def _dense_attn_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DS, DQ,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_dob, stride_dot, stride_doh,
    stride_lb, stride_lt,
    stride_db,
    T, H, scale, scale_log2,
    DA: tl.constexpr, DB: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """dQ of one query block (and head): dQ has the layout of Q."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < T
    offs_da, offs_db, offs_dv, mask_da, mask_db, mask_dv = _head_dim_offsets(DA, DB, DV, BLOCK_DA, BLOCK_DB, BLOCK_DV)

    ds = tl.load(DS + b * stride_db + offs_m, mask=mask_m, other=2147483647).to(tl.int32)
    lo = tl.min(ds, 0)
    hi = tl.minimum(pid_m * BLOCK_M + BLOCK_M, T)
    start = (lo // BLOCK_N) * BLOCK_N

    q_rows = Q + b * stride_qb + h * stride_qh + offs_m[:, None].to(tl.int64) * stride_qt
    qa = tl.load(q_rows + offs_da[None, :], mask=mask_m[:, None] & mask_da[None, :], other=0.0)
    qb = tl.load(q_rows + DA + offs_db[None, :], mask=mask_m[:, None] & mask_db[None, :], other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None].to(tl.int64) * stride_dot + offs_dv[None, :],
                 mask=mask_m[:, None] & mask_dv[None, :], other=0.0)
    row = b * stride_lb + h + offs_m.to(tl.int64) * stride_lt
    lse = tl.load(LSE + row, mask=mask_m, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(DELTA + row, mask=mask_m, other=0.0)

    dqa = tl.zeros([BLOCK_M, BLOCK_DA], dtype=tl.float32)
    dqb = tl.zeros([BLOCK_M, BLOCK_DB], dtype=tl.float32)
    k_head = K + b * stride_kb + h * stride_kh
    v_head = V + b * stride_vb + h * stride_vh
    for n0 in range(start, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < T
        k_rows = k_head + offs_n[:, None].to(tl.int64) * stride_kt
        ka = tl.load(k_rows + offs_da[None, :], mask=mask_n[:, None] & mask_da[None, :], other=0.0)
        kb = tl.load(k_rows + DA + offs_db[None, :], mask=mask_n[:, None] & mask_db[None, :], other=0.0)
        v = tl.load(v_head + offs_n[:, None].to(tl.int64) * stride_vt + offs_dv[None, :],
                    mask=mask_n[:, None] & mask_dv[None, :], other=0.0)
        s = tl.dot(qa, tl.trans(ka)) + tl.dot(qb, tl.trans(kb))
        valid = (offs_n[None, :] <= offs_m[:, None]) & (offs_n[None, :] >= ds[:, None])
        p = tl.where(valid, tl.exp2(s * scale_log2 - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v))
        dsc = p * (dp - delta[:, None])
        dqa += tl.dot(dsc.to(ka.dtype), ka)
        dqb += tl.dot(dsc.to(kb.dtype), kb)
    dq_rows = DQ + b * stride_qb + h * stride_qh + offs_m[:, None].to(tl.int64) * stride_qt
    tl.store(dq_rows + offs_da[None, :], (dqa * scale).to(DQ.dtype.element_ty), mask=mask_m[:, None] & mask_da[None, :])
    tl.store(dq_rows + DA + offs_db[None, :], (dqb * scale).to(DQ.dtype.element_ty),
             mask=mask_m[:, None] & mask_db[None, :])


# ----------------------------------------------------------------------------- launch plans
def split_head_dim(D: int) -> tuple[int, int]:
    """D = DA + DB with DA the largest power of two <= D (192 -> 128 + 64; 576 -> 512 + 64);
    below 16 one part only (tl.dot needs tiles of at least 16)."""
    da = 1 << (D.bit_length() - 1)
    if da < 16:
        da = D
    return da, D - da


def fwd_blocks(D: int, DV: int) -> dict:
    if interpreted():  # small tiles: several key blocks per row (and fully masked ones) at test shapes
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=None)
    return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2)


def bwd_blocks(D: int, DV: int) -> dict:
    """dK/dV: 64 keys x 32 queries per step (the fp32 dK [64, 192] and dV [64, 128] accumulators
    stay in registers); dQ: 64 queries x 64 keys."""
    if interpreted():
        return dict(dkdv=dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=None),
                    dq=dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=None))
    return dict(dkdv=dict(BLOCK_M=32, BLOCK_N=64, num_warps=8, num_stages=2),
                dq=dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2))


def _dims(D: int, DV: int) -> dict:
    da, db = split_head_dim(D)
    return dict(DA=da, DB=db, DV=DV, BLOCK_DA=pow2(da), BLOCK_DB=pow2(db), BLOCK_DV=pow2(DV))


def _qkv_strides(q, k, v) -> dict:
    return dict(
        stride_qb=q.stride(0), stride_qt=q.stride(1), stride_qh=q.stride(2),
        stride_kb=k.stride(0), stride_kt=k.stride(1), stride_kh=k.stride(2),
        stride_vb=v.stride(0), stride_vt=v.stride(1), stride_vh=v.stride(2),
    )


def plan_fwd(q, k, v, ds, out, lse, scale: float) -> Launch:
    """q, k [B, T, H, D], v [B, T, H, DV] (last dim contiguous), ds [B, T] int32
    -> out [B, T, H, DV] (q's dtype), lse [B, T, H] fp32 (contiguous)."""
    B, T, H, D = q.shape
    DV = v.shape[-1]
    cfg = fwd_blocks(D, DV)
    return Launch(
        _dense_attn_fwd_kernel, (triton.cdiv(T, cfg["BLOCK_M"]), B * H),
        dict(
            Q=q, K=k, V=v, DS=ds, O=out, LSE=lse, **_qkv_strides(q, k, v),
            stride_ob=out.stride(0), stride_ot=out.stride(1), stride_oh=out.stride(2),
            stride_lb=lse.stride(0), stride_lt=lse.stride(1), stride_db=ds.stride(0),
            T=T, H=H, scale_log2=scale * LOG2E, **_dims(D, DV),
            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        ),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def plan_bwd(q, k, v, dout, lse, delta, ds, de, dq, dk, dv, scale: float) -> list[Launch]:
    """The two backward launches (dK/dV, then dQ). dout [B, T, H, DV] with q's strides pattern,
    lse / delta [B, T, H] fp32, ds / de [B, T] int32 (document start / end), dq / dk / dv like
    q / k / v (same strides)."""
    B, T, H, D = q.shape
    DV = v.shape[-1]
    cfg = bwd_blocks(D, DV)
    common = dict(
        Q=q, K=k, V=v, DO=dout, LSE=lse, DELTA=delta, DS=ds, **_qkv_strides(q, k, v),
        stride_dob=dout.stride(0), stride_dot=dout.stride(1), stride_doh=dout.stride(2),
        stride_lb=lse.stride(0), stride_lt=lse.stride(1), stride_db=ds.stride(0),
        T=T, H=H, scale=scale, scale_log2=scale * LOG2E, **_dims(D, DV),
    )
    a, c = cfg["dkdv"], cfg["dq"]
    dkdv = Launch(_dense_attn_bwd_dkdv_kernel, (triton.cdiv(T, a["BLOCK_N"]), B * H),
                  dict(common, DE=de, DK=dk, DV_=dv, BLOCK_M=a["BLOCK_M"], BLOCK_N=a["BLOCK_N"]),
                  num_warps=a["num_warps"], num_stages=a["num_stages"])
    dq_launch = Launch(_dense_attn_bwd_dq_kernel, (triton.cdiv(T, c["BLOCK_M"]), B * H),
                       dict(common, DQ=dq, BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"]),
                       num_warps=c["num_warps"], num_stages=c["num_stages"])
    return [dkdv, dq_launch]


def doc_ends(doc_start: torch.Tensor) -> torch.Tensor:
    """[B, T] document start of each token -> [B, T] one past the last token of its document."""
    B, T = doc_start.shape
    idx = torch.arange(T, device=doc_start.device).expand(B, T)
    starts = torch.where(doc_start == idx, idx, torch.full_like(idx, T))  # T where not a start
    nxt = torch.cat([starts[:, 1:], torch.full_like(starts[:, :1], T)], dim=1)  # a start after t
    return torch.flip(torch.cummin(torch.flip(nxt, [1]), dim=1).values, [1])
