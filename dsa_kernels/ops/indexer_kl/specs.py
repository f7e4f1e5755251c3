"""Indexer KL launches at the 671B shapes (with gradient: the training path), for the compile
report. The dense KL runs in both of MLA's forms (MHA: per-head 192-dim keys; MQA: the shared
576-dim key), so both are compiled."""

from __future__ import annotations

import torch

from ...analysis import Work
from ...registry import SHAPES_671B, KernelCase, register
from ..dense_attention.specs import causal_blocks, causal_keys_per_row
from .kernel import TARGET_CHUNK_ELEMS, plan_dense_kl, plan_dense_lse, plan_sparse_kl, plan_sparse_kl_target


def _config(launch, prefix="") -> str:
    a = launch.args
    keys = [k for k in a if k.startswith("BLOCK")]
    stages = f" stages={launch.num_stages}" if launch.num_stages else ""
    return prefix + " ".join(f"{k}={a[k]}" for k in keys) + f" warps={launch.num_warps}{stages} grid={launch.grid}"


def _indexer(meta):
    s = SHAPES_671B
    B, T = s["B"], s["T"]
    qi = torch.empty(B, T, s["H_I"], s["D_I"], dtype=torch.bfloat16, **meta)
    ki = torch.empty(B, T, s["D_I"], dtype=torch.bfloat16, **meta)
    wi = torch.empty(B, T, s["H_I"], dtype=torch.float32, **meta)
    kl = torch.empty(B, T, dtype=torch.float32, **meta)
    dq = torch.empty(B, T, s["H_I"], s["D_I"], dtype=torch.float32, **meta)
    dk = torch.empty(B, T, s["D_I"], dtype=torch.float32, **meta)
    dw = torch.empty(B, T, s["H_I"], dtype=torch.float32, **meta)
    return qi, ki, wi, kl, dq, dk, dw


@register("sparse_indexer_kl")
def _sparse():
    s = SHAPES_671B
    meta = dict(device="meta")
    B, T, H, D, K = s["B"], s["T"], s["H"], s["D"], s["K"]
    qi, ki, wi, kl, dq, dk, dw = _indexer(meta)
    idx = torch.empty(B, T, K, dtype=torch.int32, **meta)
    qm = torch.empty(B, T, H, D, dtype=torch.bfloat16, **meta)
    kvm = torch.empty(B, T, D, dtype=torch.bfloat16, **meta)
    lse = torch.empty(B, T, H, dtype=torch.float32, **meta)
    n_slots = torch.empty(B, T, dtype=torch.int32, **meta)
    C = max(1, min(T, TARGET_CHUNK_ELEMS // (B * K)))  # the launcher's token chunk
    p_sum = torch.empty(B, C, K, dtype=torch.float32, **meta)
    target = plan_sparse_kl_target(qm, kvm, idx, n_slots, lse, p_sum, T - C, D**-0.5)
    launch = plan_sparse_kl(qi, ki, wi, idx, n_slots, p_sum, T - C, H, kl, kl, dq, dk, dw, True)
    return [KernelCase(_config(target, "target "), target, work=sparse_target_work(target)),
            KernelCase(_config(launch, "kl "), launch, work=sparse_kl_work(launch))]


@register("dense_indexer_kl")
def _dense():
    s = SHAPES_671B
    meta = dict(device="meta")
    B, T, H = s["B"], s["T"], s["H"]
    qi, ki, wi, kl, dq, dk, dw = _indexer(meta)
    ds = torch.empty(B, T, dtype=torch.int64, **meta)
    lse2 = torch.empty(B, H, T, dtype=torch.float32, **meta)
    cases = []
    for form, D, kh in (("mha", s["D_QK_MHA"], H), ("mqa", s["D"], 1)):
        qm = torch.empty(B, T, H, D, dtype=torch.bfloat16, **meta)
        km = torch.empty(B, T, kh, D, dtype=torch.bfloat16, **meta)
        lse_launch = plan_dense_lse(qm, km, ds, lse2, D**-0.5)
        cases.append(KernelCase(_config(lse_launch, f"{form} D={D} "), lse_launch, work=dense_lse_work(lse_launch)))
        # the autograd forward's statistics pass, and the backward's gradient pass alone (it reads the
        # forward's per-row indexer logsumexp and target mass)
        for name, grad in (("fwd", False), ("bwd", True)):
            kl_launch = plan_dense_kl(qm, km, qi, ki, wi, ds, lse2, kl, kl, dq, dk, dw, D**-0.5, grad, stats=not grad)
            cases.append(KernelCase(_config(kl_launch, f"{form} {name} D={D} "), kl_launch,
                                    work=dense_kl_work(kl_launch)))
    from .fused_specs import fused_cases  # the one-pass path (`fused.py`, DSA_DENSE_KL=fused)

    return cases + fused_cases(_config)


# ---- the analysis column (`dsa_kernels.analysis.Work`): per token, from each launch's block sizes ----
#
# useful: 2 x the multiply-adds of the products this launch's outputs need, each counted once
# (the elementwise softmax / ReLU / KL terms are not counted); issued: every tl.dot at its block
# shape (recomputed tiles, padded rows and masked slots included); bytes: every load / store /
# atomic add the kernel issues, masked-off elements excluded, re-reads included. Sparse: one program
# per token, every row with all K slots valid (rows t < K of a sequence have t + 1 and walk less).
# Dense: one document per sequence (doc_start = 0), per token = the launch's total / (B x T).


def _tiles(n: int, block: int) -> int:
    return -(-n // block)


def sparse_target_work(launch) -> Work:
    a = launch.args
    H, D = a["H"], a["D_A"] + a["D_B"]
    K = a["IDX"].shape[-1]
    bh, bk = a["BLOCK_H"], a["BLOCK_K"]
    n_hb, tiles = _tiles(H, bh), _tiles(K, bk)
    e_q, e_kv, e_i, e_p = (a[k].element_size() for k in ("QM", "KVM", "IDX", "P_SUM"))
    # per head block and slot tile: q_a kv_a^T (+ q_b kv_b^T when D_B > 0)
    issued = n_hb * tiles * 2.0 * bh * bk * (a["BLOCK_DA"] + (a["BLOCK_DB"] if a["D_B"] > 0 else 0))
    # the slot count; per head block its q rows and lse once, then per slot the index and the
    # gathered D-wide row (again for every head block), and the partial sums of the earlier head
    # blocks read back
    reads = (a["NSLOT"].element_size() + H * (D * e_q + a["LSE"].element_size())
             + n_hb * K * (e_i + D * e_kv) + (n_hb - 1) * K * e_p)
    writes = n_hb * K * e_p  # Sigma_h P stored after every head block
    useful = 2.0 * H * K * D  # q_h . kv[s] per head and selected slot
    return Work(useful, issued, reads, writes, gather_bytes=n_hb * K * D * e_kv)


def sparse_kl_work(launch) -> Work:
    a = launch.args
    HI, DI, grad = a["HI"], a["DI"], a["GRAD"]
    K = a["IDX"].shape[-1]
    bk, bhi, bdi = a["BLOCK_K"], a["BLOCK_HI"], a["BLOCK_DI"]
    tiles = _tiles(K, bk)
    passes = 2 if grad else 1
    # per slot tile: q_I k_I^T; the gradient pass again, then dq_I += da k_I and dk = da^T q_I
    issued = tiles * 2.0 * bhi * bk * bdi * (1 + 3 * grad)
    e_qi, e_ki = a["QI"].element_size(), a["KI"].element_size()
    per_slot = a["IDX"].element_size() + a["P_SUM"].element_size() + DI * e_ki  # index, target, k_I row
    reads = a["NSLOT"].element_size() + HI * (DI * e_qi + a["WI"].element_size()) + passes * K * per_slot
    writes = a["KL"].element_size() + a["KLU"].element_size()
    if grad:  # dk_I atomics per slot; dq_I and dw rows of the token once
        writes += K * DI * a["DKI"].element_size() + HI * (DI * a["DQI"].element_size() + a["DWI"].element_size())
    # I = sum_j w_j ReLU(q_I,j . k_I[s]) per slot; with the gradient also dq_I and dk_I
    useful = 2.0 * HI * DI * K * (1 + 2 * grad)
    return Work(useful, issued, reads, writes, gather_bytes=passes * K * DI * e_ki)


def dense_lse_work(launch) -> Work:
    a = launch.args
    T, H, D = a["T"], a["H"], a["D"]
    bm, bn, bd = a["BLOCK_M"], a["BLOCK_N"], a["BLOCK_D"]
    e = a["QM"].element_size()
    blocks = causal_blocks(T, bm, bn)
    # per key tile, per BLOCK_D slice of D: q k^T
    issued = sum(t for _, t, _ in blocks) * 2.0 * bm * bn * bd * _tiles(D, bd)
    # per program: its rows' doc starts; per key tile its q rows again (all of D) and the key rows
    # (the MQA form's one key head is loaded by every head's programs alike)
    reads = sum(r * a["DS"].element_size() + t * r * D * e + k * D * e for r, t, k in blocks)
    writes = T * a["LSE2"].element_size()
    useful = 2.0 * H * D * causal_keys_per_row(T)  # the main logits over the causal keys
    return Work(useful, issued * H / T, reads * H / T, writes * H / T)


def dense_kl_work(launch) -> Work:
    a = launch.args
    T, H, HI, D, DI, grad, stats = a["T"], a["H"], a["HI"], a["D"], a["DI"], a["GRAD"], a["STATS"]
    bm, bn, bd, bdi = a["BLOCK_M"], a["BLOCK_N"], a["BLOCK_D"], a["BLOCK_DI"]
    e, e_i = a["QM"].element_size(), a["QI"].element_size()
    passes = int(stats) + int(grad)
    blocks = causal_blocks(T, bm, bn)
    n_tiles = sum(t for _, t, _ in blocks)
    # per key tile and pass (`_dense_tiles`): every main head's q k^T by BLOCK_D slices, every
    # indexer head's q_I k_I^T; the gradient pass adds per indexer head q_I k_I^T again, da k_I, q_I^T da
    tile_flops = 2.0 * bm * bn * (H * bd * _tiles(D, bd) + HI * bdi)
    issued = n_tiles * (passes * tile_flops + grad * 3 * 2.0 * bm * bn * HI * bdi)
    e_w, e_l = a["WI"].element_size(), a["LSE2"].element_size()
    # per key tile and pass, for its r rows: per main head q (all of D) and lse2, per indexer head
    # q_I and w; per key row loaded: every main head's k and the k_I row
    tile_rows = H * (D * e + e_l) + HI * (DI * e_i + e_w)
    tile_keys = H * D * a["KM"].element_size() + DI * a["KI"].element_size()
    reads = sum(r * a["DS"].element_size() + passes * (t * r * tile_rows + k * tile_keys) for r, t, k in blocks)
    row_stats = T * (a["LSEI"].element_size() + a["PSUM"].element_size())  # each row's lse_I and target mass
    if stats:
        writes = T * (a["KL"].element_size() + a["KLU"].element_size()) + row_stats
    else:
        reads, writes = reads + row_stats, 0
    if grad:
        # gradient pass, per key tile and indexer head: q_I and w again, dw read-modify-write and
        # the dq_I atomic add of the rows; per key tile the dk_I atomic add of its loaded rows
        e_dw = a["DWI"].element_size()
        reads += sum(t * r for r, t, _ in blocks) * HI * (DI * e_i + e_w + e_dw)
        writes += (sum(t * r for r, t, _ in blocks) * HI * (e_dw + DI * a["DQI"].element_size())
                   + sum(k for _, _, k in blocks) * DI * a["DKI"].element_size())
    # the target's main logits (H x D) and the indexer scores (H_I x d_I) per causal key; with the
    # gradient dq_I and dk_I (2 x H_I x d_I more)
    useful = 2.0 * (H * D + HI * DI * (1 + 2 * grad)) * causal_keys_per_row(T)
    return Work(useful, issued / T, reads / T, writes / T)
