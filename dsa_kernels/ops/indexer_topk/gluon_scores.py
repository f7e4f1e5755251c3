"""Lightning indexer scores in Gluon (`triton.experimental.gluon`), keys along the wgmma M (issue 31).

Same contract and output as `kernel._index_scores_kernel` on its bf16 path with one resident head-dim
tile (`plan_scores`; the Triton kernel stays the default, the fallback, the FP8 path and the reference
the autotuner verifies this kernel against): scores [B, C, W] fp32 or bf16, every entry written,
S[c, w] = sum_h w[t, h] ReLU(q[t, h] . k[k0 + w]) for the local row c = row - r0 at global position
t = POS[row], -inf where k0 + w > t or k0 + w < doc_start[t]; ReLU keeps NaN; -0.0 -> +0.0; a bf16
block gets the fp32 sum rounded to nearest even (the Triton kernel's integer rounding).

Schedule, one CTA per (BLOCK_Q queries, KEY_SPAN = 2048 keys, batch) (the Triton kernel's grid, its
span twice as long) and three
warp groups (`gl.warp_specialize`, maxnreg 168 x 384 threads: one CTA per SM):

- **producer** (a worker warp group, `setmaxnreg` PRODUCER_REGS): copies the CTA's queries' q
  ([BLOCK_Q x 64 heads, 128] bf16, heads past H_I and channels past d_I zero-filled) into shared
  memory once (`cp.async`), then walks the span's live key tiles (the keys between the queries' first
  document start and their last position): per 64-key tile it waits for a free stage of the 6-stage
  ring (`empty[s]`), copies the 64 contiguous k rows (16 KB, 16-byte `cp.async`, rows
  past the span zero-filled), then waits for every copy group but the last COPY_LAG = 2
  (`cp.async.wait_group 2`), fences the async proxy, syncs its warps and publishes the group that
  landed: q (`q_bar`, group 0, with tile 1's wait) or a tile (`ready[s]`), so that up to three
  groups' copies are in flight (q's with tiles 0 and 1's).
- **two consumers** (the default partition and a worker, one warp group each, `setmaxnreg` 232):
  consumer c takes tiles c, c + 2, ... (ping-pong: one's epilogue runs under the other's wgmma). Per
  tile: one async wgmma `[64 keys, 128] x [128, BLOCK_Q x 64 (query, head)]` (A = the k tile, B = q,
  both in shared memory), waited for, the stage released; then the epilogue in registers: ReLU (NaN
  kept), times w (the thread's columns' weights, loaded once), the head sum (a reshape to [64,
  BLOCK_Q, 64] and a sum over the last axis: 16 of each query's heads within a thread, then its quad),
  -0.0 -> +0.0, the causal / document mask, the bf16 rounding, and the store of the [BLOCK_Q, 64]
  scores (through a small layout conversion, 64 consecutive keys per query row). After its tiles,
  consumer 0 writes the span's columns before the live range -inf, consumer 1 those after it.

Configs (`kernel.SCORE_GLUON_CONFIGS`, in `kernel.score_config_space(90)`; `GLUON_SCORE_CONFIGS`
here: name -> queries per CTA): BLOCK_Q = 4 (N = 256) and 2 (N = 128). Issued FLOPs, bytes and the epilogue's cost per
tensor-core FLOP: docs/kernels.md "Gluon index scores".

DIAG (a constexpr, 0 in every launch the dispatcher makes): 1 leaves the producer's k copies out
(the ring's stale tiles are used), 2 the consumers' epilogue (wgmma only, nothing stored), for
`benchmarks/gluon_index_scores.py`'s timing diagnostics (is a tile's time the copies', the tensor
cores' or the epilogue's?); their outputs are meaningless.

Gluon kernels do not run under TRITON_INTERPRET: on the CPU nothing here runs; the compile gate
compiles it (sm_90a, Triton 3.6 and 3.9), tests/test_kernels_gluon_scores.py checks its schedule as a
PyTorch model (its `model_scores`) against the reference and the Triton kernel, and the GPU checks
(gpu-check's correctness.index_scores_bf16, the autotuner's verification with
DSA_KERNELS_GLUON_SCORES=1, benchmarks/gluon_index_scores.py) prove the kernel itself.
"""

from __future__ import annotations


import torch
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ..._triton_common import env_flag
from ..sparse_mla.gluon_fwd import GluonLaunch, _cp_async, _cta_barrier, _ring_barriers

BLOCK_N = 64  # keys per tile: the wgmma M of one consumer warp group
BLOCK_HI = 64  # heads per query in the B operand (H_I padded with zero rows / zero weights)
BLOCK_D = 128  # the head dim, one resident tile (d_I padded with zero channels)
STAGES = 6  # shared-memory ring of k tiles (16 KB each)
# copy groups left in flight when the producer publishes one (cp.async.wait_group COPY_LAG);
# 1 <= COPY_LAG < STAGES.
# Each consumer keeps its stage through its epilogue (ptxas sinks the release below it), so of the 6
# stages 2 are held, up to COPY_LAG + 1 = 3 are being filled, and 1 is ready ahead.
COPY_LAG = 2
KEY_SPAN_TILES = 32  # key tiles per CTA (2048 keys)
PRODUCER_WARPS = 4
PRODUCER_REGS = 40
CONSUMER_WARPS = 4  # per consumer partition (the default one and a worker)
CONSUMER_REGS = 232  # (MAXNREG x 384 - PRODUCER_REGS x 128) / 256
MAXNREG = 168  # 168 x 384 threads <= 64K registers: one CTA per SM
# config name (kernel.SCORE_GLUON_CONFIGS) -> queries per CTA
GLUON_SCORE_CONFIGS = {"gluon-keys-rows": 4, "gluon-keys-rows-q2": 2}


def gluon_scores_enabled() -> bool:
    """The Gluon score configs join sm_90's autotuned score space only with DSA_KERNELS_GLUON_SCORES=1,
    until a GPU session has run them: the autotuner's verification catches a wrong result, not a hang
    (a producer / consumer handshake that deadlocks). Forcing one (`config=`, DSA_INDEX_SCORES_CONFIG)
    and gpu-check's correctness check run them without the opt-in."""
    return env_flag("DSA_KERNELS_GLUON_SCORES", "0")


def gluon_scores_supported(q, k, scores, fp8: bool, capability: int) -> str | None:
    """None when the Gluon score kernel takes this call, else why not (one phrase)."""
    B, Tq, HI, DI = q.shape
    if capability != 90:
        return f"sm_{capability} (the kernel is sm_90a: wgmma)"
    if fp8:
        return "FP8 q/k (the Triton kernel keeps the FP8 path)"
    if q.dtype != k.dtype or q.element_size() != 2:
        return f"dtype {q.dtype} / {k.dtype} (needs one 16-bit dtype)"
    if HI > BLOCK_HI:
        return f"H_I = {HI} (at most {BLOCK_HI})"
    if DI > BLOCK_D or DI % 8:
        return f"d_I = {DI} (needs a multiple of 8 up to {BLOCK_D})"
    if q.stride(-1) != 1 or k.stride(-1) != 1 or q.stride(2) % 8 or q.stride(1) % 8 or k.stride(1) % 8:
        return "q / k rows not 16-byte aligned and contiguous in the head dim"
    if scores.dtype not in (torch.float32, torch.bfloat16):
        return f"score dtype {scores.dtype}"
    return None


@gluon.jit
def _live_range(POS, DS, b, pid_q, pid_n, r0, r1, k0, W_LEN, stride_db,
                BLOCK_Q: gl.constexpr, BLOCK_N: gl.constexpr, KEY_SPAN: gl.constexpr):
    """(span0, span1, lo, hi, n_tiles): the CTA's window columns [span0, span1), its live columns [lo,
    hi) (causal: keys <= the queries' last position; documents: from the tile holding their first
    document start) and their n_tiles key tiles from lo, as the Triton kernel computes them."""
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    offs_c = pid_q * BLOCK_Q + gl.arange(0, BLOCK_Q, layout=lay)
    mask_q = r0 + offs_c < r1
    t = gl.load(POS + r0 + offs_c, mask=mask_q, other=-1)
    ds = gl.load(DS + b * stride_db + t, mask=mask_q, other=2147483647).to(gl.int32)
    t_max = gl.max(t, 0)
    ds_min = gl.min(ds, 0)
    span0 = pid_n * KEY_SPAN
    span1 = gl.minimum(span0 + KEY_SPAN, W_LEN)
    lo = gl.maximum(span0, ((ds_min - k0) // BLOCK_N) * BLOCK_N)
    hi = gl.minimum(span1, t_max - k0 + 1)
    n_tiles = gl.maximum(gl.cdiv(hi - lo, BLOCK_N), 0)
    return span0, span1, lo, hi, n_tiles


@gluon.jit
def _producer(Q, KI, POS, DS, q_smem, k_smem, ready, empty, q_bar, b, pid_q, pid_n, r0, r1, k0, W_LEN,
              stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_db,
              HI: gl.constexpr, DI: gl.constexpr, BLOCK_Q: gl.constexpr, BLOCK_HI: gl.constexpr,
              BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, KEY_SPAN: gl.constexpr, STAGES: gl.constexpr,
              COPY_LAG: gl.constexpr, DIAG: gl.constexpr):
    num_warps: gl.constexpr = gl.num_warps()
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])  # 16-byte vectors
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, lay))
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, lay))
    # q of the CTA's queries: row q * BLOCK_HI + h of q_smem = q[row r0 + pid_q BLOCK_Q + q, head h]
    for qi in gl.static_range(BLOCK_Q):
        row = r0 + pid_q * BLOCK_Q + qi
        q_ptr = Q + b * stride_qb + row.to(gl.int64) * stride_qt + (rows * stride_qh)[:, None] + cols[None, :]
        for c in gl.static_range(BLOCK_D // 64):
            m = ((rows < HI) & (row < r1))[:, None] & (c * 64 + cols < DI)[None, :]
            _cp_async(q_smem.slice(qi * BLOCK_HI, BLOCK_HI, dim=0).slice(c * 64, 64, dim=1), q_ptr + c * 64, mask=m)
    async_copy.commit_group()  # q's copies (group 0): in flight with the first tiles', published below

    span0, span1, lo, hi, n_tiles = _live_range(POS, DS, b, pid_q, pid_n, r0, r1, k0, W_LEN, stride_db,
                                                BLOCK_Q, BLOCK_N, KEY_SPAN)
    k_base = KI + b * stride_kb
    for i in range(n_tiles):
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)  # a fresh barrier passes phase 1
        offs_w = lo + i * BLOCK_N + rows  # window columns of the tile's keys
        k_ptr = k_base + ((k0 + offs_w).to(gl.int64) * stride_kt)[:, None] + cols[None, :]
        if DIAG != 1:
            for c in gl.static_range(BLOCK_D // 64):
                m = (offs_w < span1)[:, None] & (c * 64 + cols < DI)[None, :]
                _cp_async(k_smem.index(s).slice(c * 64, 64, dim=1), k_ptr + c * 64, mask=m)
        async_copy.commit_group()
        # copy groups so far: q (group 0), tiles 0..i (groups 1..i + 1); all but the last COPY_LAG have
        # landed: publish group i + 1 - COPY_LAG (q, or a tile), so COPY_LAG groups stay in flight
        async_copy.wait_group(COPY_LAG)
        fence_async_shared()
        _cta_barrier()
        g = i + 1 - COPY_LAG
        if g == 0:
            mbarrier.arrive(q_bar, count=1)
        elif g > 0:
            mbarrier.arrive(ready.index((g - 1) % STAGES), count=1)
    async_copy.wait_group(0)
    fence_async_shared()
    _cta_barrier()
    for g in range(gl.maximum(n_tiles + 1 - COPY_LAG, 0), n_tiles + 1):  # the groups still unpublished
        if g == 0:
            mbarrier.arrive(q_bar, count=1)
        else:
            mbarrier.arrive(ready.index((g - 1) % STAGES), count=1)


@gluon.jit
def _finite(x):
    return (x == x) & (x != float("inf")) & (x != float("-inf"))


@gluon.jit
def _round_to_bf16(x):
    """fp32 -> the fp32 value of its bf16 rounding to nearest even (the Triton kernel's integer
    arithmetic); non-finite unchanged."""
    u = x.to(gl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return gl.where(_finite(x), r.to(gl.float32, bitcast=True), x)


@gluon.jit
def _consumer(W, POS, DS, S, q_smem, k_smem, ready, empty, q_bar, b, pid_q, pid_n, r0, r1, k0, W_LEN,
              stride_wb, stride_wt, stride_db, stride_sb, stride_sc,
              CID: gl.constexpr, HI: gl.constexpr, BLOCK_Q: gl.constexpr, BLOCK_HI: gl.constexpr,
              BLOCK_N: gl.constexpr, KEY_SPAN: gl.constexpr, STAGES: gl.constexpr, DIAG: gl.constexpr):
    num_warps: gl.constexpr = gl.num_warps()
    N: gl.constexpr = BLOCK_Q * BLOCK_HI
    acc_lay: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, N, 16])
    # the [64 keys, BLOCK_Q] head sums, stored with 32 consecutive keys per warp and query row
    out_lay: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [2, num_warps // 2], [0, 1])
    span0, span1, lo, hi, n_tiles = _live_range(POS, DS, b, pid_q, pid_n, r0, r1, k0, W_LEN, stride_db,
                                                BLOCK_Q, BLOCK_N, KEY_SPAN)
    # the CTA's rows (local row c of the block) and their positions / document starts, in out_lay
    offs_c = pid_q * BLOCK_Q + gl.arange(0, BLOCK_Q, layout=gl.SliceLayout(0, out_lay))
    mask_q = r0 + offs_c < r1
    t = gl.load(POS + r0 + offs_c, mask=mask_q, other=-1)
    ds = gl.load(DS + b * stride_db + t, mask=mask_q, other=2147483647).to(gl.int32)
    keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, out_lay))
    out = S + b * stride_sb + (offs_c.to(gl.int64) * stride_sc)[None, :]
    is_bf16: gl.constexpr = S.dtype.element_ty == gl.bfloat16

    # the weights of this thread's (query, head) columns, once
    offs_r = gl.arange(0, N, layout=gl.SliceLayout(0, acc_lay))
    row_r = r0 + pid_q * BLOCK_Q + offs_r // BLOCK_HI
    head_r = offs_r % BLOCK_HI
    w_r = gl.load(W + b * stride_wb + row_r.to(gl.int64) * stride_wt + head_r,
                  mask=(row_r < r1) & (head_r < HI), other=0.0)
    zero = gl.zeros([BLOCK_N, N], gl.float32, layout=acc_lay)
    mbarrier.wait(q_bar, 0)
    qt = q_smem.permute((1, 0))  # [BLOCK_D, N]
    keep = zero  # DIAG 2: the products accumulate here, so that nothing can drop the wgmma
    for i in range(CID, n_tiles, 2):
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        fence_async_shared()
        acc = warpgroup_mma(k_smem.index(s), qt, keep, use_acc=DIAG == 2, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        if DIAG == 2:
            keep = acc
        _cta_barrier()  # the warp group's wgmma is done: the stage may be refilled
        mbarrier.arrive(empty.index(s), count=1)
        if DIAG != 2:
            # ReLU keeping NaN (as torch.relu), times w, summed over each query's heads
            x = w_r[None, :] * gl.maximum(acc, 0.0, propagate_nan=tl.PropagateNan.ALL)
            sums = gl.sum(gl.reshape(x, [BLOCK_N, BLOCK_Q, BLOCK_HI]), axis=2)
            sums = gl.convert_layout(sums, out_lay)
            sums = gl.where(sums == 0.0, 0.0, sums)  # -0.0 -> +0.0
            offs_w = lo + i * BLOCK_N + keys
            offs_s = k0 + offs_w
            valid = (offs_s[:, None] <= t[None, :]) & (offs_s[:, None] >= ds[None, :])
            sums = gl.where(valid, sums, float("-inf"))
            if is_bf16:
                sums = _round_to_bf16(sums)
            gl.store(out + offs_w[:, None], sums.to(S.dtype.element_ty),
                     mask=(offs_w < span1)[:, None] & mask_q[None, :])
    if DIAG == 2:  # a store no launch takes (r1 >= 0), which the compiler cannot drop
        gl.store(S + b * stride_sb, gl.sum(gl.sum(keep, axis=1), axis=0).to(S.dtype.element_ty), mask=r1 < 0)
    # dead columns of the span, after the tiles: before the live ones (consumer 0), after the last position (consumer 1)
    dead = gl.full([BLOCK_N, BLOCK_Q], float("-inf"), gl.float32, layout=out_lay).to(S.dtype.element_ty)
    if CID == 0:
        end = gl.minimum(lo, span1)
        for n0 in range(span0, end, BLOCK_N):
            offs_w = n0 + keys
            gl.store(out + offs_w[:, None], dead, mask=(offs_w < end)[:, None] & mask_q[None, :])
    else:
        for n0 in range(gl.maximum(hi, span0), span1, BLOCK_N):
            offs_w = n0 + keys
            gl.store(out + offs_w[:, None], dead, mask=(offs_w < span1)[:, None] & mask_q[None, :])


@gluon.jit
def _index_scores_gluon_kernel(
    Q, KI, W, POS, DS, S,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt,
    stride_wb, stride_wt,
    stride_db,
    stride_sb, stride_sc,
    r0, r1, k0, W_LEN,
    HI: gl.constexpr, DI: gl.constexpr,
    BLOCK_Q: gl.constexpr, BLOCK_HI: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
    KEY_SPAN: gl.constexpr, STAGES: gl.constexpr, COPY_LAG: gl.constexpr,
    PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    CONSUMER_WARPS: gl.constexpr, CONSUMER_REGS: gl.constexpr, DIAG: gl.constexpr,
):
    pid_q = gl.program_id(0)
    pid_n = gl.program_id(1)
    b = gl.program_id(2).to(gl.int64)
    N: gl.constexpr = BLOCK_Q * BLOCK_HI
    sh: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [N, BLOCK_D], sh)
    k_smem = gl.allocate_shared_memory(KI.dtype.element_ty, [STAGES, BLOCK_N, BLOCK_D], sh)
    ready, empty = _ring_barriers(STAGES)
    q_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar.index(0), count=1)
    gl.warp_specialize([
        (_consumer, (W, POS, DS, S, q_smem, k_smem, ready, empty, q_bar.index(0), b, pid_q, pid_n, r0, r1, k0, W_LEN,
                     stride_wb, stride_wt, stride_db, stride_sb, stride_sc,
                     0, HI, BLOCK_Q, BLOCK_HI, BLOCK_N, KEY_SPAN, STAGES, DIAG)),
        (_consumer, (W, POS, DS, S, q_smem, k_smem, ready, empty, q_bar.index(0), b, pid_q, pid_n, r0, r1, k0, W_LEN,
                     stride_wb, stride_wt, stride_db, stride_sb, stride_sc,
                     1, HI, BLOCK_Q, BLOCK_HI, BLOCK_N, KEY_SPAN, STAGES, DIAG)),
        (_producer, (Q, KI, POS, DS, q_smem, k_smem, ready, empty, q_bar.index(0), b, pid_q, pid_n, r0, r1, k0,
                     W_LEN, stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_db,
                     HI, DI, BLOCK_Q, BLOCK_HI, BLOCK_N, BLOCK_D, KEY_SPAN, STAGES, COPY_LAG, DIAG)),
    ], [CONSUMER_WARPS, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])


def plan_scores_gluon(q, k, w, doc_start, scores, positions, r0: int, r1: int, k0: int, config: str,
                      key_span: int | None = None) -> GluonLaunch:
    """The Gluon score launch (`kernel.plan_scores`' arguments, bf16 / fp16 q and k); the caller checks
    `gluon_scores_supported` first."""
    B, Tq, HI, DI = q.shape
    C, W_LEN = r1 - r0, scores.shape[2]
    block_q = GLUON_SCORE_CONFIGS[config]
    span = key_span or KEY_SPAN_TILES * BLOCK_N
    if span % BLOCK_N:
        raise ValueError(f"key_span={span} must be a multiple of the key tile {BLOCK_N}")
    grid = (-(-C // block_q), -(-W_LEN // span), B)
    return GluonLaunch(
        _index_scores_gluon_kernel, grid,
        dict(
            Q=q, KI=k, W=w, POS=positions, DS=doc_start, S=scores,
            stride_qb=q.stride(0), stride_qt=q.stride(1), stride_qh=q.stride(2),
            stride_kb=k.stride(0), stride_kt=k.stride(1),
            stride_wb=w.stride(0), stride_wt=w.stride(1),
            stride_db=doc_start.stride(0),
            stride_sb=scores.stride(0), stride_sc=scores.stride(1),
            r0=r0, r1=r1, k0=k0, W_LEN=W_LEN,
            HI=HI, DI=DI, BLOCK_Q=block_q, BLOCK_HI=BLOCK_HI, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, KEY_SPAN=span,
            STAGES=STAGES, COPY_LAG=COPY_LAG, PRODUCER_WARPS=PRODUCER_WARPS, PRODUCER_REGS=PRODUCER_REGS,
            CONSUMER_WARPS=CONSUMER_WARPS, CONSUMER_REGS=CONSUMER_REGS, DIAG=0,
        ),
        num_warps=CONSUMER_WARPS, num_stages=STAGES, maxnreg=MAXNREG,
    )
