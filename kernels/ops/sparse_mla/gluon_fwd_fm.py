"""EXPERIMENTAL, benchmark-only: the sparse MLA forward with FlashMLA's alternating key tiles (issue 31).

Not in any autotuning space, not run by gpu-check: only `benchmarks/gluon_sparse_mla.py` times it
(config "gluon-fm", last, under its deadline) and compares it with the Triton forward. Compiled at
the 671B shapes for sm_90a (Triton 3.6 and 3.9) when written; never run.

Difference from `gluon_fwd.py` (read that first): there the two consumer warp groups split every
tile's 64 keys (wgmma N = 32 each), so both read all of q for every tile (144 KB of shared memory
per tile for the logits' A operand) and every row statistic needs a cross-warp-group reduction. Here
each consumer warp group owns whole tiles, alternately (tile j: warp group j % 2): it computes
`S_j = q kv_j^T` [64 x 64] alone (N = 64, q read once per tile), the softmax of its tile inside the
warp group, and publishes P_j (one shared buffer) and the tile's row statistics (running max,
rescale factor, row sum; two slots). Both warp groups then apply every tile to their own 256 of the
512 value columns in tile order (`O_half = O_half * alpha_j + P_j V_j[:, half]`), so the running max
and sum are identical in both. Each warp group issues its own tile's logits before it applies the
other's previous tile, so the two overlap. Partitions: warp group 0 (the default partition), warp
group 1 and the producer (workers). Barriers: ready / empty (ring, as in gluon_fwd; empty counts both
warp groups), sready[2] (tile j's P and statistics published, slot j % 2), pfree (both warp groups
are done with P_j: the next tile's owner may overwrite it), done (both warp groups past their last
logits: q's buffer may take the output).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .gluon_fwd import (LOG2E, MAXNREG, PRODUCER_REGS, RESCALE_THRESHOLD, GluonLaunch, _cta_barrier,
                        _cp_async, _producer)

CONSUMER_REGS = 232  # each consumer warp group: (168 x 384 - 40 x 128) / 256


@gluon.jit
def _fm_other(j, acc, m_i, l_i, kv_lat, p_smem, stats, ready, empty, sready, pfree,
              W: gl.constexpr, o_lay: gl.constexpr, row_s: gl.constexpr, D_V: gl.constexpr, STAGES: gl.constexpr):
    """Apply the other warp group's tile j: its published P and statistics, this warp group's columns."""
    s = j % STAGES
    mbarrier.wait(ready.index(s), (j // STAGES) & 1)
    mbarrier.wait(sready.index(j % 2), (j // 2) & 1)
    fence_async_shared()
    m_new = stats.index((j % 2) * 3).load(row_s)
    alpha = stats.index((j % 2) * 3 + 1).load(row_s)
    rs = stats.index((j % 2) * 3 + 2).load(row_s)
    l_i = l_i * alpha + rs
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_lay))[:, None]
    HALF: gl.constexpr = D_V // 2
    acc = warpgroup_mma(p_smem, kv_lat.index(s).slice(W * HALF, HALF, dim=1), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    _cta_barrier()
    mbarrier.arrive(empty.index(s), count=1)
    mbarrier.arrive(pfree, count=1)
    return acc, m_new, l_i


@gluon.jit
def _fm_consumer(Q, O, LSE, NSLOT, q_lat, q_rope, kv_lat, kv_rope, bias, p_smem, stats,
                 ready, empty, sready, pfree, done, b, t, hb,
                 stride_qb, stride_qt, stride_qh, stride_nb, stride_ob, stride_ot, stride_oh, stride_lb, stride_lt,
                 scale_log2, W: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr, BLOCK_H: gl.constexpr,
                 BLOCK_K: gl.constexpr, STAGES: gl.constexpr, THRESHOLD: gl.constexpr):
    HALF: gl.constexpr = D_V // 2
    s_lay: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    o_lay: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, s_lay)
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    if W == 0:  # q of the head block -> shared memory once (warp group 1 waits on `done`'s first phase)
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
        mbarrier.arrive(done.index(0), count=1)
    mbarrier.wait(done.index(0), 0)

    n_slots = gl.load(NSLOT + b * stride_nb + t)
    n_tiles = gl.maximum(gl.cdiv(n_slots, BLOCK_K), 1)
    m_i = gl.full([BLOCK_H], -1.0e30, gl.float32, layout=row_s)
    l_i = gl.full([BLOCK_H], 0.0, gl.float32, layout=row_s)
    acc = gl.zeros([BLOCK_H, HALF], gl.float32, layout=o_lay)
    s_zero = gl.zeros([BLOCK_H, BLOCK_K], gl.float32, layout=s_lay)
    for j in range(W, n_tiles, 2):  # this warp group's tiles
        if j >= 1:  # first the other warp group's previous tile (it computed those logits meanwhile)
            acc, m_i, l_i = _fm_other(j - 1, acc, m_i, l_i, kv_lat, p_smem, stats, ready, empty, sready, pfree,
                                      W, o_lay, row_s, D_V, STAGES)
        s = j % STAGES
        mbarrier.wait(ready.index(s), (j // STAGES) & 1)
        fence_async_shared()
        kl = kv_lat.index(s)
        sc = warpgroup_mma(q_lat, kl.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        sc = warpgroup_mma(q_rope, kv_rope.index(s).permute((1, 0)), sc, is_async=True)
        sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
        sc = sc * scale_log2 + bias.index(s).load(gl.SliceLayout(0, s_lay))[None, :]
        m_new = gl.maximum(m_i, gl.max(sc, axis=1))
        grow = m_new > m_i + THRESHOLD
        m_use = gl.where(grow, m_new, m_i)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(sc - m_use[:, None])
        rs = gl.sum(p, axis=1)
        # P's buffer is free once both warp groups applied tile j - 1
        mbarrier.wait(pfree, (j - 1) & 1, pred=j >= 1)
        p_smem.store(p.to(p_smem.dtype))
        stats.index((j % 2) * 3).store(m_use)
        stats.index((j % 2) * 3 + 1).store(alpha)
        stats.index((j % 2) * 3 + 2).store(rs)
        fence_async_shared()
        _cta_barrier()
        mbarrier.arrive(sready.index(j % 2), count=1)
        l_i = l_i * alpha + rs
        m_i = m_use
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_lay))[:, None]
        acc = warpgroup_mma(p_smem, kl.slice(W * HALF, HALF, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        _cta_barrier()
        mbarrier.arrive(empty.index(s), count=1)
        mbarrier.arrive(pfree, count=1)
    if (n_tiles - 1) % 2 != W:  # the other warp group's last tile comes after this one's
        acc, m_i, l_i = _fm_other(n_tiles - 1, acc, m_i, l_i, kv_lat, p_smem, stats, ready, empty, sready, pfree,
                                  W, o_lay, row_s, D_V, STAGES)
    # both warp groups past their last logits: q's buffer takes the output, each its half
    mbarrier.arrive(done.index(1), count=1)
    mbarrier.wait(done.index(1), 0)
    has = l_i > 0
    inv_l = 1.0 / gl.where(has, l_i, 1.0)
    half = q_lat.slice(W * HALF, HALF, dim=1)
    half.store((acc * gl.convert_layout(inv_l, gl.SliceLayout(1, o_lay))[:, None]).to(q_lat.dtype))
    _cta_barrier()
    st_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    h_st = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, st_l))
    c_st = gl.arange(0, 128, layout=gl.SliceLayout(0, st_l))
    o_ptr = O + b * stride_ob + t * stride_ot + (h_st * stride_oh)[:, None] + W * HALF + c_st[None, :]
    for c in gl.static_range(HALF // 128):
        gl.store(o_ptr + c * 128, half.slice(c * 128, 128, dim=1).load(st_l))
    if W == 0:
        lse = gl.where(has, (m_i + gl.log2(gl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        h_s = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=row_s)
        gl.store(LSE + b * stride_lb + t * stride_lt + h_s, lse)


@gluon.jit
def _fm_wg0(Q, O, LSE, NSLOT, q_lat, q_rope, kv_lat, kv_rope, bias, p_smem, stats, ready, empty, sready, pfree, done,
            b, t, hb, stride_qb, stride_qt, stride_qh, stride_nb, stride_ob, stride_ot, stride_oh, stride_lb, stride_lt,
            scale_log2, D_V: gl.constexpr, D_R: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_K: gl.constexpr,
            STAGES: gl.constexpr, THRESHOLD: gl.constexpr):
    _fm_consumer(Q, O, LSE, NSLOT, q_lat, q_rope, kv_lat, kv_rope, bias, p_smem, stats, ready, empty, sready, pfree,
                 done, b, t, hb, stride_qb, stride_qt, stride_qh, stride_nb, stride_ob, stride_ot, stride_oh,
                 stride_lb, stride_lt, scale_log2, 0, D_V, D_R, BLOCK_H, BLOCK_K, STAGES, THRESHOLD)


@gluon.jit
def _fm_wg1(Q, O, LSE, NSLOT, q_lat, q_rope, kv_lat, kv_rope, bias, p_smem, stats, ready, empty, sready, pfree, done,
            b, t, hb, stride_qb, stride_qt, stride_qh, stride_nb, stride_ob, stride_ot, stride_oh, stride_lb, stride_lt,
            scale_log2, D_V: gl.constexpr, D_R: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_K: gl.constexpr,
            STAGES: gl.constexpr, THRESHOLD: gl.constexpr):
    _fm_consumer(Q, O, LSE, NSLOT, q_lat, q_rope, kv_lat, kv_rope, bias, p_smem, stats, ready, empty, sready, pfree,
                 done, b, t, hb, stride_qb, stride_qt, stride_qh, stride_nb, stride_ob, stride_ot, stride_oh,
                 stride_lb, stride_lt, scale_log2, 1, D_V, D_R, BLOCK_H, BLOCK_K, STAGES, THRESHOLD)


@gluon.jit
def _sparse_mla_fwd_gluon_fm_kernel(
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
    STAGES: gl.constexpr, PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr, THRESHOLD: gl.constexpr,
):
    pid = gl.program_id(0)
    hb = pid % N_HB
    t = (pid // N_HB).to(gl.int64)
    b = gl.program_id(1).to(gl.int64)
    dtype: gl.constexpr = Q.dtype.element_ty
    sh: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    q_lat = gl.allocate_shared_memory(dtype, [BLOCK_H, D_V], sh)
    q_rope = gl.allocate_shared_memory(dtype, [BLOCK_H, D_R], sh)
    kv_lat = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, D_V], sh)
    kv_rope = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, D_R], sh)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_K], sh)
    bias = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_K], flat)
    stats = gl.allocate_shared_memory(gl.float32, [6, BLOCK_H], flat)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    sready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    pfree = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(STAGES):
        mbarrier.init(ready.index(st), count=1)
        mbarrier.init(empty.index(st), count=2)  # both consumer warp groups apply every tile
    for st in gl.static_range(2):
        mbarrier.init(sready.index(st), count=1)
    mbarrier.init(pfree, count=2)
    mbarrier.init(done.index(0), count=1)  # q staged (warp group 0)
    mbarrier.init(done.index(1), count=2)  # both past their last logits
    gl.warp_specialize([
        (_fm_wg0, (Q, O, LSE, NSLOT, q_lat, q_rope, kv_lat, kv_rope, bias, p_smem, stats, ready, empty, sready, pfree,
                   done, b, t, hb, stride_qb, stride_qt, stride_qh, stride_nb, stride_ob, stride_ot, stride_oh,
                   stride_lb, stride_lt, scale_log2, D_V, D_R, BLOCK_H, BLOCK_K, STAGES, THRESHOLD)),
        (_fm_wg1, (Q, O, LSE, NSLOT, q_lat, q_rope, kv_lat, kv_rope, bias, p_smem, stats, ready, empty, sready, pfree,
                   done, b, t, hb, stride_qb, stride_qt, stride_qh, stride_nb, stride_ob, stride_ot, stride_oh,
                   stride_lb, stride_lt, scale_log2, D_V, D_R, BLOCK_H, BLOCK_K, STAGES, THRESHOLD)),
        (_producer, (KV, IDX, NSLOT, kv_lat, kv_rope, bias, ready, empty, b, t,
                     stride_kvb, stride_kvt, stride_ib, stride_it, stride_nb, N_KV,
                     D_V, D_R, BLOCK_K, STAGES, 0)),
    ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])


def plan_fwd_gluon_fm(q, kv, indices, n_slots, out, lse, scale: float, d_v: int, grid: tuple) -> GluonLaunch:
    """The experimental kernel's launch (same arguments as `gluon_fwd.plan_fwd_gluon`)."""
    from .gluon_fwd import BLOCK_H, BLOCK_K, STAGES

    B, T, H, D = q.shape
    return GluonLaunch(
        _sparse_mla_fwd_gluon_fm_kernel, grid,
        dict(
            Q=q, KV=kv, IDX=indices, NSLOT=n_slots, O=out, LSE=lse,
            stride_qb=q.stride(0), stride_qt=q.stride(1), stride_qh=q.stride(2),
            stride_kvb=kv.stride(0), stride_kvt=kv.stride(1),
            stride_ib=indices.stride(0), stride_it=indices.stride(1),
            stride_nb=n_slots.stride(0),
            stride_ob=out.stride(0), stride_ot=out.stride(1), stride_oh=out.stride(2),
            stride_lb=lse.stride(0), stride_lt=lse.stride(1),
            H=H, N_KV=kv.shape[1], N_HB=H // BLOCK_H, scale_log2=scale * LOG2E,
            D_V=d_v, D_R=D - d_v, BLOCK_H=BLOCK_H, BLOCK_K=BLOCK_K, BLOCK_DV=d_v, BLOCK_DR=D - d_v,
            EVEN_H=True, VALUE_SPLIT=1, STAGES=STAGES, PRODUCER_REGS=PRODUCER_REGS, CONSUMER_REGS=CONSUMER_REGS,
            THRESHOLD=RESCALE_THRESHOLD,
        ),
        num_warps=4, num_stages=STAGES, maxnreg=MAXNREG,
    )
