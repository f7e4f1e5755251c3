"""The fused dense KL's launches (`fused.py`) at the 671B shapes for the compile report, and their
analysis column (`analysis.Work`, per token). Registered with the other dense KL cases
(`specs._dense` calls `fused_cases`).

Counted as in `specs.py` (useful: the op's products once; issued: every tl.dot at its block shape;
bytes: every load / store / atomic, re-reads included), one document per sequence. The fused case
carries the step's FLOP budget as its anchor (`analysis.budget_anchor`): the pre-pass plus the
fused pass must issue at most FUSED_BUDGET x one pass of the main scores plus the indexer's
products, 2 (H D + 3 H_I d_I) per (query, key) pair (issue 32 item 5).
"""

from __future__ import annotations

import torch

from ...analysis import Work, budget_anchor
from ...registry import SHAPES_671B, KernelCase
from ..dense_attention.specs import causal_blocks, causal_keys_per_row
from .fused import fused_chunk_blocks, fused_blocks, plan_fused_dense_kl, plan_indexer_lse

FUSED_BUDGET = 1.3


def _tiles(n: int, block: int) -> int:
    return -(-n // block)


def indexer_lse_work(launch) -> Work:
    a = launch.args
    T, HI, DI = a["T"], a["HI"], a["DI"]
    bm, bn, bdi = a["BLOCK_M"], a["BLOCK_N"], a["BLOCK_DI"]
    blocks = causal_blocks(T, bm, bn)
    issued = sum(t for _, t, _ in blocks) * 2.0 * bm * bn * HI * bdi  # per key tile, per indexer head
    e_i, e_w, e_k = a["QI"].element_size(), a["WI"].element_size(), a["KI"].element_size()
    # per program its doc starts; per key tile its rows' q_I and w of every head again, the k_I rows
    reads = sum(r * a["DS"].element_size() + t * r * HI * (DI * e_i + e_w) + k * DI * e_k for r, t, k in blocks)
    writes = T * a["LSEI"].element_size()
    useful = 2.0 * HI * DI * causal_keys_per_row(T)
    return Work(useful, issued / T, reads / T, writes / T)


def fused_kl_work(launch) -> Work:
    a = launch.args
    T, H, HI, D, DI, grad = a["T"], a["H"], a["HI"], a["D"], a["DI"], a["GRAD"]
    bm, bn, bd, bdi = a["BLOCK_M"], a["BLOCK_N"], a["BLOCK_D"], a["BLOCK_DI"]
    blocks = causal_blocks(T, bm, bn)
    n_tiles = sum(t for _, t, _ in blocks)
    # per key tile: every main head's q k^T by BLOCK_D slices; per indexer head q_I k_I^T and, with
    # the gradient, da k_I and q_I^T da (q_I k_I^T is read back from the a_j scratch, not recomputed)
    indexer_dots = 1 + 2 * grad
    issued = n_tiles * 2.0 * bm * bn * (H * bd * _tiles(D, bd) + indexer_dots * HI * bdi)
    e, e_i, e_w, e_l = a["QM"].element_size(), a["QI"].element_size(), a["WI"].element_size(), a["LSE2"].element_size()
    e_s = a["SCR"].element_size()
    tile_rows = H * (D * e + e_l) + HI * (DI * e_i + e_w)  # per key tile, per row: main q + lse, q_I + w
    tile_keys = H * D * a["KM"].element_size() + DI * a["KI"].element_size()
    # per program: doc starts, lse_I, every head's lse once (the rows' target mass)
    reads = sum(r * (a["DS"].element_size() + a["LSEI"].element_size() + H * e_l) + t * r * tile_rows + k * tile_keys
                for r, t, k in blocks)
    writes = T * (a["KL"].element_size() + a["KLU"].element_size() + a["PSUM"].element_size())
    if grad:
        rows_tiles = sum(t * r for r, t, _ in blocks)
        e_dw = a["DWI"].element_size()
        # gradient loop per key tile and indexer head: q_I and w again, dw read-modify-write, dq_I
        # atomics of the rows; dk_I atomics of the tile's keys; the a_j scratch written and read back
        reads += rows_tiles * HI * (DI * e_i + e_w + e_dw) + n_tiles * HI * bm * bn * e_s
        writes += (rows_tiles * HI * (e_dw + DI * a["DQI"].element_size())
                   + sum(k for _, _, k in blocks) * DI * a["DKI"].element_size()
                   + n_tiles * HI * bm * bn * e_s)
    useful = 2.0 * (H * D + HI * DI * (1 + 2 * grad)) * causal_keys_per_row(T)
    return Work(useful, issued / T, reads / T, writes / T)


def fused_cases(config) -> list[KernelCase]:
    """The pre-pass, and the fused pass in both of MLA's forms (with the gradient: the training
    path; MHA also without it: the value alone, when no input needs a gradient). `config(launch,
    prefix)` names a case as `specs._config` does."""
    s = SHAPES_671B
    meta = dict(device="meta")
    B, T, H, HI, DI = s["B"], s["T"], s["H"], s["H_I"], s["D_I"]
    qi = torch.empty(B, T, HI, DI, dtype=torch.bfloat16, **meta)
    ki = torch.empty(B, T, DI, dtype=torch.bfloat16, **meta)
    wi = torch.empty(B, T, HI, dtype=torch.float32, **meta)
    ds = torch.empty(B, T, dtype=torch.int64, **meta)
    rows = torch.empty(B, T, dtype=torch.float32, **meta)
    dq = torch.empty(B, T, HI, DI, dtype=torch.float32, **meta)
    dk = torch.empty(B, T, DI, dtype=torch.float32, **meta)
    dw = torch.empty(B, T, HI, dtype=torch.float32, **meta)
    lse2 = torch.empty(B, H, T, dtype=torch.float32, **meta)
    pre = plan_indexer_lse(qi, ki, wi, ds, rows)
    pre_work = indexer_lse_work(pre)
    cases = [KernelCase(config(pre, "fused pre-pass (indexer lse) "), pre, work=pre_work)]
    for form, D, kh in (("mha", s["D_QK_MHA"], H), ("mqa", s["D"], 1)):
        qm = torch.empty(B, T, H, D, dtype=torch.bfloat16, **meta)
        km = torch.empty(B, T, kh, D, dtype=torch.bfloat16, **meta)
        blocks = fused_blocks(T, D)
        n = fused_chunk_blocks(B, HI, blocks)  # the launcher's chunk of query blocks (its scratch)
        scratch = torch.empty(B, n, HI, blocks["BLOCK_M"], blocks["BLOCK_N"], dtype=torch.bfloat16, **meta)
        for name, grad in [("", True)] + ([("value-only ", False)] if form == "mha" else []):
            launch = plan_fused_dense_kl(qm, km, qi, ki, wi, ds, lse2, rows, scratch, rows, rows, rows, dq, dk, dw,
                                         D**-0.5, grad, blk0=0, n_blocks=n)
            work = fused_kl_work(launch)
            if grad:
                work = Work(work.useful_flops, work.issued_flops, work.read_bytes, work.write_bytes,
                            anchor=budget_anchor(f"fused step (pre-pass + this pass; budget {FUSED_BUDGET} x useful)",
                                                 [pre_work, work], work.useful_flops, FUSED_BUDGET))
            cases.append(KernelCase(config(launch, f"fused {name}{form} D={D} "), launch, work=work))
    return cases
