"""Indexer KL launches at the 671B shapes (with gradient: the training path), for the compile
report. The dense KL runs in both of MLA's forms (MHA: per-head 192-dim keys; MQA: the shared
576-dim key), so both are compiled."""

from __future__ import annotations

import torch

from ...registry import SHAPES_671B, KernelCase, register
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
    return [KernelCase(_config(target, "target "), target), KernelCase(_config(launch, "kl "), launch)]


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
        cases.append(KernelCase(_config(lse_launch, f"{form} D={D} "), lse_launch))
        kl_launch = plan_dense_kl(qm, km, qi, ki, wi, ds, lse2, kl, kl, dq, dk, dw, D**-0.5, True)
        cases.append(KernelCase(_config(kl_launch, f"{form} D={D} "), kl_launch))
    return cases
