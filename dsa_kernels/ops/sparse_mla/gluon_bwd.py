"""Sparse MLA backward in Gluon (`triton.experimental.gluon`) on the FA3 / TileLang plan (issue 31).

Same contract as the atomic Triton backwards (`kernel._sparse_mla_bwd_kernel` with DETERMINISTIC
False, `_sparse_mla_bwd_interleaved_kernel`), which stay the default, the fallback and the reference
the autotuner verifies this kernel against: q [B, T, H, 576], kv [B, N, 576] = [latent 512 | rope
64], indices [B, T, K] int32 (a slot is valid when 0 <= idx < N), dO [B, T, H, 512], lse / delta
[B, T, H] fp32 (delta = rowsum(dO * O) - dlse, `kernel.bwd_delta`) -> dq [B, T, H, 576] in q's dtype
(written once), and fp32 atomic adds into dkv [B, N, 576] (zeroed by the caller) at the selected
rows; an empty or out-of-range slot contributes nothing.

Schedule, one CTA per (token, 64-head block), the head block fastest in the grid (the CTAs of one
token gather the same rows together), three warp groups (`gl.warp_specialize`, launched with
maxnreg 168 x 384 threads: one CTA per SM):

- **producer** (the worker partition, one warp group, `setmaxnreg` PRODUCER_REGS): walks the row's
  slots in BLOCK_K-key tiles; per tile it waits for a free stage of the ring (`empty[s]`), gathers
  the selected rows (512 latent + 64 rope columns) with 16-byte `cp.async` (an empty slot's row
  zero-filled, never read), writes the tile's row indices (-1 for an empty slot) to shared memory,
  waits for its copies, fences the async proxy, syncs its warps and arrives on `ready[s]`.
- **consumers** (the default partition, two warp groups): q (576 columns) and dO (512) of the head
  block are staged once in shared memory (136 KB: resident for the whole row, as TileLang's and
  FA3's backwards keep them). Per tile, by async wgmma:
  1. `S = q kv^T` (576 dims) and `dP = dO V^T` (512 dims), [64 heads, BLOCK_K keys] each, the two
     warp groups splitting the keys (BLOCK_K / 2 each): computed once;
  2. `P = exp2(S scale log2e - lse log2e)` (0 at an empty slot), `dS = P (dP - delta) scale`, both
     rounded to bf16 into shared memory ([64, BLOCK_K] each);
  3. `dq += dS kv` (K = BLOCK_K): [64, 512] + [64, 64] fp32 accumulators kept in registers across the
     row (the two warp groups split the columns: 144 registers a thread), stored once at the end;
     the stage is released (`empty[s]`) as soon as both warp groups are past this product, so the
     producer gathers the next tile under the dkv products;
  4. `dkv^T = q^T dS + dO^T P` (latent, by DKV_CHUNK-column chunks, K = 64 heads, N = BLOCK_K keys)
     and `q_rope^T dS` (rope, M = 64), each chunk added to dkv's selected rows by relaxed fp32
     atomics straight from the accumulator. DKV_CHUNK 64 (the two warp groups split the keys, 8
     registers a thread) or 128 (one 64-row half per warp group: each reads only its half of q^T and
     dO^T, 16 registers). PIPELINE_DKV (DKV_CHUNK 64): the first chunk is issued before the wait for
     dq, and chunk c + 1 is issued before chunk c's atomics, so the tensor cores work while the
     atomics issue (the rope is then the last 64-column chunk).
  DKV_VEC 2 / 4 (DKV_CHUNK 64): each chunk moved within its warp to a layout holding 2 / 4 consecutive
  columns of a key in a thread (the accumulator holds consecutive keys, columns 8 apart), then added
  by `red.global.add.v2 / .v4.f32` (inline asm): half / a quarter of the reduction instructions.
  dS and P in shared memory are rewritten only after both warp groups are past the previous tile's
  dkv products (a consumer barrier).

Every product is a wgmma (nothing on mma.sync) and nothing is computed twice: the tensor-core FLOPs
equal the useful ones (TileLang's count: S, dP, dq, dkv = 3 x 576 + 2 x 512 per head and key).
Shared memory at BLOCK_K = 32 and 2 stages: q 72 KB + dO 64 KB + 2 x 36 KB + dS / P 8 KB + indices,
statistics and barriers = 222,148 B compiled, of Hopper's 232,448 (64-key tiles fit one stage only,
230,332 B, and spilled: docs/kernels.md). Registers: the resident q / dO are read through an index the
compiler cannot see is 0 (`_sreg`), so their loop-invariant wgmma descriptors are formed at each use
instead of hoisted into registers (hoisted, ptxas spilled them: 656-704 B); the epilogue reads the
CTA's coordinates again and lse / delta live in shared memory, for the same reason.

DIAG (a constexpr, 0 in every launch the dispatcher makes): 1 leaves the producer's copies out, 2
the consumers' math (tiles received and released; no atomics, dq stays 0), for
`benchmarks/gluon_sparse_mla.py`'s timing diagnostics; their outputs are meaningless.

Triton 3.6 and 3.9 differ in the names this kernel uses as in `gluon_fwd.py` (the same shim). Gluon
kernels do not run under TRITON_INTERPRET: on the CPU nothing here runs; the compile gate compiles it
(sm_90a, Triton 3.6 and 3.9), tests/test_kernels_gluon_bwd.py checks its arithmetic as a PyTorch model
of the schedule, and the GPU checks (the autotuner's verification, gpu-check's correctness.sparse_mla,
benchmarks/gluon_sparse_mla.py) prove the kernel itself.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.runtime.jit import constexpr_function
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .gluon_fwd import (LOG2E, GluonLaunch, _cp_async, _cta_barrier, _gather_and_publish, _head_block_token_batch,
                        _ring_barriers, _tile_rows, gluon_fwd_supported)
from .launch_args import _bwd_args

BLOCK_H = 64  # heads per CTA (S / dP's M; dkv^T's K)
BLOCK_K = 32  # keys per tile (S / dP's N, dq's K, dkv^T's N)
STAGES = 2  # shared-memory ring of gathered tiles
# latent columns of one dkv^T product: 64 (M = 64: the two warp groups split its keys; no spill under
# Triton 3.6 or 3.9) or 128 (M = 128: one 64-row half per warp group, so each reads only its half of
# q^T / dO^T: half the shared-memory reads of those products, no spill under 3.6, 48 B under 3.9)
DKV_CHUNK = 64
PRODUCER_WARPS = 4
PRODUCER_REGS = 40  # the consumers get (MAXNREG x 384 - 40 x 128) / 256 = 232
CONSUMER_WARPS = 8
MAXNREG = 168  # 168 x 384 threads <= 64K registers: one CTA per SM


@gluon.jit
def _producer(KV, IDX, NSLOT, kv_lat, kv_rope, rows_smem, ready, empty, b, t,
              stride_kvb, stride_kvt, stride_ib, stride_it, stride_nb, N_KV,
              D_V: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, DIAG: gl.constexpr):
    num_warps: gl.constexpr = gl.num_warps()
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])  # 16-byte vectors
    rows = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, lay))
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, lay))
    kv_base = KV + b * stride_kvb
    idx_base = IDX + b * stride_ib + t * stride_it
    n_slots = gl.load(NSLOT + b * stride_nb + t)
    n_tiles = gl.cdiv(n_slots, BLOCK_K)  # 0 on a row with no valid slot (the consumers agree)
    for i in range(n_tiles):
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)  # a fresh barrier passes phase 1
        idx, valid, row_ptr, vmask = _tile_rows(idx_base, kv_base, stride_kvt, i * BLOCK_K + rows, cols, n_slots, N_KV)
        # the consumers' key mask and the dkv rows of their atomics: the index, -1 where empty
        rows_smem.index(s).store(gl.where(valid, idx, -1))
        _gather_and_publish(kv_lat, kv_rope, ready, s, row_ptr, vmask, D_V, DIAG)


@gluon.jit
def _sreg(asm: gl.constexpr, x):
    """An int32 scalar from one PTX instruction the compiler may not move or merge (`x`: any int32
    scalar, only to give the instruction an operand)."""
    return gl.inline_asm_elementwise(asm, "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _dkv_issue(c: gl.constexpr, qa, qr, da, ds_smem, p_smem, lay: gl.constexpr, CHUNK: gl.constexpr,
               BLOCK_K: gl.constexpr, D_V: gl.constexpr):
    """Issues (async) dkv^T of chunk c: [CHUNK columns, BLOCK_K keys] = q^T dS + dO^T P over the latent
    columns c CHUNK .. (two wgmma groups), or q_rope^T dS (one group) once c CHUNK reaches D_V."""
    zero = gl.zeros([CHUNK, BLOCK_K], gl.float32, layout=lay)
    if c * CHUNK < D_V:
        acc = warpgroup_mma(qa.slice(c * CHUNK, CHUNK, dim=1).permute((1, 0)), ds_smem, zero, use_acc=False,
                            is_async=True)
        acc = warpgroup_mma(da.slice(c * CHUNK, CHUNK, dim=1).permute((1, 0)), p_smem, acc, is_async=True)
    else:
        acc = warpgroup_mma(qr.permute((1, 0)), ds_smem, zero, use_acc=False, is_async=True)
    return acc


@gluon.jit
def _dkv_add(acc, DKV_B, rows, col0, stride_dkt, lay: gl.constexpr, M: gl.constexpr, BLOCK_K: gl.constexpr,
             VEC: gl.constexpr):
    """acc [M columns, BLOCK_K keys] (dkv^T of one chunk) -> relaxed fp32 atomic adds at
    dkv[rows[key], col0 + column]; keys with rows < 0 (empty slots) are masked. VEC 1: one scalar
    reduction per element, from the accumulator's layout (`lay`). VEC 2 / 4: `lay` is `_vec_layout`
    (a thread holds VEC consecutive columns of a key); acc is moved there (`gl.convert_layout`, within
    each warp) and added by one VEC-wide `red.global.add.v{VEC}.f32` per VEC columns (`_red_vec`)."""
    cols = col0 + gl.arange(0, M, layout=gl.SliceLayout(1, lay))
    ptrs = DKV_B + (rows * stride_dkt)[None, :] + cols[:, None]
    mask = (rows >= 0)[None, :] & (cols >= 0)[:, None]
    if VEC == 1:
        gl.atomic_add(ptrs, acc, mask=mask, sem="relaxed")
    else:
        _red_vec(ptrs.to(gl.int64), mask.to(gl.int32), gl.convert_layout(acc, lay), VEC)


@gluon.jit
def _red_vec(addrs, mask, x, VEC: gl.constexpr):
    """One `red.global.gpu.relaxed.add.v{VEC}.f32` (sm_90, PTX ISA 8.1) per VEC consecutive elements of
    a thread (`pack`: the layout puts VEC consecutive dkv columns of one key in a thread's consecutive
    registers, their address the first one's; the mask is the key's, the same across the pack).
    `addrs`: the fp32 pointers as int64 (Triton 3.6's inline asm refuses a pointer beside a float
    operand). The returned int32 is a placeholder (inline asm needs an output); is_pure=False keeps
    the reduction."""
    if VEC == 2:
        gl.inline_asm_elementwise(
            "{ .reg .pred %p; setp.ne.b32 %p, $4, 0; @%p red.global.gpu.relaxed.add.v2.f32 [$2], {$6, $7}; "
            "mov.u32 $0, 0; mov.u32 $1, 0; }",
            "=r,=r,l,l,r,r,r,r", [addrs, mask, x], dtype=gl.int32, is_pure=False, pack=2)
    else:
        gl.inline_asm_elementwise(
            "{ .reg .pred %p; setp.ne.b32 %p, $8, 0; @%p red.global.gpu.relaxed.add.v4.f32 [$4], {$12, $13, $14, $15}; "
            "mov.u32 $0, 0; mov.u32 $1, 0; mov.u32 $2, 0; mov.u32 $3, 0; }",
            "=r,=r,=r,=r,l,l,l,l,r,r,r,r,r,r,r,r", [addrs, mask, x], dtype=gl.int32, is_pure=False, pack=4)


@constexpr_function
def dkv_vec_layout(vec):
    """The layout DKV_VEC 2 / 4 issues its reductions from: dkv^T [64 columns, 32 keys] (DKV_CHUNK 64,
    BLOCK_K 32, 8 consumer warps) with `vec` consecutive columns of one key in a thread's consecutive
    registers (order [0, 1]), each warp holding the same 16 columns x 16 keys as the wgmma accumulator
    (NVMMA v3, warps [4, 2], instruction [16, 16, 16]), so the move from it stays within the warp."""
    if vec == 2:
        return gl.BlockedLayout([2, 4], [8, 4], [4, 2], [0, 1])
    return gl.BlockedLayout([4, 2], [4, 8], [4, 2], [0, 1])


@gluon.jit
def _consumer(Q, DO, NSLOT, LSE, DELTA, DQ, DKV, q_lat3, q_rope3, do_smem3, kv_lat, kv_rope, rows_smem,
              ds_smem, p_smem, stat_smem, ready, empty, b, t, hb,
              stride_qb, stride_qt, stride_qh, stride_dob, stride_dot, stride_doh, stride_nb,
              stride_lb, stride_lt, stride_dqb, stride_dqt, stride_dqh, stride_dkb, stride_dkt,
              scale, scale_log2, N_HB,
              D_V: gl.constexpr, D_R: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_K: gl.constexpr,
              STAGES: gl.constexpr, DKV_CHUNK: gl.constexpr, PIPELINE_DKV: gl.constexpr, DKV_VEC: gl.constexpr,
              DIAG: gl.constexpr):
    num_warps: gl.constexpr = gl.num_warps()
    # S / dP [64 heads, BLOCK_K keys]: the two warp groups split the keys
    s_lay: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                    instr_shape=[16, BLOCK_K // 2, 16])
    # dq [64, 512] and [64, 64]: the two warp groups split the columns
    dq_lay: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                     instr_shape=[16, D_V // 2, 16])
    dqr_lay: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                      instr_shape=[16, D_R // 2, 16])
    # dkv^T [DKV_CHUNK columns, BLOCK_K keys]: 64 -> the warp groups split the keys, 128 -> one 64-row
    # half per warp group; rope [64, BLOCK_K]
    if DKV_CHUNK == 64:
        dkv_lay: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                          instr_shape=[16, BLOCK_K // 2, 16])
    else:
        dkv_lay: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                          instr_shape=[16, BLOCK_K, 16])
    dkvr_lay: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, BLOCK_K // 2, 16])
    # where the dkv atomics are issued from: the accumulator's layout (DKV_VEC 1), or (DKV_VEC 2 / 4,
    # DKV_CHUNK 64 and the rope) DKV_VEC consecutive columns of a key in one thread, each warp holding
    # the same 16 columns x BLOCK_K / 2 keys as in the accumulator (the conversion stays within a warp)
    if DKV_VEC == 1:
        add_lay: gl.constexpr = dkv_lay
        addr_lay: gl.constexpr = dkvr_lay
    else:
        add_lay: gl.constexpr = dkv_vec_layout(DKV_VEC)
        addr_lay: gl.constexpr = add_lay
    row_s: gl.constexpr = gl.SliceLayout(1, s_lay)
    col_s: gl.constexpr = gl.SliceLayout(0, s_lay)

    q_lat = q_lat3.index(0)
    q_rope = q_rope3.index(0)
    do_smem = do_smem3.index(0)
    # q and dO of the head block -> shared memory, once
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    h_ld = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld))
    c_ld = gl.arange(0, 64, layout=gl.SliceLayout(0, ld))
    q_ptr = Q + b * stride_qb + t * stride_qt + (h_ld * stride_qh)[:, None] + c_ld[None, :]
    do_ptr = DO + b * stride_dob + t * stride_dot + (h_ld * stride_doh)[:, None] + c_ld[None, :]
    for c in gl.static_range(D_V // 64):
        _cp_async(q_lat.slice(c * 64, 64, dim=1), q_ptr + c * 64)
        _cp_async(do_smem.slice(c * 64, 64, dim=1), do_ptr + c * 64)
    _cp_async(q_rope, q_ptr + D_V)
    async_copy.commit_group()

    h_s = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=row_s)
    stat = b * stride_lb + t * stride_lt + h_s
    lse = gl.load(LSE + stat)
    delta = gl.load(DELTA + stat)
    # p = exp2(s scale log2e - lse log2e); a row without a valid slot has lse = -inf -> p = 0
    # both kept in shared memory, read per tile: 4 registers a thread fewer across the loop
    stat_smem.index(0).store(gl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634))
    stat_smem.index(1).store(delta)
    dq = gl.zeros([BLOCK_H, D_V], gl.float32, layout=dq_lay)
    dq_r = gl.zeros([BLOCK_H, D_R], gl.float32, layout=dqr_lay)
    DKV_B = DKV + b * stride_dkb
    async_copy.wait_group(0)
    fence_async_shared()
    _cta_barrier()

    n_slots = gl.load(NSLOT + b * stride_nb + t)
    n_tiles = gl.cdiv(n_slots, BLOCK_K)
    for i in range(n_tiles):
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        if DIAG == 2:  # a timing diagnostic: the tile received and released, nothing computed
            _cta_barrier()
            mbarrier.arrive(empty.index(s), count=1)
        else:
            fence_async_shared()
            # the resident operands through an index the compiler cannot see is 0: their wgmma
            # descriptors (36 + 32 + 36 per tile) are then formed at their use instead of being
            # hoisted out of the loop into registers (which spilled them)
            z = _sreg("mov.u32 $0, 0;", i)
            qa = q_lat3.index(z)
            qr = q_rope3.index(z)
            da = do_smem3.index(z)
            kl = kv_lat.index(s)
            kr = kv_rope.index(s)
            # 1. S = q kv^T over 576 dims, dP = dO V^T over 512 (the keys split between the warp groups)
            sc = warpgroup_mma(qa, kl.permute((1, 0)), gl.zeros([BLOCK_H, BLOCK_K], gl.float32, layout=s_lay),
                               use_acc=False, is_async=True)
            sc = warpgroup_mma(qr, kr.permute((1, 0)), sc, is_async=True)
            dp = warpgroup_mma(da, kl.permute((1, 0)), gl.zeros([BLOCK_H, BLOCK_K], gl.float32, layout=s_lay),
                               use_acc=False, is_async=True)
            sc, dp = warpgroup_mma_wait(num_outstanding=0, deps=(sc, dp))
            # 2. P from the saved lse (0 at an empty slot), dS = P (dP - delta) scale
            key_rows = rows_smem.index(s).load(col_s)
            p = gl.exp2(sc * scale_log2 - stat_smem.index(0).load(row_s)[:, None])
            p = gl.where((key_rows >= 0)[None, :], p, 0.0)
            ds = p * (dp - stat_smem.index(1).load(row_s)[:, None]) * scale
            _cta_barrier()  # both warp groups are past the previous tile's dkv products (their reads of dS / P)
            ds_smem.store(ds.to(ds_smem.dtype))
            p_smem.store(p.to(p_smem.dtype))
            fence_async_shared()  # each thread orders its stores before the wgmma's async-proxy reads
            _cta_barrier()
            # 3. dq += dS kv (registers across the row); then the stage is free for the producer
            dq = warpgroup_mma(ds_smem, kl, dq, is_async=True)
            dq_r = warpgroup_mma(ds_smem, kr, dq_r, is_async=True)
            if PIPELINE_DKV:  # the first dkv chunk issued before waiting for dq: it runs under the wait
                acc = _dkv_issue(0, qa, qr, da, ds_smem, p_smem, dkv_lay, DKV_CHUNK, BLOCK_K, D_V)
                dq, dq_r = warpgroup_mma_wait(num_outstanding=2, deps=(dq, dq_r))
            else:
                dq, dq_r = warpgroup_mma_wait(num_outstanding=0, deps=(dq, dq_r))
            rows_c = rows_smem.index(s).load(gl.SliceLayout(0, add_lay))
            rows_r = rows_smem.index(s).load(gl.SliceLayout(0, addr_lay))
            _cta_barrier()
            mbarrier.arrive(empty.index(s), count=1)
            # 4. dkv^T = q^T dS + dO^T P by DKV_CHUNK-column chunks, then q_rope^T dS; fp32 atomics at the rows
            if PIPELINE_DKV:
                # chunk c + 1 (two wgmma groups; the rope's one) in flight while chunk c's atomics issue.
                # DKV_CHUNK = 64 = D_R: the rope is chunk D_V // 64, same shape and layout
                NCH: gl.constexpr = D_V // DKV_CHUNK + 1
                for c in gl.static_range(NCH):
                    if c + 1 < NCH:
                        nxt = _dkv_issue(c + 1, qa, qr, da, ds_smem, p_smem, dkv_lay, DKV_CHUNK, BLOCK_K, D_V)
                        acc = warpgroup_mma_wait(num_outstanding=2 if c + 2 < NCH else 1, deps=(acc,))
                    else:
                        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                    _dkv_add(acc, DKV_B, rows_c, c * DKV_CHUNK, stride_dkt, add_lay, DKV_CHUNK, BLOCK_K, DKV_VEC)
                    if c + 1 < NCH:
                        acc = nxt
            else:
                for c in gl.static_range(D_V // DKV_CHUNK):
                    acc = _dkv_issue(c, qa, qr, da, ds_smem, p_smem, dkv_lay, DKV_CHUNK, BLOCK_K, D_V)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                    _dkv_add(acc, DKV_B, rows_c, c * DKV_CHUNK, stride_dkt, add_lay, DKV_CHUNK, BLOCK_K, DKV_VEC)
                acc_r = _dkv_issue(D_V // D_R, qa, qr, da, ds_smem, p_smem, dkvr_lay, D_R, BLOCK_K, D_V)
                acc_r = warpgroup_mma_wait(num_outstanding=0, deps=(acc_r,))
                _dkv_add(acc_r, DKV_B, rows_r, D_V, stride_dkt, addr_lay, D_R, BLOCK_K, DKV_VEC)

    # dq -> q's dtype through shared memory (q's buffers, free now): coalesced 16-byte stores. The
    # CTA's coordinates are read again (opaque to the compiler: nothing of the prologue is kept live
    # across the loop for the epilogue, which spilled under Triton 3.9)
    pid = _sreg("mov.u32 $0, %ctaid.x;", n_tiles)
    hb = pid % N_HB
    t = (pid // N_HB).to(gl.int64)
    b = _sreg("mov.u32 $0, %ctaid.y;", n_tiles).to(gl.int64)
    q_lat = q_lat3.index(0)
    q_rope = q_rope3.index(0)
    _cta_barrier()
    q_lat.store(dq.to(q_lat.dtype))
    q_rope.store(dq_r.to(q_rope.dtype))
    _cta_barrier()
    st: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    h_st = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, st))
    c_st = gl.arange(0, 64, layout=gl.SliceLayout(0, st))
    dq_ptr = DQ + b * stride_dqb + t * stride_dqt + (h_st * stride_dqh)[:, None] + c_st[None, :]
    for c in gl.static_range(D_V // 64):
        gl.store(dq_ptr + c * 64, q_lat.slice(c * 64, 64, dim=1).load(st))
    gl.store(dq_ptr + D_V, q_rope.load(st))


@gluon.jit
def _sparse_mla_bwd_gluon_kernel(
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
    D_V: gl.constexpr, D_R: gl.constexpr,
    BLOCK_H: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_DV: gl.constexpr, BLOCK_DR: gl.constexpr,
    STAGES: gl.constexpr, DKV_CHUNK: gl.constexpr, PIPELINE_DKV: gl.constexpr, DKV_VEC: gl.constexpr,
    PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr, DIAG: gl.constexpr,
):
    # program (x, y) -> (token, head block), the head block fastest; y = b. The launcher admits this
    # kernel only where `gluon_bwd_supported` says so (H % 64 == 0, rope 64, d_v a multiple of 128).
    hb, t, b = _head_block_token_batch(N_HB)
    dtype: gl.constexpr = Q.dtype.element_ty
    sh: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    sh_k: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(BLOCK_K * 2, 128), element_bitwidth=16, rank=2)
    q_lat = gl.allocate_shared_memory(dtype, [1, BLOCK_H, D_V], sh)
    q_rope = gl.allocate_shared_memory(dtype, [1, BLOCK_H, D_R], sh)
    do_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_H, D_V], sh)
    kv_lat = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, D_V], sh)
    kv_rope = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, D_R], sh)
    ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_K], sh_k)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_K], sh_k)
    rows_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_K],
                                          gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
    stat_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H],  # lse log2e, delta of the block's heads
                                          gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
    ready, empty = _ring_barriers(STAGES)
    gl.warp_specialize([
        (_consumer, (Q, DO, NSLOT, LSE, DELTA, DQ, DKV, q_lat, q_rope, do_smem, kv_lat, kv_rope, rows_smem,
                     ds_smem, p_smem, stat_smem, ready, empty, b, t, hb,
                     stride_qb, stride_qt, stride_qh, stride_dob, stride_dot, stride_doh, stride_nb,
                     stride_lb, stride_lt, stride_dqb, stride_dqt, stride_dqh, stride_dkb, stride_dkt,
                     scale, scale_log2, N_HB, D_V, D_R, BLOCK_H, BLOCK_K, STAGES, DKV_CHUNK, PIPELINE_DKV, DKV_VEC,
                     DIAG)),
        (_producer, (KV, IDX, NSLOT, kv_lat, kv_rope, rows_smem, ready, empty, b, t,
                     stride_kvb, stride_kvt, stride_ib, stride_it, stride_nb, N_KV,
                     D_V, BLOCK_K, STAGES, DIAG)),
    ], [PRODUCER_WARPS], [PRODUCER_REGS])


def gluon_bwd_supported(q, kv, d_v: int, capability: int) -> str | None:
    """None when the Gluon backward takes this call, else why not (one phrase): the Gluon forward's
    rule (`gluon_fwd_supported`: sm_90, one 16-bit dtype, H % 64, rope 64, d_v a multiple of 128 up
    to 512)."""
    return gluon_fwd_supported(q, kv, d_v, capability)


def plan_bwd_gluon(q, kv, indices, n_slots, dout, lse, delta, dq, dkv, scale: float, d_v: int, grid: tuple,
                   block_k: int = BLOCK_K, stages: int = STAGES, dkv_chunk: int = DKV_CHUNK,
                   pipeline_dkv: bool = False, producer_regs: int | None = None, dkv_vec: int = 1) -> GluonLaunch:
    """The Gluon backward's launch (`kernel.plan_bwd`'s atomic arguments; `grid` = (tokens x head
    blocks, B), checked there against CUDA's limits); the caller checks `gluon_bwd_supported` first."""

    B, T, H, D = q.shape
    args = _bwd_args(q, kv, indices, n_slots, dout, lse, delta, dq)  # checks that lse / delta share strides
    if pipeline_dkv and dkv_chunk != D - d_v:
        raise ValueError(f"gluon_bwd: pipeline_dkv needs dkv_chunk = the rope width {D - d_v}; got {dkv_chunk}")
    if dkv_vec not in (1, 2, 4):
        raise ValueError(f"gluon_bwd: dkv_vec must be 1, 2 or 4 (fp32 columns one reduction adds); got {dkv_vec}")
    if dkv_vec > 1 and (dkv_chunk != 64 or block_k != 32 or D - d_v != 64):
        raise ValueError(f"gluon_bwd: dkv_vec {dkv_vec} needs dkv_chunk 64, block_k 32 and rope 64 (the layout its "
                         f"reductions are issued from); got dkv_chunk {dkv_chunk}, block_k {block_k}, rope {D - d_v}")
    if dkv_vec > 1 and (dkv.stride(-1) != 1 or dkv.stride(1) % dkv_vec or dkv.stride(0) % dkv_vec
                        or (dkv.device.type != "meta" and dkv.data_ptr() % (4 * dkv_vec))):
        raise ValueError(f"gluon_bwd: dkv_vec {dkv_vec} adds {4 * dkv_vec}-byte vectors: dkv must be contiguous "
                         f"in its columns with strides a multiple of {dkv_vec} and {4 * dkv_vec}-byte aligned; got "
                         f"strides {dkv.stride()} (pass a freshly allocated torch.zeros buffer)")
    return GluonLaunch(
        _sparse_mla_bwd_gluon_kernel, grid,
        dict(
            **args, DKV=dkv, stride_dkb=dkv.stride(0), stride_dkt=dkv.stride(1),
            H=H, N_HB=H // BLOCK_H, N_KV=kv.shape[1], scale=scale, scale_log2=scale * LOG2E,
            D_V=d_v, D_R=D - d_v, BLOCK_H=BLOCK_H, BLOCK_K=block_k, BLOCK_DV=d_v, BLOCK_DR=D - d_v,
            STAGES=stages, DKV_CHUNK=dkv_chunk, PIPELINE_DKV=pipeline_dkv, DKV_VEC=dkv_vec,
            PRODUCER_WARPS=PRODUCER_WARPS,
            PRODUCER_REGS=producer_regs or PRODUCER_REGS, DIAG=0,
        ),
        num_warps=CONSUMER_WARPS, num_stages=stages, maxnreg=MAXNREG,
    )
