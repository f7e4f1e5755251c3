"""Dense attention launches at the 671B shapes (MHA form: H=128, q/k 192 = 128 nope + 64 rope,
v 128), for the compile report."""

from __future__ import annotations

import torch

from ...analysis import Work
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
    return [KernelCase(_config(launch), launch, work=fwd_work(launch))]


@register("dense_attention_bwd")
def _bwd():
    q, k, v, lse, ds, scale = _tensors()
    dout = torch.empty(*q.shape[:3], v.shape[-1], dtype=q.dtype, device="meta")
    launches = plan_bwd(q, k, v, dout, lse, torch.empty_like(lse), ds, ds, torch.empty_like(q),
                        torch.empty_like(k), torch.empty_like(v), scale)
    dkdv, dq = launches
    return [KernelCase(_config(dkdv), dkdv, work=bwd_dkdv_work(dkdv)),
            KernelCase(_config(dq), dq, work=bwd_dq_work(dq))]


# ---- the analysis column (`dsa_kernels.analysis.Work`): per token, from each launch's block sizes ----
#
# Causal attention over one document per sequence (doc_start = 0 for every row: what the 671B cases
# stand for; packed documents skip the key tiles before a block's first document start, so they
# issue less). "Per token" = the launch's total over its B x T query (or key) rows / (B x T).
# useful: 2 x the multiply-adds of the products this launch's outputs need, each counted once, over
# the causal keys of each row (average (T + 1) / 2). issued: every tl.dot at its block shape, for
# every key tile the loop walks (the diagonal tiles' masked half and the rows past T included).
# Bytes: every load / store the kernel issues (masked-off elements excluded), re-reads included.


def causal_blocks(T: int, block_m: int, block_n: int) -> list[tuple[int, int, int]]:
    """(rows, key tiles, keys loaded) of each query block of a `range(0, hi, block_n)` causal key
    walk, hi = min(end of the block, T): the block's rows inside [0, T), the key tiles it walks
    (cdiv(hi, block_n)) and the key rows those tiles load (tiles past T masked)."""
    out = []
    for m0 in range(0, T, block_m):
        hi = min(m0 + block_m, T)
        tiles = -(-hi // block_n)
        out.append((hi - m0, tiles, min(tiles * block_n, T)))
    return out


def causal_keys_per_row(T: int) -> float:
    """Keys a query row sees, averaged over the T rows of one causal document: (T + 1) / 2."""
    return (T + 1) / 2


def _dims_of(a) -> tuple[int, int, int]:
    return a["DA"] + a["DB"], a["DV"], a["Q"].element_size()


def fwd_work(launch) -> Work:
    a = launch.args
    T, H = a["T"], a["H"]
    d_qk, d_v, e = _dims_of(a)
    bm, bn = a["BLOCK_M"], a["BLOCK_N"]
    blocks = causal_blocks(T, bm, bn)
    # per key tile: S = q_a k_a^T + q_b k_b^T, then P v
    issued = sum(t for _, t, _ in blocks) * 2.0 * bm * bn * (a["BLOCK_DA"] + a["BLOCK_DB"] + a["BLOCK_DV"])
    # per program: its rows' doc starts and q once; k and v of every key row its tiles load
    reads = sum(r * (a["DS"].element_size() + d_qk * e) + k * (d_qk + d_v) * e for r, _, k in blocks)
    writes = T * (d_v * a["O"].element_size() + a["LSE"].element_size())
    useful = 2.0 * H * (d_qk + d_v) * causal_keys_per_row(T)
    # the one-pass minimum: FLOPs = useful, q, k, v and the doc start read once, out and lse written once
    anchor = dict(name="one-pass minimum (FLOPs = useful; q, k, v read once)", issued_flops=useful,
                  read_bytes=H * (2 * d_qk + d_v) * e + a["DS"].element_size(), write_bytes=writes * H / T)
    # B x H programs per query block; B cancels in the per-token figure
    return Work(useful, issued * H / T, reads * H / T, writes * H / T, anchor)


def bwd_dkdv_work(launch) -> Work:
    a = launch.args
    T, H = a["T"], a["H"]
    d_qk, d_v, e = _dims_of(a)
    bm, bn = a["BLOCK_M"], a["BLOCK_N"]
    # per key block: the query tiles from the block's diagonal (start rounded down to BLOCK_M) to
    # the end of its last key's document (T here)
    starts = [(n0 // bm) * bm for n0 in range(0, T, bn)]
    q_tiles = sum(-(-(T - s) // bm) for s in starts)
    # per query tile: S^T (a and b parts), dV += P^T dO, dP^T = v dO^T, dK_a, dK_b += dS^T q
    issued = q_tiles * 2.0 * bn * bm * 2 * (a["BLOCK_DA"] + a["BLOCK_DB"] + a["BLOCK_DV"])
    row_in = (d_qk + d_v) * e + a["LSE"].element_size() + a["DELTA"].element_size() + a["DS"].element_size()
    # per program: its keys' k and v once, one doc end; per query tile q, dO, lse, delta, doc start
    reads = T * (d_qk + d_v) * e + len(starts) * a["DE"].element_size() + sum(T - s for s in starts) * row_in
    writes = T * (d_qk * a["DK"].element_size() + d_v * a["DV_"].element_size())
    # S, dP = dO v^T, dV = P^T dO, dK = dS^T q: the products dK and dV need
    useful = 2.0 * H * (2 * d_qk + 2 * d_v) * causal_keys_per_row(T)
    return Work(useful, issued * H / T, reads * H / T, writes * H / T)


def bwd_dq_work(launch) -> Work:
    a = launch.args
    T, H = a["T"], a["H"]
    d_qk, d_v, e = _dims_of(a)
    bm, bn = a["BLOCK_M"], a["BLOCK_N"]
    blocks = causal_blocks(T, bm, bn)
    # per key tile: S (a and b parts), dP = dO v^T, dQ_a, dQ_b += dS k
    issued = sum(t for _, t, _ in blocks) * 2.0 * bm * bn * (2 * a["BLOCK_DA"] + 2 * a["BLOCK_DB"] + a["BLOCK_DV"])
    row_in = (d_qk + d_v) * e + a["LSE"].element_size() + a["DELTA"].element_size() + a["DS"].element_size()
    # per program: its rows' q, dO, lse, delta, doc start once; k and v of every key row loaded
    reads = sum(r * row_in + k * (d_qk + d_v) * e for r, _, k in blocks)
    writes = T * d_qk * a["DQ"].element_size()
    # S, dP, dQ = dS k: the products dQ needs (S and dP are also formed by the dK/dV launch)
    useful = 2.0 * H * (2 * d_qk + d_v) * causal_keys_per_row(T)
    # the whole backward as one kernel with dQ by atomics would form S and dP once: 3 d_qk + 2 d_v
    # per key; its compulsory traffic: q, k, v, dO, lse, delta read once, dq, dk, dv written once
    anchor = dict(name="one-kernel backward minimum, both launches together (S, dP once; inputs read once)",
                  issued_flops=2.0 * H * (3 * d_qk + 2 * d_v) * causal_keys_per_row(T),
                  read_bytes=(H * ((2 * d_qk + 2 * d_v) * e + a["LSE"].element_size() + a["DELTA"].element_size())
                              + a["DS"].element_size()),
                  write_bytes=H * (2 * d_qk + d_v) * e)
    return Work(useful, issued * H / T, reads * H / T, writes * H / T, anchor)
