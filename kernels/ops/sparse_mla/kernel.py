"""Sparse MLA (MQA / absorbed mode) over top-k indices: Triton forward and backward.

Specification: `sparse_mla.sparse_mla_ref`. For query token t and a block of BLOCK_H heads, one
program walks the K selected slots in tiles of BLOCK_K: it gathers the selected rows of the
shared 576-dim key `kv[idx] = [latent | k_rope]` once for all heads of the block (the MQA saving),
computes the logits with two dots (latent part D_V and rope part D_R), and keeps an online
softmax (running max / sum in the log2 domain). The value is the latent part of the same rows,
so a gathered tile is used for both the scores and the output. Empty slots (-1) are masked
before the load (never read as row 0); a row whose slots are all empty returns out = 0 and
lse = -inf with no NaN (the running max stays -inf and is replaced by 0 before subtracting).

Backward (FlashAttention-2 style, one program per (t, head block)): delta = rowsum(dO * O)
- dlse is computed in PyTorch, the probabilities are recomputed from the saved lse, dq is
accumulated in registers and written once, and the key/value gradient of each selected row
(latent and k_rope parts of the one 576-dim dkv) is scattered with fp32 atomic adds, because a
key row is selected by many queries. Duplicated indices in a row simply add twice (as in the
reference).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._triton_common import Launch, pow2

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _sparse_mla_fwd_kernel(
    Q, KV, IDX, O, LSE,
    stride_qb, stride_qt, stride_qh,
    stride_kvb, stride_kvt,
    stride_ib, stride_it,
    stride_ob, stride_ot, stride_oh,
    stride_lb, stride_lt,
    H, K, scale_log2,
    D_V: tl.constexpr, D_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
):
    t = tl.program_id(0)
    b = tl.program_id(1)
    hb = tl.program_id(2)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_dr = tl.arange(0, BLOCK_DR)
    mask_dv = offs_dv < D_V
    mask_dr = offs_dr < D_R

    q_ptrs = Q + b.to(tl.int64) * stride_qb + t.to(tl.int64) * stride_qt + offs_h[:, None] * stride_qh
    qv = tl.load(q_ptrs + offs_dv[None, :], mask=mask_h[:, None] & mask_dv[None, :], other=0.0)
    qr = tl.load(q_ptrs + D_V + offs_dr[None, :], mask=mask_h[:, None] & mask_dr[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    kv_base = KV + b.to(tl.int64) * stride_kvb
    idx_base = IDX + b.to(tl.int64) * stride_ib + t.to(tl.int64) * stride_it
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(idx_base + offs_k, mask=offs_k < K, other=-1)
        valid = idx >= 0
        rows = kv_base + tl.where(valid, idx, 0).to(tl.int64)[:, None] * stride_kvt
        kvv = tl.load(rows + offs_dv[None, :], mask=valid[:, None] & mask_dv[None, :], other=0.0)
        kvr = tl.load(rows + D_V + offs_dr[None, :], mask=valid[:, None] & mask_dr[None, :], other=0.0)
        s = tl.dot(qv, tl.trans(kvv)) + tl.dot(qr, tl.trans(kvr))
        s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kvv.dtype), kvv)
        m_i = m_new

    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    o_ptrs = O + b.to(tl.int64) * stride_ob + t.to(tl.int64) * stride_ot + offs_h[:, None] * stride_oh + offs_dv[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=mask_h[:, None] & mask_dv[None, :])
    tl.store(LSE + b.to(tl.int64) * stride_lb + t.to(tl.int64) * stride_lt + offs_h, lse, mask=mask_h)


@triton.jit
def _sparse_mla_bwd_kernel(
    Q, KV, IDX, DO, LSE, DELTA, DQ, DKV,
    stride_qb, stride_qt, stride_qh,
    stride_kvb, stride_kvt,
    stride_ib, stride_it,
    stride_dob, stride_dot, stride_doh,
    stride_lb, stride_lt,
    stride_dkb, stride_dkt,
    H, K, scale, scale_log2,
    D_V: tl.constexpr, D_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
):
    t = tl.program_id(0)
    b = tl.program_id(1)
    hb = tl.program_id(2)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_dr = tl.arange(0, BLOCK_DR)
    mask_dv = offs_dv < D_V
    mask_dr = offs_dr < D_R
    mvh = mask_h[:, None] & mask_dv[None, :]
    mrh = mask_h[:, None] & mask_dr[None, :]

    row_q = b.to(tl.int64) * stride_qb + t.to(tl.int64) * stride_qt + offs_h[:, None] * stride_qh
    qv = tl.load(Q + row_q + offs_dv[None, :], mask=mvh, other=0.0)
    qr = tl.load(Q + row_q + D_V + offs_dr[None, :], mask=mrh, other=0.0)
    do_ptrs = DO + b.to(tl.int64) * stride_dob + t.to(tl.int64) * stride_dot + offs_h[:, None] * stride_doh
    do = tl.load(do_ptrs + offs_dv[None, :], mask=mvh, other=0.0)
    stat = b.to(tl.int64) * stride_lb + t.to(tl.int64) * stride_lt + offs_h
    lse = tl.load(LSE + stat, mask=mask_h, other=float("-inf"))
    delta = tl.load(DELTA + stat, mask=mask_h, other=0.0)
    # p = exp2(s*log2e - lse*log2e); an empty (or padded) row has lse = -inf -> p = 0
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)

    dqv = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    dqr = tl.zeros([BLOCK_H, BLOCK_DR], dtype=tl.float32)
    kv_base = KV + b.to(tl.int64) * stride_kvb
    dkv_base = DKV + b.to(tl.int64) * stride_dkb
    idx_base = IDX + b.to(tl.int64) * stride_ib + t.to(tl.int64) * stride_it
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(idx_base + offs_k, mask=offs_k < K, other=-1)
        valid = idx >= 0
        safe = tl.where(valid, idx, 0).to(tl.int64)
        rows = kv_base + safe[:, None] * stride_kvt
        mv = valid[:, None] & mask_dv[None, :]
        mr = valid[:, None] & mask_dr[None, :]
        kvv = tl.load(rows + offs_dv[None, :], mask=mv, other=0.0)
        kvr = tl.load(rows + D_V + offs_dr[None, :], mask=mr, other=0.0)
        s = (tl.dot(qv, tl.trans(kvv)) + tl.dot(qr, tl.trans(kvr))) * scale_log2
        p = tl.exp2(s - lse2[:, None])
        p = tl.where(valid[None, :], p, 0.0)
        dp = tl.dot(do, tl.trans(kvv))
        ds = p * (dp - delta[:, None]) * scale  # d loss / d logit (unscaled q.k)
        ds_c = ds.to(qv.dtype)
        dqv += tl.dot(ds_c, kvv)
        dqr += tl.dot(ds_c, kvr)
        dkvv = tl.dot(tl.trans(ds_c), qv) + tl.dot(tl.trans(p.to(do.dtype)), do)
        dkvr = tl.dot(tl.trans(ds_c), qr)
        drows = dkv_base + safe[:, None] * stride_dkt
        tl.atomic_add(drows + offs_dv[None, :], dkvv, mask=mv)
        tl.atomic_add(drows + D_V + offs_dr[None, :], dkvr, mask=mr)

    dq_row = b.to(tl.int64) * stride_qb + t.to(tl.int64) * stride_qt + offs_h[:, None] * stride_qh
    tl.store(DQ + dq_row + offs_dv[None, :], dqv.to(DQ.dtype.element_ty), mask=mvh)
    tl.store(DQ + dq_row + D_V + offs_dr[None, :], dqr.to(DQ.dtype.element_ty), mask=mrh)


def _blocks(H: int, D_V: int, D_R: int, K: int):
    block_h = min(pow2(H), 64)
    block_k = min(pow2(K), 32 if D_V >= 256 else 64)
    return block_h, block_k, pow2(D_V), pow2(max(D_R, 1))


def plan_fwd(q, kv, indices, out, lse, scale: float, d_v: int) -> Launch:
    """The forward launch for q [B, T, H, D], kv [B, T, D], indices [B, T, K] int32,
    out [B, T, H, d_v], lse [B, T, H] fp32."""
    B, T, H, D = q.shape
    K = indices.shape[-1]
    block_h, block_k, block_dv, block_dr = _blocks(H, d_v, D - d_v, K)
    return Launch(
        _sparse_mla_fwd_kernel, (T, B, triton.cdiv(H, block_h)),
        dict(
            Q=q, KV=kv, IDX=indices, O=out, LSE=lse,
            stride_qb=q.stride(0), stride_qt=q.stride(1), stride_qh=q.stride(2),
            stride_kvb=kv.stride(0), stride_kvt=kv.stride(1),
            stride_ib=indices.stride(0), stride_it=indices.stride(1),
            stride_ob=out.stride(0), stride_ot=out.stride(1), stride_oh=out.stride(2),
            stride_lb=lse.stride(0), stride_lt=lse.stride(1),
            H=H, K=K, scale_log2=scale * LOG2E,
            D_V=d_v, D_R=D - d_v,
            BLOCK_H=block_h, BLOCK_K=block_k, BLOCK_DV=block_dv, BLOCK_DR=block_dr,
        ),
        num_warps=8 if block_dv >= 256 else 4,
    )


def plan_bwd(q, kv, indices, dout, lse, delta, dq, dkv, scale: float, d_v: int) -> Launch:
    """The backward launch: dq [B, T, H, D] (q's dtype), dkv [B, T, D] fp32 (zeroed, atomics)."""
    B, T, H, D = q.shape
    K = indices.shape[-1]
    block_h, block_k, block_dv, block_dr = _blocks(H, d_v, D - d_v, K)
    return Launch(
        _sparse_mla_bwd_kernel, (T, B, triton.cdiv(H, block_h)),
        dict(
            Q=q, KV=kv, IDX=indices, DO=dout, LSE=lse, DELTA=delta, DQ=dq, DKV=dkv,
            stride_qb=q.stride(0), stride_qt=q.stride(1), stride_qh=q.stride(2),
            stride_kvb=kv.stride(0), stride_kvt=kv.stride(1),
            stride_ib=indices.stride(0), stride_it=indices.stride(1),
            stride_dob=dout.stride(0), stride_dot=dout.stride(1), stride_doh=dout.stride(2),
            stride_lb=lse.stride(0), stride_lt=lse.stride(1),
            stride_dkb=dkv.stride(0), stride_dkt=dkv.stride(1),
            H=H, K=K, scale=scale, scale_log2=scale * LOG2E,
            D_V=d_v, D_R=D - d_v,
            BLOCK_H=block_h, BLOCK_K=block_k, BLOCK_DV=block_dv, BLOCK_DR=block_dr,
        ),
        num_warps=8 if block_dv >= 256 else 4,
    )


def sparse_mla_fwd(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float, d_v: int):
    B, T, H, D = q.shape
    out = torch.empty((B, T, H, d_v), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, T, H), dtype=torch.float32, device=q.device)
    if B * T == 0 or H == 0:
        return out, lse
    plan_fwd(q, kv, indices, out, lse, scale, d_v).run()
    return out, lse


def sparse_mla_bwd(q, kv, indices, out, lse, dout, dlse, scale: float, d_v: int):
    dout = dout.contiguous()
    delta = (dout.float() * out.float()).sum(-1)
    if dlse is not None:
        delta = delta - torch.where(torch.isfinite(lse), dlse.float(), torch.zeros_like(delta))
    delta = delta.contiguous()
    dq = torch.empty_like(q)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    if q.shape[0] * q.shape[1] == 0 or q.shape[2] == 0:
        return dq.zero_(), dkv.to(kv.dtype)
    plan_bwd(q, kv, indices, dout, lse, delta, dq, dkv, scale, d_v).run()
    return dq, dkv.to(kv.dtype)
