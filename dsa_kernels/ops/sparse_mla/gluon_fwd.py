"""Sparse MLA forward in Gluon (`triton.experimental.gluon`) on FlashMLA's SM90 schedule (issue 31).

Same contract as `kernel._sparse_mla_fwd_kernel` (the Triton forward, which stays the default, the
fallback and the reference the autotuner verifies this kernel against): q [B, T, H, 576], kv
[B, N, 576] = [latent 512 | rope 64], indices [B, T, K] int32 (a slot is valid when 0 <= idx < N),
out [B, T, H, 512] in q's dtype, lse [B, T, H] fp32 in the natural log (-inf on a row with no
valid slot, whose out is 0).

Schedule, one CTA per (token, 64-head block), the head block fastest in the grid (the CTAs of one
token gather the same rows together), three warp groups (`gl.warp_specialize`, launched with
maxnreg 168 x 384 threads: one CTA per SM):

- **producer** (the worker partition, one warp group, `setmaxnreg` down to PRODUCER_REGS = 40):
  walks the row's slots in 64-key tiles; per tile it waits for a free stage of the shared-memory
  ring (`empty[s]`), gathers the 64 selected rows (512 latent + 64 rope columns, 72 KB) with
  `cp.async` (16-byte vectors; an empty or out-of-range slot's row is zero-filled, never read),
  writes the tile's key mask (0 / -inf per key) to shared memory, and once its copies have landed
  (`cp.async.wait_group 0`, proxy fence, a producer-only named barrier) arrives on `ready[s]`. Two
  stages: q (72 KB) + 2 x 72 KB + P (8 KB) + masks = 225 KB of Hopper's 227. (Publishing a tile only
  after issuing the next one, to keep two tiles in flight, deadlocks with two stages: the consumers
  release a stage only after they get the next tile.)
- **consumers** (the default partition, two warp groups, `setmaxnreg` up to 232): q of the head
  block is staged once in shared memory. Per tile, the logits `S = q kv^T` [64 x 64] by wgmma over
  all 576 dims, **computed once**: the two warp groups split the 64 keys (32 each, `warps_per_cta =
  [4, 2]`), so no tile is computed twice (the Triton kernel's x1.53). Online softmax in the log2
  domain with FlashAttention-3's stale maximum: a row's running max moves only when it grows by
  more than RESCALE_THRESHOLD (8, log2 units; P stays <= 2^8 and the final normalization divides by
  the sum of the same P, so the result is exact). P (bf16) goes to shared memory, and `O += P V` by
  wgmma with the two warp groups splitting the 512 value columns (each owns a [64, 256] fp32
  accumulator, 128 registers a thread). A stage is released (`empty[s]`) once both warp groups are
  past their PV wait.

Two configs (`kernel.FWD_GLUON_CONFIGS*`): "gluon" waits for each tile's PV at the tile's end;
"gluon-pv" (PIPELINE_PV) leaves it in flight while the next tile's logits are issued (tile 0
peeled, so that no instruction defines the accumulator inside a wgmma pipeline stage: otherwise
ptxas serializes every wgmma, C7514/C7515), which spills 120 B under Triton 3.9 (none under 3.6).
O is rescaled on every tile (by 1 where the max stayed): skipping the multiply with one per-CTA
branch (SKIP_RESCALE) spilled 80 B under 3.6.

DIAG (a constexpr, 0 in every launch the dispatcher makes): 1 leaves the producer's copies out, 2
the consumers' math, for `benchmarks/gluon_sparse_mla.py`'s timing diagnostics (is a tile's time
the gather's or the math's?); their outputs are meaningless.

Triton 3.6 and 3.9 differ in two names this kernel uses (the shim below): the cp.async call
(`async_copy_global_to_shared` in 3.6, `async_load` in 3.9) and the CTA barrier (`thread_barrier`
/ `barrier`). Gluon kernels do not run under TRITON_INTERPRET: on the CPU nothing here runs; the
compile gate compiles it (sm_90a, Triton 3.6 and 3.9), tests/test_kernels_gluon_fwd.py checks its
arithmetic as a PyTorch model of the schedule, and the GPU checks prove the kernel itself.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from ..._triton_common import Launch
from .launch_args import _fwd_args

# ---- the Triton 3.6 / 3.9 shim: the two names that differ ----
if hasattr(async_copy, "async_load"):  # 3.9 (3.6's name still exists there, and raises)
    _cp_async = async_copy.async_load
else:  # 3.6
    _cp_async = async_copy.async_copy_global_to_shared
_cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier

BLOCK_H = 64  # heads per CTA (the logits' M)
BLOCK_K = 64  # keys per tile
STAGES = 2  # shared-memory ring of gathered tiles
PRODUCER_WARPS = 4  # one warp group gathers
PRODUCER_REGS = 40  # its registers after setmaxnreg; the consumers get (MAXNREG x 384 - 40 x 128) / 256 = 232
CONSUMER_WARPS = 8  # two warp groups compute
MAXNREG = 168  # 168 x 384 threads <= 64K registers: one CTA per SM
RESCALE_THRESHOLD = 8.0  # log2 units: rescale O only when a row's max grows by more
LOG2E = 1.4426950408889634


@gluon.jit
def _producer(KV, IDX, NSLOT, kv_lat, kv_rope, bias, ready, empty, b, t,
              stride_kvb, stride_kvt, stride_ib, stride_it, stride_nb, N_KV,
              D_V: gl.constexpr, D_R: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
              DIAG: gl.constexpr):
    num_warps: gl.constexpr = gl.num_warps()
    # 16-byte vectors: 8 threads across 64 columns, 4 rows per warp
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    rows = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, lay))
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, lay))
    kv_base = KV + b * stride_kvb
    idx_base = IDX + b * stride_ib + t * stride_it
    n_slots = gl.load(NSLOT + b * stride_nb + t)
    n_tiles = gl.maximum(gl.cdiv(n_slots, BLOCK_K), 1)  # >= 1: a row with no slot is one empty tile
    for i in range(n_tiles):
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)  # a fresh barrier passes phase 1
        _, valid, row_ptr, vmask = _tile_rows(idx_base, kv_base, stride_kvt, i * BLOCK_K + rows, cols, n_slots, N_KV)
        # the logits' mask for the consumers: 0 or -inf per key (no index loads on their side)
        bias.index(s).store(gl.where(valid, 0.0, float("-inf")))
        _gather_and_publish(kv_lat, kv_rope, ready, s, row_ptr, vmask, D_V, DIAG)


@gluon.jit
def _tile_rows(idx_base, kv_base, stride_kvt, offs_k, cols, n_slots, N_KV):
    """One key tile's slots (`offs_k`): their indices (-1 past the row's slots), which are valid (an
    empty / out-of-range slot is zero-filled, never read), the first 64 columns' pointers of each
    selected kv row and the copy mask. Shared by the Gluon forward's and backward's producers."""
    idx = gl.load(idx_base + offs_k, mask=offs_k < n_slots, other=-1)
    valid = (idx >= 0) & (idx < N_KV)
    row_ptr = kv_base + (gl.where(valid, idx, 0) * stride_kvt)[:, None] + cols[None, :]
    vmask = valid[:, None] & (cols < 64)[None, :]
    return idx, valid, row_ptr, vmask


@gluon.jit
def _gather_and_publish(kv_lat, kv_rope, ready, s, row_ptr, vmask, D_V: gl.constexpr, DIAG: gl.constexpr):
    """The producer's gather of one tile into ring stage `s` (the selected rows' 512 latent + 64 rope
    columns by 16-byte cp.async; masked-off rows zero-filled), then its publication on `ready[s]`
    once every producer thread's copies have landed. Shared by the Gluon forward and backward.
    DIAG 1 (a timing diagnostic): no gather, the ring's stale rows are used. (Publishing one tile
    behind, to keep two tiles in flight, deadlocks with two stages: the consumers release a stage
    only after they get the next tile.)"""
    if DIAG != 1:
        for c in gl.static_range(D_V // 64):
            _cp_async(kv_lat.index(s).slice(c * 64, 64, dim=1), row_ptr + c * 64, mask=vmask)
        _cp_async(kv_rope.index(s), row_ptr + D_V, mask=vmask)
    async_copy.commit_group()
    async_copy.wait_group(0)
    fence_async_shared()  # the consumers' wgmma reads these rows through the async proxy
    _cta_barrier()
    mbarrier.arrive(ready.index(s), count=1)


@gluon.jit
def _consume_tile(i, acc, m_i, l_i, scale_log2, q_lat, q_rope, kv_lat, kv_rope, bias, p_smem,
                  ready, empty, s_lay: gl.constexpr, o_lay: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_K: gl.constexpr, D_V: gl.constexpr,
                  STAGES: gl.constexpr, THRESHOLD: gl.constexpr, FIRST: gl.constexpr, PIPELINE_PV: gl.constexpr,
                  SKIP_RESCALE: gl.constexpr, DIAG: gl.constexpr):
    """One 64-key tile: logits (wgmma over 576 dims), online softmax, P to shared memory, O += P V
    issued (left in flight). `acc`: O, a tensor (FIRST) or the previous tile's in-flight PV.
    DIAG 2 (a timing diagnostic): the tile is received and released, nothing computed."""
    s = i % STAGES
    mbarrier.wait(ready.index(s), (i // STAGES) & 1)
    if DIAG == 2:
        _cta_barrier()
        mbarrier.arrive(empty.index(s), count=1)
        m_use = m_i
    else:
        fence_async_shared()  # cp.async wrote through the generic proxy; wgmma reads through the async one
        kl = kv_lat.index(s)
        sc = warpgroup_mma(q_lat, kl.permute((1, 0)), gl.zeros([BLOCK_H, BLOCK_K], gl.float32, layout=s_lay),
                           use_acc=False, is_async=True)
        sc = warpgroup_mma(q_rope, kv_rope.index(s).permute((1, 0)), sc, is_async=True)
        if FIRST or not PIPELINE_PV:
            sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
        else:
            # the previous tile's PV (issued before these logits) has completed too: release its stage
            # once both warp groups are past their wait (wgmma completion is per warp group)
            acc, sc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, sc))
            _cta_barrier()
            mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), count=1)
        sc = sc * scale_log2 + bias.index(s).load(gl.SliceLayout(0, s_lay))[None, :]
        m_new = gl.maximum(m_i, gl.max(sc, axis=1))
        # FlashAttention-3's rule: keep the stale max unless it grew by more than THRESHOLD
        grow = m_new > m_i + THRESHOLD
        m_use = gl.where(grow, m_new, m_i)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(sc - m_use[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        if not FIRST:
            if SKIP_RESCALE:
                if gl.max(grow.to(gl.int32), axis=0) > 0:  # one branch per CTA: most tiles skip the rescale
                    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_lay))[:, None]
            else:
                acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_lay))[:, None]
        p_smem.store(p.to(p_smem.dtype))
        fence_async_shared()  # each thread orders its P stores before the wgmma's async-proxy reads
        _cta_barrier()
        acc = warpgroup_mma(p_smem, kl.slice(0, D_V, dim=1), acc, use_acc=not FIRST, is_async=True)
        if not PIPELINE_PV:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            _cta_barrier()  # both warp groups' PV done: the stage and P may be overwritten
            mbarrier.arrive(empty.index(s), count=1)
    return acc, m_use, l_i


@gluon.jit
def _consumer(Q, NSLOT, O, LSE, q_lat, q_rope, kv_lat, kv_rope, bias, p_smem, ready, empty, b, t, hb,
              stride_qb, stride_qt, stride_qh, stride_nb,
              stride_ob, stride_ot, stride_oh, stride_lb, stride_lt, scale_log2,
              D_V: gl.constexpr, D_R: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_K: gl.constexpr,
              STAGES: gl.constexpr, THRESHOLD: gl.constexpr, PIPELINE_PV: gl.constexpr,
              SKIP_RESCALE: gl.constexpr, DIAG: gl.constexpr):
    num_warps: gl.constexpr = gl.num_warps()
    # logits [64 heads, 64 keys]: the two warp groups split the keys; O [64, 512]: they split the columns
    s_lay: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])
    o_lay: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                    instr_shape=[16, D_V // 2, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, s_lay)
    col_s: gl.constexpr = gl.SliceLayout(0, s_lay)
    row_o: gl.constexpr = gl.SliceLayout(1, o_lay)

    # q of the head block -> shared memory, once (cp.async, then a barrier and the proxy fence)
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    h_ld = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld))
    c_ld = gl.arange(0, 64, layout=gl.SliceLayout(0, ld))
    q_ptr = Q + b * stride_qb + t * stride_qt + (h_ld * stride_qh)[:, None] + c_ld[None, :]
    for c in gl.static_range(D_V // 64):
        _cp_async(q_lat.slice(c * 64, 64, dim=1), q_ptr + c * 64)
    _cp_async(q_rope, q_ptr + D_V)
    async_copy.commit_group()
    async_copy.wait_group(0)
    fence_async_shared()
    _cta_barrier()

    n_slots = gl.load(NSLOT + b * stride_nb + t)
    n_tiles = gl.maximum(gl.cdiv(n_slots, BLOCK_K), 1)  # >= 1 (the producer agrees): tile 0 is peeled
    m_i = gl.full([BLOCK_H], -1.0e30, gl.float32, layout=row_s)  # finite: an empty row keeps p = 0
    l_i = gl.full([BLOCK_H], 0.0, gl.float32, layout=row_s)
    acc = gl.zeros([BLOCK_H, D_V], gl.float32, layout=o_lay)
    if PIPELINE_PV:
        # tile 0 peeled: the loop then always carries an in-flight PV wgmma (ptxas keeps the wgmma
        # pipeline only when no other instruction defines its accumulator inside a pipeline stage)
        acc, m_i, l_i = _consume_tile(0, acc, m_i, l_i, scale_log2, q_lat, q_rope,
                                      kv_lat, kv_rope, bias, p_smem, ready, empty, s_lay, o_lay, BLOCK_H, BLOCK_K,
                                      D_V, STAGES, THRESHOLD, True, PIPELINE_PV, SKIP_RESCALE, DIAG)
        for i in range(1, n_tiles):
            acc, m_i, l_i = _consume_tile(i, acc, m_i, l_i, scale_log2, q_lat, q_rope,
                                          kv_lat, kv_rope, bias, p_smem, ready, empty, s_lay, o_lay, BLOCK_H,
                                          BLOCK_K, D_V, STAGES, THRESHOLD, False, PIPELINE_PV, SKIP_RESCALE, DIAG)
    else:  # each tile's PV waited for at its end
        for i in range(n_tiles):
            acc, m_i, l_i = _consume_tile(i, acc, m_i, l_i, scale_log2, q_lat, q_rope,
                                          kv_lat, kv_rope, bias, p_smem, ready, empty, s_lay, o_lay, BLOCK_H,
                                          BLOCK_K, D_V, STAGES, THRESHOLD, False, PIPELINE_PV, SKIP_RESCALE, DIAG)
    if PIPELINE_PV:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        _cta_barrier()
        mbarrier.arrive(empty.index((n_tiles + STAGES - 1) % STAGES), count=1)

    has = l_i > 0
    inv_l = 1.0 / gl.where(has, l_i, 1.0)
    # out through shared memory (q's buffer, free now): coalesced 16-byte stores, few live pointers
    q_lat.store((acc * gl.convert_layout(inv_l, row_o)[:, None]).to(q_lat.dtype))
    _cta_barrier()
    st: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])  # not q's: nothing kept live
    h_st = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, st))
    c_st = gl.arange(0, 128, layout=gl.SliceLayout(0, st))
    o_ptr = O + b * stride_ob + t * stride_ot + (h_st * stride_oh)[:, None] + c_st[None, :]
    for c in gl.static_range(D_V // 128):
        gl.store(o_ptr + c * 128, q_lat.slice(c * 128, 128, dim=1).load(st))
    lse = gl.where(has, (m_i + gl.log2(gl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    h_s = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=row_s)
    gl.store(LSE + b * stride_lb + t * stride_lt + h_s, lse)


@gluon.jit
def _head_block_token_batch(N_HB):
    """A CTA's place in the grid (tokens x N_HB head blocks, B), the head block fastest: -> (head
    block hb, token t (int64), batch b (int64))."""
    pid = gl.program_id(0)
    hb = pid % N_HB
    t = (pid // N_HB).to(gl.int64)
    b = gl.program_id(1).to(gl.int64)
    return hb, t, b


@gluon.jit
def _ring_barriers(STAGES: gl.constexpr):
    """The mbarriers of a producer / consumer ring of STAGES stages, each initialized for one arrival:
    -> (ready [STAGES, 1]: the producer's copy into stage s landed, empty [STAGES, 1]: the consumers
    released stage s)."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(STAGES):
        mbarrier.init(ready.index(st), count=1)
        mbarrier.init(empty.index(st), count=1)
    return ready, empty


@gluon.jit
def _sparse_mla_fwd_gluon_kernel(
    Q, KV, IDX, NSLOT, O, LSE,
    stride_qb, stride_qt, stride_qh,
    stride_kvb, stride_kvt,
    stride_ib, stride_it,
    stride_nb,
    stride_ob, stride_ot, stride_oh,
    stride_lb, stride_lt,
    H, N_KV, N_HB, scale_log2,
    D_V: gl.constexpr, D_R: gl.constexpr,
    BLOCK_H: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_DV: gl.constexpr, BLOCK_DR: gl.constexpr,
    EVEN_H: gl.constexpr, VALUE_SPLIT: gl.constexpr,
    STAGES: gl.constexpr, PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    THRESHOLD: gl.constexpr, PIPELINE_PV: gl.constexpr, SKIP_RESCALE: gl.constexpr, DIAG: gl.constexpr,
):
    # program (x, y) -> (token, head block), the head block fastest; y = b. The launcher admits this
    # kernel only where H % 64 == 0, D_V = 512 (any multiple of 128 up to 512), D_R = 64, 16-bit inputs.
    hb, t, b = _head_block_token_batch(N_HB)
    dtype: gl.constexpr = Q.dtype.element_ty
    sh: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q_lat = gl.allocate_shared_memory(dtype, [BLOCK_H, D_V], sh)
    q_rope = gl.allocate_shared_memory(dtype, [BLOCK_H, D_R], sh)
    kv_lat = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, D_V], sh)
    kv_rope = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, D_R], sh)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_K], sh)
    bias = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_K],
                                     gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
    ready, empty = _ring_barriers(STAGES)
    gl.warp_specialize([
        (_consumer, (Q, NSLOT, O, LSE, q_lat, q_rope, kv_lat, kv_rope, bias, p_smem, ready, empty, b, t, hb,
                     stride_qb, stride_qt, stride_qh, stride_nb,
                     stride_ob, stride_ot, stride_oh, stride_lb, stride_lt, scale_log2,
                     D_V, D_R, BLOCK_H, BLOCK_K, STAGES, THRESHOLD, PIPELINE_PV, SKIP_RESCALE, DIAG)),
        (_producer, (KV, IDX, NSLOT, kv_lat, kv_rope, bias, ready, empty, b, t,
                     stride_kvb, stride_kvt, stride_ib, stride_it, stride_nb, N_KV,
                     D_V, D_R, BLOCK_K, STAGES, DIAG)),
    ], [PRODUCER_WARPS], [PRODUCER_REGS])


class GluonLaunch(Launch):
    """A `Launch` of a Gluon kernel: also passes `maxnreg` (the register budget the warp-specialized
    partitions split with setmaxnreg)."""

    def __init__(self, *args, maxnreg: int | None = None, **kw):
        super().__init__(*args, **kw)
        self.maxnreg = maxnreg

    def options(self) -> dict:
        # num_stages is the ring's depth (a kernel argument, kept here for the reports); Triton's
        # software pipeliner has nothing to do in a Gluon kernel, so it is not passed on
        opts = {"num_warps": self.num_warps}
        if self.maxnreg is not None:
            opts["maxnreg"] = self.maxnreg
        return opts


def gluon_fwd_supported(q, kv, d_v: int, capability: int) -> str | None:
    """None when the Gluon forward takes this call, else why not (one phrase)."""
    B, T, H, D = q.shape
    if capability != 90:
        return f"sm_{capability} (the kernel is sm_90a: wgmma)"
    if q.dtype != kv.dtype or q.element_size() != 2:
        return f"dtype {q.dtype} / {kv.dtype} (needs one 16-bit dtype)"
    if H % BLOCK_H:
        return f"H = {H} (needs a multiple of {BLOCK_H})"
    if D - d_v != 64 or d_v % 128 or not 128 <= d_v <= 512:
        return f"d_v = {d_v}, rope {D - d_v} (needs rope 64 and d_v a multiple of 128 up to 512)"
    if q.stride(-1) != 1 or kv.stride(-1) != 1:
        return "non-contiguous last dim"
    return None


def plan_fwd_gluon(q, kv, indices, n_slots, out, lse, scale: float, d_v: int, grid: tuple, pipeline_pv: bool = False,
                   producer_regs: int | None = None, skip_rescale: bool = False) -> GluonLaunch:
    """The Gluon forward's launch (`kernel.plan_fwd`'s arguments; `grid` = (tokens x head blocks, B),
    checked there against CUDA's limits); the caller checks `gluon_fwd_supported` first."""

    B, T, H, D = q.shape
    n_hb = H // BLOCK_H
    return GluonLaunch(
        _sparse_mla_fwd_gluon_kernel, grid,
        dict(
            **_fwd_args(q, kv, indices, n_slots, out, lse),
            H=H, N_KV=kv.shape[1], N_HB=n_hb, scale_log2=scale * LOG2E,
            D_V=d_v, D_R=D - d_v, BLOCK_H=BLOCK_H, BLOCK_K=BLOCK_K, BLOCK_DV=d_v, BLOCK_DR=D - d_v,
            EVEN_H=True, VALUE_SPLIT=1, STAGES=STAGES, PRODUCER_WARPS=PRODUCER_WARPS,
            PRODUCER_REGS=producer_regs or PRODUCER_REGS, THRESHOLD=RESCALE_THRESHOLD, PIPELINE_PV=pipeline_pv, SKIP_RESCALE=skip_rescale, DIAG=0,
        ),
        num_warps=CONSUMER_WARPS, num_stages=STAGES, maxnreg=MAXNREG,
    )
