"""Eq. 3 (the dense warm-up's KL) in one fused pass (issue 32 item 5): value and gradients together.

Specification: `reference.dense_indexer_kl_ref` (with `lse_main`). For a query row t with the
target p[t, s] = (1/H) sum_h exp(scale q_h . k_h[s] - lse_h[t]) over its valid keys s (causal,
same packed document; `lse_main` from the main attention's forward) and the indexer scores
I[t, s] = sum_j w_j ReLU(q_I,j . k_I[s]):

    KL[t]     = sum_{p>0} p (log p - I) + P lse_I[t],      P = sum_s p,  lse_I = logsumexp_s I
    dKL/dI    = P softmax(I) - p

Schedule (`plan_fused_dense_kl`; two launches, the main scores formed once):
1. `_indexer_lse_kernel`, the cheap pre-pass: per block of 64 query rows, the indexer scores over
   the row's keys (64-key tiles, one [64, 128] x [128, 64] dot per indexer head) and their online
   logsumexp -> lse_I [B, T]. Only the indexer's products: 2 H_I d_I FLOPs per (query, key) pair.
2. `_dense_kl_fused_kernel`, per block of 64 query rows, each key tile streamed once for all
   heads: the target tile p from every main head's q k^T and the attention's lse (tensor cores,
   D split in 64-wide dots), the indexer score tile I (per indexer head one dot; its pre-ReLU
   tile a_j is kept in a per-program scratch, the compute dtype, [H_I, 64, 32]: 256 KB in bf16,
   L2-resident), the row statistics (sum p log p, sum p I, P, valid keys) and, once I is known,
   g = softmax(I) - p on the tile (P taken as 1: exactly 1 when lse_main is the log-sum-exp of
   these scores; the value uses the measured P, reported as `p_sum`), then per indexer head, from
   a_j read back: dw (the program's own rows), dq_I += (w_j g [a_j > 0]) k_I (atomic adds into the
   program's own rows) and dk_I^T += q_I,j^T (w_j g [a_j > 0]) (M = d_I = 128, one atomic add per
   key tile). No [T, T] buffer: the scratch is per program (launches chunked so it stays <= 128 MB).
   Recomputing a_j instead of keeping it would issue one more indexer product per pair (1.33x in
   the MHA form, over the budget below) and spilled 44 B under Triton 3.9 (sm_90a): not kept.

Issued FLOPs per (query, key) pair (padding aside), the analysis column's formula:
    fused = 2 H D  +  2 H_I d_I x (1 pre-pass + 1 scores + 2 gradients)
    one pass of the main scores plus the indexer's products (useful) = 2 (H D + 3 H_I d_I)
MHA form (H = 128, D = 192, H_I = 64, d_I = 128): 1.17x; MQA (D = 576): 1.08x.
The split path (`kernel.py`: statistics forward + gradient-only backward, two passes of the main
scores, three under the dense-lse pass) issues 2 x (2 H D + 4 H_I d_I) over the step: 1.67x (MHA).

Unmeasured on a GPU: the split path stays the default; `DSA_DENSE_KL=fused` selects this one
(`dense_kl_impl`; `fused-keep` also hands the gradients to a checkpoint's recompute, so it runs no
KL), and `dsa-train gpu-check --only speed.warmup_layer` times both against SDPA.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..._triton_common import Launch, pow2
from .kernel import (LOG2E, _kl_sums_step, _kl_values, _online_lse_step, _query_block, _target_tile,
                     dense_kl_buffers, dense_kl_inputs, dense_kl_strides, plan_dense_lse)

SCRATCH_ELEMS = 1 << 26  # elements of the per-program a_j scratch per launch (128 MB in bf16)


DENSE_KL_IMPLS = ("split", "fused", "fused-keep")


def dense_kl_impl() -> str:
    """`DSA_DENSE_KL`: "split" (default: `kernel.py`'s statistics forward + gradient-only backward),
    "fused" (this module: value and gradients in one pass, unmeasured on a GPU) or "fused-keep"
    (the same, and a checkpoint's recompute reuses the forward's gradients, handed back through
    `row_stats`, instead of running the fused pass again: one pass per step under `recompute` too,
    for the gradients' memory, H_I d_I + d_I + H_I values per token in the inputs' dtypes, kept from
    the forward to the backward)."""
    value = os.environ.get("DSA_DENSE_KL", "split").strip().lower()
    if value not in DENSE_KL_IMPLS:
        raise ValueError(f"DSA_DENSE_KL must be one of {', '.join(DENSE_KL_IMPLS)}; got {value!r}")
    return value


@triton.jit
def _indexer_lse_kernel(
    QI, KI, WI, DS, LSEI,
    stride_qib, stride_qit, stride_qih,
    stride_kib, stride_kit,
    stride_wib, stride_wit,
    stride_db,
    T, Q0, N_KEYS, HI,
    DI: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DI: tl.constexpr,
):
    """lse_I[b, t] = logsumexp_s sum_j w[t, j] ReLU(q_I[t, j] . k_I[s]) over doc_start[Q0 + t] <= s
    <= Q0 + t (natural log; 0 for a row without keys) for BLOCK_M query rows."""
    pid_m = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_m, mask_m, ds, start, hi = _query_block(DS, b, pid_m, stride_db, T, Q0, BLOCK_M, BLOCK_N)
    offs_di = tl.arange(0, BLOCK_DI)
    mask_di = offs_di < DI
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for n0 in range(start, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        ki = tl.load(KI + b * stride_kib + offs_n[:, None].to(tl.int64) * stride_kit + offs_di[None, :],
                     mask=(offs_n < N_KEYS)[:, None] & mask_di[None, :], other=0.0)
        sc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for j in range(HI):
            qi = tl.load(QI + b * stride_qib + offs_m[:, None].to(tl.int64) * stride_qit + j * stride_qih
                         + offs_di[None, :], mask=mask_m[:, None] & mask_di[None, :], other=0.0)
            wj = tl.load(WI + b * stride_wib + offs_m.to(tl.int64) * stride_wit + j, mask=mask_m, other=0.0)
            sc += wj.to(tl.float32)[:, None] * tl.maximum(tl.dot(qi, tl.trans(ki)), 0.0)
        valid = (offs_n[None, :] <= (Q0 + offs_m)[:, None]) & (offs_n[None, :] >= ds[:, None]) & mask_m[:, None]
        sc = tl.where(valid, sc, float("-inf"))
        m_i, l_i = _online_lse_step(m_i, l_i, sc, 1)
    lse_i = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), 0.0)
    tl.store(LSEI + b * T + offs_m, lse_i, mask=mask_m)


@triton.jit
def _dense_kl_fused_kernel(
    QM, KM, QI, KI, WI, DS, LSE2, LSEI, SCR,
    KL, KLU, PSUM, DQI, DKI, DWI,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_qib, stride_qit, stride_qih,
    stride_kib, stride_kit,
    stride_wib, stride_wit,
    stride_db,
    BLK0, T, Q0, N_KEYS, H, HI, scale_log2, inv_h,
    D: tl.constexpr, DI: tl.constexpr, GRAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DI: tl.constexpr,
):
    """Query rows of block BLK0 + program (positions Q0 + row) over key rows [0, N_KEYS): the KL
    value, KL to uniform and target mass of every row and, with GRAD, dq_I, dk_I (atomic adds), dw
    (read-modify-write of the program's own rows), from lse_I (LSEI, the pre-pass) and the main
    attention's lse (LSE2, log2 domain, [B, H, T]; +inf = a row without keys). SCR: this program's
    [HI, BLOCK_M, BLOCK_N] scratch for the indexer's pre-ReLU tiles (with GRAD)."""
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    pid_m = BLK0 + pid
    offs_m, mask_m, ds, start, hi = _query_block(DS, b, pid_m, stride_db, T, Q0, BLOCK_M, BLOCK_N)
    offs_di = tl.arange(0, BLOCK_DI)
    mask_di = offs_di < DI
    rows_mask = mask_m[:, None] & mask_di[None, :]
    offs_tile = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    scr = SCR + (b * tl.num_programs(0) + pid).to(tl.int64) * HI * BLOCK_M * BLOCK_N
    lse_i = tl.load(LSEI + b * T + offs_m, mask=mask_m, other=0.0)
    # P = 1 for a row that has keys (a finite lse of some head), 0 otherwise
    p_norm = tl.zeros([BLOCK_M], dtype=tl.float32)
    for h in range(H):
        lse_h = tl.load(LSE2 + (b * H + h) * T + offs_m, mask=mask_m, other=float("inf"))
        p_norm = tl.where(lse_h < float("inf"), 1.0, p_norm)

    a_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    p_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    n_valid = tl.zeros([BLOCK_M], dtype=tl.int32)
    for n0 in range(start, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N_KEYS
        valid = (offs_n[None, :] <= (Q0 + offs_m)[:, None]) & (offs_n[None, :] >= ds[:, None]) & mask_m[:, None]
        # the target tile: every main head's scores against this key tile, once
        p = _target_tile(QM, KM, LSE2, b, offs_m, mask_m, offs_n, mask_n, valid,
                         stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                         T, H, scale_log2, inv_h, D, BLOCK_M, BLOCK_N, BLOCK_D)
        # the indexer score tile; each head's pre-ReLU tile kept for the gradient
        ki = tl.load(KI + b * stride_kib + offs_n[:, None].to(tl.int64) * stride_kit + offs_di[None, :],
                     mask=mask_n[:, None] & mask_di[None, :], other=0.0)
        sc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for j in range(HI):
            qi = tl.load(QI + b * stride_qib + offs_m[:, None].to(tl.int64) * stride_qit + j * stride_qih
                         + offs_di[None, :], mask=rows_mask, other=0.0)
            wj = tl.load(WI + b * stride_wib + offs_m.to(tl.int64) * stride_wit + j, mask=mask_m, other=0.0)
            a = tl.dot(qi, tl.trans(ki))
            if GRAD:
                tl.store(scr + j * BLOCK_M * BLOCK_N + offs_tile, a.to(SCR.dtype.element_ty))
            sc += wj.to(tl.float32)[:, None] * tl.maximum(a, 0.0)
        sc = tl.where(valid, sc, float("-inf"))
        a_sum, b_sum, p_sum, n_valid = _kl_sums_step(a_sum, b_sum, p_sum, n_valid, p, sc, valid, 1)
        if GRAD:
            g = tl.where(valid, p_norm[:, None] * tl.exp(sc - lse_i[:, None]) - p, 0.0)  # dKL / dI
            tl.debug_barrier()  # the scratch tiles, stored by other threads, are visible
            dk_t = tl.zeros([BLOCK_DI, BLOCK_N], dtype=tl.float32)  # dk_I of the key tile, transposed
            for j in range(HI):
                qi = tl.load(QI + b * stride_qib + offs_m[:, None].to(tl.int64) * stride_qit + j * stride_qih
                             + offs_di[None, :], mask=rows_mask, other=0.0)
                wj = tl.load(WI + b * stride_wib + offs_m.to(tl.int64) * stride_wit + j, mask=mask_m, other=0.0)
                a = tl.load(scr + j * BLOCK_M * BLOCK_N + offs_tile).to(tl.float32)
                dw_ptrs = DWI + (b * T + offs_m) * HI + j
                dw_old = tl.load(dw_ptrs, mask=mask_m, other=0.0)
                tl.store(dw_ptrs, dw_old + tl.sum(g * tl.maximum(a, 0.0), 1), mask=mask_m)
                da = tl.where(a > 0, g * wj.to(tl.float32)[:, None], 0.0).to(ki.dtype)
                tl.atomic_add(DQI + ((b * T + offs_m[:, None]) * HI + j) * DI + offs_di[None, :],
                              tl.dot(da, ki, input_precision="ieee"), mask=rows_mask, sem="relaxed")
                dk_t += tl.dot(tl.trans(qi), da, input_precision="ieee")
            tl.atomic_add(DKI + (b * N_KEYS + offs_n[None, :].to(tl.int64)) * DI + offs_di[:, None], dk_t,
                          mask=mask_n[None, :] & mask_di[:, None], sem="relaxed")
            tl.debug_barrier()  # every thread has read the scratch before the next tile overwrites it

    kl, klu = _kl_values(a_sum, b_sum, p_sum, n_valid, lse_i)
    tl.store(KL + b * T + offs_m, kl, mask=mask_m)
    tl.store(KLU + b * T + offs_m, klu, mask=mask_m)
    tl.store(PSUM + b * T + offs_m, p_sum, mask=mask_m)


# ----------------------------------------------------------------------------- launch plans
def fused_blocks(T: int, D: int) -> dict:
    """`_dense_kl_fused_kernel`'s tiles: 64 query rows (the M side of the wgmma), 32-key tiles,
    D in 64-wide slices (192 = 3 x 64, 576 = 9 x 64), 8 warps, 1 stage (as `kernel.dense_blocks`)."""
    return dict(BLOCK_M=min(pow2(T), 64), BLOCK_N=min(pow2(T), 32), BLOCK_D=min(pow2(D), 64))


def plan_indexer_lse(qi, ki, wi, ds, lse_i, q0: int = 0) -> Launch:
    """qi [B, T, H_I, D_I] (query rows at positions q0 + row), ki [B, N, D_I], wi [B, T, H_I] fp32,
    ds [B, N] -> lse_i [B, T] fp32 (natural log)."""
    B, T, HI, DI = qi.shape
    block_m, block_n = min(pow2(T), 64), min(pow2(T), 64)
    return Launch(
        _indexer_lse_kernel, (triton.cdiv(T, block_m), B),
        dict(QI=qi, KI=ki, WI=wi, DS=ds, LSEI=lse_i,
             stride_qib=qi.stride(0), stride_qit=qi.stride(1), stride_qih=qi.stride(2),
             stride_kib=ki.stride(0), stride_kit=ki.stride(1),
             stride_wib=wi.stride(0), stride_wit=wi.stride(1),
             stride_db=ds.stride(0),
             T=T, Q0=q0, N_KEYS=ki.shape[1], HI=HI,
             DI=DI, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_DI=pow2(DI)),
        num_warps=8, num_stages=1,
    )


def fused_chunk_blocks(B: int, HI: int, blocks: dict) -> int:
    """Query blocks per launch of the fused kernel: its a_j scratch, B x blocks x [HI, M, N],
    stays within SCRATCH_ELEMS."""
    per_block = B * HI * blocks["BLOCK_M"] * blocks["BLOCK_N"]
    return max(1, SCRATCH_ELEMS // max(per_block, 1))


def plan_fused_dense_kl(qm, km, qi, ki, wi, ds, lse2, lse_i, scratch, kl, klu, p_sum, dq, dk, dw, scale: float,
                        grad: bool, q0: int = 0, blk0: int = 0, n_blocks: int | None = None) -> Launch:
    """Query blocks [blk0, blk0 + n_blocks) of the T query rows (qm [B, T, H, D], qi, wi, lse2
    [B, H, T] log2 domain, lse_i [B, T] from `plan_indexer_lse`) at positions q0 + row over the N
    key rows (km [B, N, H or 1, D], ki [B, N, D_I], ds [B, N]) -> kl, klu, p_sum [B, T] and, with
    grad, dq [B, T, H_I, D_I], dk [B, N, D_I], dw [B, T, H_I] fp32 (zeroed: added to). scratch:
    [B, n_blocks, H_I, BLOCK_M, BLOCK_N] in the compute dtype (used only with grad)."""
    B, T, H, D = qm.shape
    HI, DI = qi.shape[2], qi.shape[3]
    blocks = fused_blocks(T, D)
    total = triton.cdiv(T, blocks["BLOCK_M"])
    n_blocks = total - blk0 if n_blocks is None else n_blocks
    return Launch(
        _dense_kl_fused_kernel, (n_blocks, B),
        dict(
            QM=qm, KM=km, QI=qi, KI=ki, WI=wi, DS=ds, LSE2=lse2, LSEI=lse_i, SCR=scratch,
            KL=kl, KLU=klu, PSUM=p_sum, DQI=dq, DKI=dk, DWI=dw,
            **dense_kl_strides(qm, km, qi, ki, wi, ds),
            BLK0=blk0, T=T, Q0=q0, N_KEYS=km.shape[1], H=H, HI=HI, scale_log2=scale * LOG2E, inv_h=1.0 / H,
            D=D, DI=DI, GRAD=grad,
            BLOCK_DI=pow2(DI), **blocks,
        ),
        num_warps=8, num_stages=1,
    )


# ----------------------------------------------------------------------------- autograd
def _fused_run(qi, ki, wi, qm, km, ds, lse2, lse_i, scale, need: bool, q_offset: int):
    """-> kl [B, T], klu [B, T], p_sum [B, T] and, with need, (dq, dk, dw) fp32."""
    B, T, HI = qi.shape[:3]
    kl, klu, (dq, dk, dw) = dense_kl_buffers(qi, ki.shape[1], need)
    p_sum = torch.zeros_like(kl)
    if B * T == 0:
        return kl, klu, p_sum, ((dq, dk, dw) if need else ())
    blocks = fused_blocks(T, qm.shape[3])
    total = triton.cdiv(T, blocks["BLOCK_M"])
    chunk = fused_chunk_blocks(B, HI, blocks) if need else total
    scratch = (torch.empty((B, min(chunk, total), HI, blocks["BLOCK_M"], blocks["BLOCK_N"]), dtype=qi.dtype,
                           device=qi.device) if need else kl)
    for blk0 in range(0, total, chunk):
        n = min(chunk, total - blk0)
        plan_fused_dense_kl(qm, km, qi, ki, wi, ds, lse2, lse_i, scratch, kl, klu, p_sum, dq, dk, dw, scale, need,
                            q_offset, blk0, n).run()
    return kl, klu, p_sum, ((dq, dk, dw) if need else ())


class _FusedDenseKL(torch.autograd.Function):
    """Eq. 3 in one fused pass: the forward runs the indexer-lse pre-pass and the fused kernel,
    which forms the value and (when q_I, k_I or w need a gradient) dq_I, dk_I, dw together; the
    gradients are kept, in the inputs' dtypes, through `save_for_backward` and the backward only
    scales them by grad_output (non-reentrant checkpointing drops them and reruns the forward in
    the backward). lse_i_in: each row's indexer logsumexp from an earlier forward on the same
    inputs (a checkpoint's recompute): the pre-pass is skipped. grads_in (dq_I, dk_I, dw from such
    a forward's outputs): nothing runs, they are kept for the backward and the returned sums are
    zeros (a recompute's outputs are discarded). Outputs: kl_sum, kl_uniform_sum, lse_i, p_sum and
    the kept gradients (None without them)."""

    @staticmethod
    def forward(ctx, q_idx, k_idx, w_idx, q_main, k_main, doc_start, lse_main, scale, q_offset=0, lse_i_in=None,
                dq_in=None, dk_in=None, dw_in=None):
        B, T = q_idx.shape[:2]
        H = q_main.shape[2]
        ctx.need = any(ctx.needs_input_grad[:3])
        if dq_in is not None:  # a recompute with the forward's gradients: nothing to compute
            kept = tuple(g.detach() for g in (dq_in, dk_in, dw_in)) if ctx.need else ()
            ctx.save_for_backward(*kept)
            kl, klu = torch.zeros((), dtype=torch.float32, device=q_idx.device), torch.zeros((), device=q_idx.device)
            lse_i, p_sum = lse_i_in.detach().clone(), torch.full_like(lse_i_in, float("nan"))  # p: not formed here
            ctx.mark_non_differentiable(klu, lse_i, p_sum, *kept)
            return kl, klu, lse_i, p_sum, *(kept or (None, None, None))
        qi, ki, wi, qm, km, ds, lse2 = dense_kl_inputs(q_idx, k_idx, w_idx, q_main, k_main, doc_start, lse_main)
        dev = q_idx.device
        if lse2 is None:  # no attention lse given: the dense-lse pass (the main scores once more)
            lse2 = torch.empty((B, H, T), dtype=torch.float32, device=dev)
            if B * T > 0:
                plan_dense_lse(qm, km, ds, lse2, scale).run()
        if lse_i_in is not None:
            lse_i = lse_i_in.detach().float().contiguous()
        else:
            lse_i = torch.zeros((B, T), dtype=torch.float32, device=dev)
            if B * T > 0:
                plan_indexer_lse(qi, ki, wi, ds, lse_i, q_offset).run()
        kl, klu, p_sum, grads = _fused_run(qi, ki, wi, qm, km, ds, lse2, lse_i, scale, ctx.need, q_offset)
        kept = tuple(g.to(x.dtype) for g, x in zip(grads, (q_idx, k_idx, w_idx)))
        ctx.save_for_backward(*kept)
        ctx.mark_non_differentiable(klu, lse_i, p_sum, *kept)
        return kl.sum(), klu.sum(), lse_i, p_sum, *(kept or (None, None, None))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dkl, *_):
        if not ctx.need:
            return (None,) * 13
        return (*(g * dkl.to(g.dtype) for g in ctx.saved_tensors), *(None,) * 10)


def dense_indexer_kl_fused(q_idx, k_idx, w_idx, q_main, k_main, scale: float, doc_start, lse_main=None,
                           q_offset: int = 0, row_stats=None):
    """The contract of `function.dense_indexer_kl_triton` (shapes, q_offset, row_stats) in one fused
    pass. stats["row_stats"] = (lse_i, p_sum) [B, T] fp32: lse_i (the pre-pass's) skips the pre-pass
    when passed back as `row_stats` (a checkpoint's recompute); p_sum is each row's target mass
    (1 up to rounding when lse_main is the attention's). Under DSA_DENSE_KL=fused-keep it also holds
    the gradients (dq_I, dk_I, dw), and passed back the recompute runs no kernel (its sums: zeros)."""
    B, T = q_idx.shape[:2]
    N = k_idx.shape[1]
    if lse_main is None and (q_offset != 0 or N != T):
        raise ValueError(f"dense_indexer_kl_fused: queries at positions [{q_offset}, {q_offset + T}) of {N} key rows "
                         f"need lse_main (the attention's log-sum-exp of those rows); pass it")
    lse_i_in = row_stats[0] if row_stats is not None else None
    grads_in = tuple(row_stats[2:5]) if row_stats is not None and len(row_stats) == 5 else (None, None, None)
    kl, klu, lse_i, p_sum, *grads = _FusedDenseKL.apply(q_idx, k_idx, w_idx, q_main, k_main, doc_start, lse_main,
                                                        float(scale), int(q_offset), lse_i_in, *grads_in)
    keep = dense_kl_impl() == "fused-keep" and grads[0] is not None
    stats = {"kl": kl.detach(), "kl_uniform": klu.detach(), "queries": torch.tensor(float(B * T)),
             "row_stats": (lse_i, p_sum, *grads) if keep else (lse_i, p_sum)}
    return kl, stats
