"""The sparse indexer KL's target at the selected slots (report eq. 4): p_sum[t, s] = Sigma_h
softmax_h(scale q_h . kv[s]) from the sparse MLA forward's lse, per chunk of tokens (`plan_sparse_kl_target`).
Its users: the sparse MLA forward's "target-kernel" way (`kernel.sparse_mla_fwd(p_sum=...)`) and
the indexer KL's separate-gather path (`indexer_kl.function._sparse_run`), which imports it from
here (the KL sits above the attention). Per head block the query stays resident while the selected
KV rows stream past; head blocks are added in a [B, C, K] fp32 scratch in order."""

from __future__ import annotations

import triton
import triton.language as tl

from ..._triton_common import Launch, pow2

LOG2E = 1.4426950408889634


@triton.jit
def _sparse_kl_target_kernel(
    QM, KVM, IDX, NSLOT, LSE, P_SUM,
    stride_qmb, stride_qmt, stride_qmh,
    stride_kvb, stride_kvt,
    stride_ib, stride_it,
    stride_nb,
    stride_lb, stride_lt,
    stride_pb, stride_pt,
    t0, H, N_KEYS, scale_log2,
    D_A: tl.constexpr, D_B: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr,
):
    """Sigma_h P[t, slot] = sum_h exp(scale q_h . kv[idx[t, slot]] - lse_h) (eq. 4's target before
    the 1/H normalization) for one token t0 + program, every selected slot -> P_SUM [B, C, K].
    Head blocks of BLOCK_H: the block's queries stay resident ([BLOCK_H, D_A] + [BLOCK_H, D_B],
    D = D_A + D_B, e.g. 512 + 64) while the selected KV rows stream past in BLOCK_K-slot tiles;
    the head blocks' partial sums are added in P_SUM in order (deterministic)."""
    c = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    t = t0 + c
    offs_a = tl.arange(0, BLOCK_DA)
    mask_a = offs_a < D_A
    offs_bd = tl.arange(0, BLOCK_DB)
    mask_bd = offs_bd < D_B
    idx_base = IDX + b * stride_ib + t * stride_it
    kv_base = KVM + b * stride_kvb
    p_base = P_SUM + b * stride_pb + c * stride_pt
    n_slots = tl.load(NSLOT + b * stride_nb + t)  # slots after the last valid one are all -1
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask_h = offs_h < H
        q_ptrs = QM + b * stride_qmb + t * stride_qmt + offs_h[:, None] * stride_qmh
        q_a = tl.load(q_ptrs + offs_a[None, :], mask=mask_h[:, None] & mask_a[None, :], other=0.0)
        if D_B > 0:
            q_b = tl.load(q_ptrs + D_A + offs_bd[None, :], mask=mask_h[:, None] & mask_bd[None, :], other=0.0)
        lse = tl.load(LSE + b * stride_lb + t * stride_lt + offs_h, mask=mask_h, other=float("-inf"))
        lse2 = tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)  # as the reference
        for k0 in range(0, n_slots, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            idx = tl.load(idx_base + offs_k, mask=offs_k < n_slots, other=-1)
            valid = (idx >= 0) & (idx < N_KEYS)  # out of range: an empty slot (`check_indices`)
            rows = kv_base + tl.where(valid, idx, 0).to(tl.int64)[:, None] * stride_kvt
            kv_a = tl.load(rows + offs_a[None, :], mask=valid[:, None] & mask_a[None, :], other=0.0)
            s = tl.dot(q_a, tl.trans(kv_a))  # [BLOCK_H, BLOCK_K]
            if D_B > 0:
                kv_b = tl.load(rows + D_A + offs_bd[None, :], mask=valid[:, None] & mask_bd[None, :], other=0.0)
                s += tl.dot(q_b, tl.trans(kv_b))
            ph = tl.exp2(s * scale_log2 - lse2[:, None])
            ph = tl.where(mask_h[:, None] & valid[None, :], ph, 0.0)
            p = tl.sum(ph, 0)
            if h0 > 0:
                p += tl.load(p_base + offs_k, mask=offs_k < n_slots, other=0.0)
            tl.store(p_base + offs_k, p, mask=offs_k < n_slots)
        # the next head block reads these sums back, possibly in other threads: make them visible
        tl.debug_barrier()


TARGET_CHUNK_ELEMS = 1 << 26  # fp32 elements of the [B, C, K] head-summed target scratch (256 MB)


def sparse_target_blocks(H: int, D: int) -> dict:
    """Head block, slot tile, and the split of D into two power-of-two operands (576 = 512 + 64)."""
    d_a = 16
    while d_a * 2 <= D:
        d_a *= 2
    d_b = max(D - d_a, 0)
    # all 128 heads of the 671B model in one block: each selected KV row is gathered once per token
    # (64-head blocks gathered it twice); 8 warps, 2 stages: 92 registers, 217 KB on sm_90a
    return dict(BLOCK_H=min(pow2(H), 128), BLOCK_K=32, D_A=min(d_a, D), D_B=d_b, BLOCK_DA=d_a,
                BLOCK_DB=pow2(max(d_b, 1)))


def plan_sparse_kl_target(qm, kvm, idx, n_slots, lse, p_sum, t0: int, scale: float) -> Launch:
    """qm [B, T, H, D] (T query rows), kvm [B, N, D] (N key rows: N > T under context
    parallelism, the gathered sequence), idx [B, T, K] int32 key rows (-1 empty; outside [0, N)
    read as empty), n_slots [B, T] int32 (`slot_counts`), lse [B, T, H] fp32 (natural log, from
    sparse_mla's forward) -> p_sum [B, C, K] fp32: the head-summed target of query rows
    [t0, t0 + C) at their slots (slots past n_slots untouched)."""
    B, T, H, D = qm.shape
    C = p_sum.shape[1]
    return Launch(
        _sparse_kl_target_kernel, (C, B),
        dict(
            QM=qm, KVM=kvm, IDX=idx, NSLOT=n_slots, LSE=lse, P_SUM=p_sum,
            stride_qmb=qm.stride(0), stride_qmt=qm.stride(1), stride_qmh=qm.stride(2),
            stride_kvb=kvm.stride(0), stride_kvt=kvm.stride(1),
            stride_ib=idx.stride(0), stride_it=idx.stride(1),
            stride_nb=n_slots.stride(0),
            stride_lb=lse.stride(0), stride_lt=lse.stride(1),
            stride_pb=p_sum.stride(0), stride_pt=p_sum.stride(1),
            t0=t0, H=H, N_KEYS=kvm.shape[1], scale_log2=scale * LOG2E,
            **sparse_target_blocks(H, D),
        ),
        num_warps=8, num_stages=2,
    )
