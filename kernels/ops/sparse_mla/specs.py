"""Sparse MLA launches at the 671B shapes, for the compile report: the exact launches the
launchers make there (their own planning functions on meta-device tensors)."""

from __future__ import annotations

import torch

from ...registry import SHAPES_671B, KernelCase, register
from .kernel import deterministic_layout, plan_bwd, plan_fwd

# CP's dense-at-positions calls (model/mla.py `_dense_at_positions`): a chunk of queries over
# every key of the 128K sequence, index lists as wide as the sequence
DENSE_CHUNK_ELEMS = 1 << 24  # model/mla.py's default DENSE_CHUNK_ELEMS


def _tensors(T: int | None = None, K: int | None = None):
    s = SHAPES_671B
    B, N, H, D = s["B"], s["T"], s["H"], s["D"]
    T = N if T is None else T
    K = s["K"] if K is None else K
    meta = dict(device="meta")
    q = torch.empty(B, T, H, D, dtype=torch.bfloat16, **meta)
    kv = torch.empty(B, N, D, dtype=torch.bfloat16, **meta)
    idx = torch.empty(B, T, K, dtype=torch.int32, **meta)
    lse = torch.empty(B, T, H, dtype=torch.float32, **meta)
    return q, kv, idx, lse, D**-0.5, s["D_V"]


def _config(launch) -> str:
    a = launch.args
    keys = [k for k in a if k.startswith("BLOCK_") or k in ("SPLIT_V", "SPLIT", "DETERMINISTIC")]
    stages = f" stages={launch.num_stages}" if launch.num_stages else ""
    return " ".join(f"{k}={a[k]}" for k in keys) + f" warps={launch.num_warps}{stages} grid={launch.grid}"


@register("sparse_mla_fwd")
def _fwd():
    q, kv, idx, lse, scale, d_v = _tensors()
    out = torch.empty(*q.shape[:3], d_v, dtype=q.dtype, device="meta")
    n_slots = torch.empty(idx.shape[:2], dtype=torch.int32, device="meta")
    launch = plan_fwd(q, kv, idx, n_slots, out, lse, scale, d_v)
    T = SHAPES_671B["T"]  # CP dense-at-positions: DENSE_CHUNK_ELEMS // T queries over K = T slots
    q, kv, idx, lse, scale, d_v = _tensors(T=max(1, DENSE_CHUNK_ELEMS // T), K=T)
    out = torch.empty(*q.shape[:3], d_v, dtype=q.dtype, device="meta")
    n_slots = torch.empty(idx.shape[:2], dtype=torch.int32, device="meta")
    dense = plan_fwd(q, kv, idx, n_slots, out, lse, scale, d_v)
    return [KernelCase(_config(launch), launch), KernelCase("CP dense-at-positions " + _config(dense), dense)]


def bwd_launches(T: int | None = None, K: int | None = None) -> list[tuple[str, object]]:
    """(label, Launch) of the backward at T queries / K slots (default: the 671B top-k call):
    the atomic launch and the deterministic variant's first (chunk, window) launch."""
    q, kv, idx, lse, scale, d_v = _tensors(T, K)
    B, T, H, D = q.shape
    K = idx.shape[-1]
    dout = torch.empty(*q.shape[:3], d_v, dtype=q.dtype, device="meta")
    delta = torch.empty_like(lse)
    dq = torch.empty_like(q)
    dkv = torch.empty(kv.shape, dtype=torch.float32, device="meta")
    n_slots = torch.empty(idx.shape[:2], dtype=torch.int32, device="meta")
    atomic = plan_bwd(q, kv, idx, n_slots, dout, lse, delta, dq, dkv, scale, d_v)
    # the deterministic option (under torch.use_deterministic_algorithms): (token chunk, slot
    # window) launches storing into the stage, dq accumulated in fp32 (sparse_mla_bwd_deterministic)
    n_hb, chunk, window = deterministic_layout(B, T, K, H, D, d_v)
    c, w = min(chunk, T), min(window, K)
    stage = torch.empty(n_hb, B, c, w, D, dtype=torch.float32, device="meta")
    dq_acc = torch.empty(B, c, H, D, dtype=torch.float32, device="meta")
    det = plan_bwd(q, kv, idx, n_slots, dout, lse, delta, dq_acc, None, scale, d_v, 0, c, 0, w, stage)
    return [("", atomic), (f"deterministic (chunk {c} tokens, window {w} of {K} slots) ", det)]


@register("sparse_mla_bwd")
def _bwd():
    cases = [KernelCase(label + _config(launch), launch) for label, launch in bwd_launches()]
    # CP dense-at-positions: DENSE_CHUNK_ELEMS // T queries over K = T = 128K slots (a real call;
    # the same compiled kernels at a different grid / window)
    T = SHAPES_671B["T"]
    dense = bwd_launches(T=max(1, DENSE_CHUNK_ELEMS // T), K=T)
    cases += [KernelCase("CP dense-at-positions " + label + _config(launch), launch) for label, launch in dense]
    return cases
