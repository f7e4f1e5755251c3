"""Dense attention launches at the 671B shapes (MHA form: H=128, q/k 192 = 128 nope + 64 rope,
v 128), for the compile report."""

from __future__ import annotations

import torch

from ...registry import SHAPES_671B, KernelCase, register
from .kernel import plan_bwd, plan_fwd


def _tensors():
    s = SHAPES_671B
    B, T, H, D, DV = s["B"], s["T"], s["H"], s["D_QK_MHA"], s["D_V_MHA"]
    meta = dict(device="meta", dtype=torch.bfloat16)
    q, k = torch.empty(B, T, H, D, **meta), torch.empty(B, T, H, D, **meta)
    v = torch.empty(B, T, H, DV, **meta)
    lse = torch.empty(B, T, H, dtype=torch.float32, device="meta")
    ds = torch.empty(B, T, dtype=torch.int32, device="meta")
    return q, k, v, lse, ds, D**-0.5


def _config(launch) -> str:
    a = launch.args
    keys = [k for k in a if k.startswith("BLOCK_")]
    return (" ".join(f"{k}={a[k]}" for k in keys)
            + f" warps={launch.num_warps} stages={launch.num_stages} grid={launch.grid}")


@register("dense_attention_fwd")
def _fwd():
    q, k, v, lse, ds, scale = _tensors()
    out = torch.empty(*q.shape[:3], v.shape[-1], dtype=q.dtype, device="meta")
    launch = plan_fwd(q, k, v, ds, out, lse, scale)
    return [KernelCase(_config(launch), launch)]


@register("dense_attention_bwd")
def _bwd():
    q, k, v, lse, ds, scale = _tensors()
    dout = torch.empty(*q.shape[:3], v.shape[-1], dtype=q.dtype, device="meta")
    launches = plan_bwd(q, k, v, dout, lse, torch.empty_like(lse), ds, ds, torch.empty_like(q),
                        torch.empty_like(k), torch.empty_like(v), scale)
    return [KernelCase(_config(launch), launch) for launch in launches]
