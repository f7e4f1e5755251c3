"""Sparse MLA launches at the 671B shapes, for the compile report."""

from __future__ import annotations

import torch

from ...registry import SHAPES_671B, KernelCase, register
from .kernel import deterministic_chunk, plan_bwd, plan_fwd


def _tensors():
    s = SHAPES_671B
    B, T, H, D, K = s["B"], s["T"], s["H"], s["D"], s["K"]
    meta = dict(device="meta")
    q = torch.empty(B, T, H, D, dtype=torch.bfloat16, **meta)
    kv = torch.empty(B, T, D, dtype=torch.bfloat16, **meta)
    idx = torch.empty(B, T, K, dtype=torch.int32, **meta)
    lse = torch.empty(B, T, H, dtype=torch.float32, **meta)
    return q, kv, idx, lse, D**-0.5, s["D_V"]


def _config(launch) -> str:
    a = launch.args
    keys = [k for k in a if k.startswith("BLOCK_") or k in ("SPLIT_V", "SPLIT", "DETERMINISTIC")]
    stages = f" stages={launch.num_stages}" if launch.num_stages else ""
    return " ".join(f"{k}={a[k]}" for k in keys) + f" warps={launch.num_warps}{stages} grid={launch.grid}"


@register("sparse_mla_fwd", attention=True)
def _fwd():
    q, kv, idx, lse, scale, d_v = _tensors()
    out = torch.empty(*q.shape[:3], d_v, dtype=q.dtype, device="meta")
    n_slots = torch.empty(idx.shape[:2], dtype=torch.int32, device="meta")
    launch = plan_fwd(q, kv, idx, n_slots, out, lse, scale, d_v)
    return [KernelCase(_config(launch), launch)]


@register("sparse_mla_bwd", attention=True)
def _bwd():
    q, kv, idx, lse, scale, d_v = _tensors()
    dout = torch.empty(*q.shape[:3], d_v, dtype=q.dtype, device="meta")
    delta = torch.empty_like(lse)
    dq = torch.empty_like(q)
    dkv = torch.empty(kv.shape, dtype=torch.float32, device="meta")
    n_slots = torch.empty(idx.shape[:2], dtype=torch.int32, device="meta")
    launch = plan_bwd(q, kv, idx, n_slots, dout, lse, delta, dq, dkv, scale, d_v)
    # the deterministic option (under torch.use_deterministic_algorithms): staged stores, no atomics
    B, T, H, D = q.shape
    n_hb = launch.grid[0] // launch.args["SPLIT"]
    chunk = deterministic_chunk(B, T, idx.shape[-1], D, n_hb)
    stage = torch.empty(n_hb, B, chunk, idx.shape[-1], D, dtype=torch.float32, device="meta")
    det = plan_bwd(q, kv, idx, n_slots, dout, lse, delta, dq, dkv, scale, d_v, T - chunk, chunk, stage)
    return [KernelCase(_config(launch), launch), KernelCase("deterministic " + _config(det), det)]
