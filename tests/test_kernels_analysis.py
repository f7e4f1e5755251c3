"""The analysis column (`KernelCase.work`) of the indexer-KL and dense-attention kernels.

Every registered case carries a `Work`; and each kernel's formulas (in its op's `specs.py`) equal
an independent count: a walk of the kernel's own loops over the launch's grid, tile by tile and
element by element (masks evaluated per row / column), adding 2 x M x N x K for every `tl.dot`
at its block shape and the element size for every unmasked element loaded or stored. The walks
below are transcriptions of the kernels' loop structure, written without the specs' closed forms,
at small odd shapes (rows past T, partial key tiles, padded head dims) and at two block
configurations each (the compiled path's and the interpreter's), so a formula that misses a dot,
a re-read or a mask fails. One document per sequence (doc_start = 0), all sparse slots valid: the
cases the formulas describe. Nothing is compiled; the launches are built on the meta device.
"""

from __future__ import annotations

import math

import pytest
import torch

from dsa_kernels import registry
from dsa_kernels.ops.dense_attention import kernel as da_kernel
from dsa_kernels.ops.dense_attention import specs as da_specs
from dsa_kernels.ops.indexer_kl import kernel as kl_kernel
from dsa_kernels.ops.indexer_kl import specs as kl_specs

OPS = ["sparse_indexer_kl", "dense_indexer_kl", "dense_attention_fwd", "dense_attention_bwd"]
META = dict(device="meta")
BIG = 2147483647  # the kernels' `other=` for a masked doc start


def test_every_case_has_work():
    cases = registry.cases(OPS)
    kernels = {c.kernel_name for c in cases}
    assert kernels == {"_sparse_kl_target_kernel", "_sparse_kl_kernel", "_dense_lse_kernel", "_dense_kl_kernel",
                       "_dense_attn_fwd_kernel", "_dense_attn_bwd_dkdv_kernel", "_dense_attn_bwd_dq_kernel",
                       "_indexer_lse_kernel", "_dense_kl_fused_kernel"}  # the last two: `fused.py`
    for c in cases:
        w = c.work
        assert w is not None, f"{c.op} {c.kernel_name}: no work"
        assert w.issued_flops >= w.useful_flops > 0, (c.kernel_name, w)
        assert w.read_bytes > 0 and w.write_bytes > 0, (c.kernel_name, w)
        if w.anchor:
            assert w.anchor["name"] and all(w.anchor[k] > 0 for k in ("issued_flops", "read_bytes", "write_bytes"))


class Tally:
    """FLOPs of the tl.dots and bytes of the loads / stores a walk issues."""

    def __init__(self):
        self.flops = self.read = self.write = self.gathered = 0
        self.useful = 0.0

    def dot(self, m: int, n: int, k: int):
        self.flops += 2 * m * n * k

    def load(self, elems: int, tensor, gathered: bool = False):
        """`gathered`: rows read at indexed positions (part of the reads)."""
        self.read += elems * tensor.element_size()
        self.gathered += elems * tensor.element_size() if gathered else 0

    def store(self, elems: int, tensor):
        self.write += elems * tensor.element_size()

    def per(self, rows: int) -> tuple[float, float, float, float]:
        return self.useful / rows, self.flops / rows, self.read / rows, self.write / rows


def count(lo: int, block: int, limit: int) -> int:
    """Lanes lo + [0, block) below limit, one by one (a mask `offs < limit`)."""
    return sum(1 for i in range(lo, lo + block) if i < limit)


def causal_valid(offs_m, offs_n, T, ds) -> int:
    """Valid (row, key) entries of a tile: key <= row, key >= the row's doc start, row < T."""
    return sum(1 for m in offs_m if m < T for n in offs_n if ds[m] <= n <= m)


def assert_work(work, tally: Tally, rows: int):
    useful, issued, read, write = tally.per(rows)
    got = (work.useful_flops, work.issued_flops, work.read_bytes, work.write_bytes)
    for name, g, want in zip(("useful", "issued", "read", "write"), got, (useful, issued, read, write)):
        assert math.isclose(g, want, rel_tol=1e-9), f"{name}: formula {g} vs walk {want}"
    if tally.gathered:
        assert work.gather_bytes is not None and math.isclose(work.gather_bytes, tally.gathered / rows, rel_tol=1e-9), \
            f"gathered: formula {work.gather_bytes} vs walk {tally.gathered / rows}"
    else:
        assert work.gather_bytes is None, "a launch without gathers reports gathered bytes"


def with_blocks(launch, **blocks):
    """The launch with other block sizes. Its grid is kept: the dense walks derive their programs
    from T and the blocks (as the planners do), the sparse grids do not depend on the blocks."""
    return type(launch)(launch.kernel, launch.grid, dict(launch.args, **blocks), launch.num_warps, launch.num_stages)


# ---------------------------------------------------------------- dense attention
B, T, H = 2, 75, 3
D_QK, D_V = 48, 24  # split 32 + 16; v padded to 32


def _dense_attention_launches():
    q = torch.empty(B, T, H, D_QK, dtype=torch.bfloat16, **META)
    k = torch.empty_like(q)
    v = torch.empty(B, T, H, D_V, dtype=torch.bfloat16, **META)
    lse = torch.empty(B, T, H, dtype=torch.float32, **META)
    ds = torch.empty(B, T, dtype=torch.int32, **META)
    out = torch.empty(B, T, H, D_V, dtype=torch.bfloat16, **META)
    fwd = da_kernel.plan_fwd(q, k, v, ds, out, lse, D_QK**-0.5)
    dkdv, dq = da_kernel.plan_bwd(q, k, v, out, lse, torch.empty_like(lse), ds, ds, torch.empty_like(q),
                                  torch.empty_like(k), torch.empty_like(v), D_QK**-0.5)
    return fwd, dkdv, dq


@pytest.fixture(params=["compiled", "interpreted"])
def blocks_mode(request, monkeypatch):
    """The planners' block sizes for the compiled path (TRITON_INTERPRET=0) and the interpreter's."""
    monkeypatch.setenv("TRITON_INTERPRET", "0" if request.param == "compiled" else "1")
    return request.param


def _programs(launch):
    a = launch.args
    return a["T"], a["H"], [0] * a["T"]  # one document: doc start 0 for every row


def _dense_attention_walk(launch):
    """The start of a dense attention walk -> (the launch's args, a new Tally, T, H, the doc starts,
    BLOCK_M, BLOCK_N, and the columns the kernel loads of the head dim's parts A, B and of v)."""
    a = launch.args
    T, H, ds = _programs(launch)
    da, db, dv = count(0, a["BLOCK_DA"], a["DA"]), count(0, a["BLOCK_DB"], a["DB"]), count(0, a["BLOCK_DV"], a["DV"])
    return a, Tally(), T, H, ds, a["BLOCK_M"], a["BLOCK_N"], da, db, dv


def walk_dense_fwd(launch) -> Tally:
    a, t, T, H, ds, bm, bn, da, db, dv = _dense_attention_walk(launch)
    for offs_m, rows, key_tiles in query_blocks(a, B * H, ds):
        t.load(rows, a["DS"])
        t.load(rows * (da + db), a["Q"])
        for n0 in key_tiles:
            keys = count(n0, bn, T)
            t.load(keys * (da + db), a["K"])
            t.dot(bm, bn, a["BLOCK_DA"]), t.dot(bm, bn, a["BLOCK_DB"])
            t.useful += causal_valid(offs_m, range(n0, n0 + bn), T, ds) * 2 * (a["DA"] + a["DB"] + a["DV"])
            t.load(keys * dv, a["V"])
            t.dot(bm, a["BLOCK_DV"], bn)
        t.store(rows * dv, a["O"]), t.store(rows, a["LSE"])
    return t


def walk_dense_dkdv(launch) -> Tally:
    a, t, T, H, ds, bm, bn, da, db, dv = _dense_attention_walk(launch)
    doc_end = [T] * T
    for pid_n in range(-(-T // bn)):
        for _bh in range(B * H):
            offs_n = range(pid_n * bn, pid_n * bn + bn)
            keys = count(pid_n * bn, bn, T)
            t.load(keys * (da + db), a["K"]), t.load(keys * dv, a["V"])
            t.load(1, a["DE"])
            hi = doc_end[min(pid_n * bn + bn, T) - 1]
            for m0 in range(((pid_n * bn) // bm) * bm, hi, bm):
                offs_m = range(m0, m0 + bm)
                rows = count(m0, bm, T)
                t.load(rows * (da + db), a["Q"]), t.load(rows * dv, a["DO"])
                t.load(rows, a["LSE"]), t.load(rows, a["DELTA"]), t.load(rows, a["DS"])
                t.dot(bn, bm, a["BLOCK_DA"]), t.dot(bn, bm, a["BLOCK_DB"])  # S^T
                t.dot(bn, a["BLOCK_DV"], bm)  # dV += P^T dO
                t.dot(bn, bm, a["BLOCK_DV"])  # dP^T = v dO^T
                t.dot(bn, a["BLOCK_DA"], bm), t.dot(bn, a["BLOCK_DB"], bm)  # dK += dS^T q
                pairs = sum(1 for n in offs_n if n < T for m in offs_m if m < T and ds[m] <= n <= m)
                t.useful += pairs * 2 * (2 * (a["DA"] + a["DB"]) + 2 * a["DV"])
            t.store(keys * (da + db), a["DK"]), t.store(keys * dv, a["DV_"])
    return t


def walk_dense_dq(launch) -> Tally:
    a, t, T, H, ds, bm, bn, da, db, dv = _dense_attention_walk(launch)
    for offs_m, rows, key_tiles in query_blocks(a, B * H, ds):
        t.load(rows, a["DS"])
        t.load(rows * (da + db), a["Q"]), t.load(rows * dv, a["DO"])
        t.load(rows, a["LSE"]), t.load(rows, a["DELTA"])
        for n0 in key_tiles:
            keys = count(n0, bn, T)
            t.load(keys * (da + db), a["K"]), t.load(keys * dv, a["V"])
            t.dot(bm, bn, a["BLOCK_DA"]), t.dot(bm, bn, a["BLOCK_DB"])  # S
            t.dot(bm, bn, a["BLOCK_DV"])  # dP = dO v^T
            t.dot(bm, a["BLOCK_DA"], bn), t.dot(bm, a["BLOCK_DB"], bn)  # dQ += dS k
            t.useful += causal_valid(offs_m, range(n0, n0 + bn), T, ds) * 2 * (2 * (a["DA"] + a["DB"]) + a["DV"])
        t.store(rows * (da + db), a["DQ"])
    return t


def test_dense_attention_fwd_formula(blocks_mode):
    fwd, _, _ = _dense_attention_launches()
    assert_work(da_specs.fwd_work(fwd), walk_dense_fwd(fwd), B * T)
    # a block size the walk and the formula must both follow
    other = with_blocks(fwd, BLOCK_M=32, BLOCK_N=16)
    assert_work(da_specs.fwd_work(other), walk_dense_fwd(other), B * T)


def test_dense_attention_bwd_dkdv_formula(blocks_mode):
    _, dkdv, _ = _dense_attention_launches()
    assert_work(da_specs.bwd_dkdv_work(dkdv), walk_dense_dkdv(dkdv), B * T)
    # key blocks wider, then narrower than query tiles (the walk starts at the diagonal rounded down to BLOCK_M)
    for other in (with_blocks(dkdv, BLOCK_M=16, BLOCK_N=32), with_blocks(dkdv, BLOCK_M=32, BLOCK_N=16)):
        assert_work(da_specs.bwd_dkdv_work(other), walk_dense_dkdv(other), B * T)


def test_dense_attention_bwd_dq_formula(blocks_mode):
    _, _, dq = _dense_attention_launches()
    assert_work(da_specs.bwd_dq_work(dq), walk_dense_dq(dq), B * T)
    other = with_blocks(dq, BLOCK_M=16, BLOCK_N=32)
    assert_work(da_specs.bwd_dq_work(other), walk_dense_dq(other), B * T)


# ---------------------------------------------------------------- dense indexer KL
H_I, D_I = 3, 20  # d_I padded to 32


def dense_kl_tensors(D: int, key_heads: int) -> dict:
    """The dense KL launches' operands on the meta device at these shapes (B, T, H, H_I, D_I; main
    head dim D, key_heads 1: the shared MQA key): qm, km, qi, ki, wi, ds, lse2, rows ([B, T] fp32:
    kl, klu, lse_i, p_sum), dq, dk, dw. Shared with the fused kernels' walks."""
    bf16, f32 = dict(dtype=torch.bfloat16, **META), dict(dtype=torch.float32, **META)
    return dict(
        qm=torch.empty(B, T, H, D, **bf16), km=torch.empty(B, T, key_heads, D, **bf16),
        qi=torch.empty(B, T, H_I, D_I, **bf16), ki=torch.empty(B, T, D_I, **bf16), wi=torch.empty(B, T, H_I, **f32),
        ds=torch.empty(B, T, dtype=torch.int64, **META), lse2=torch.empty(B, H, T, **f32),
        rows=torch.empty(B, T, **f32),
        dq=torch.empty(B, T, H_I, D_I, **f32), dk=torch.empty(B, T, D_I, **f32), dw=torch.empty(B, T, H_I, **f32),
    )


def _dense_kl_launches(D: int, key_heads: int, grad: bool):
    x = dense_kl_tensors(D, key_heads)
    qm, km, ds, lse2, kl = x["qm"], x["km"], x["ds"], x["lse2"], x["rows"]
    lse = kl_kernel.plan_dense_lse(qm, km, ds, lse2, D**-0.5)
    main = kl_kernel.plan_dense_kl(qm, km, x["qi"], x["ki"], x["wi"], ds, lse2, kl, kl, x["dq"], x["dk"], x["dw"],
                                   D**-0.5, grad, stats=not grad)
    return lse, main


def query_blocks(a, batch: int, ds):
    """`kernel._query_block` (and the dense attention kernels' query / key range) over the grid: per
    query block (of the launch's T rows) and batch row (or batch x head) -> (offs_m, rows, key_tiles): the block's row positions, how many are below T, and the starts
    of the key tiles it walks (from its first doc start, rounded down to a tile, to its causal end).
    Shared by the dense attention and dense KL walks here and the fused kernels'
    (tests/test_kernels_dense_kl_fused.py)."""
    T, bm, bn = a["T"], a["BLOCK_M"], a["BLOCK_N"]
    for pid_m in range(-(-T // bm)):
        offs_m = range(pid_m * bm, pid_m * bm + bm)
        rows = count(pid_m * bm, bm, T)
        lo = min(ds[m] if m < T else BIG for m in offs_m)
        for _ in range(batch):
            yield offs_m, rows, range((lo // bn) * bn, min(pid_m * bm + bm, T), bn)


def walk_dense_lse(launch) -> Tally:
    a, t = launch.args, Tally()
    T, H, ds = _programs(launch)
    bm, bn, bd, D = a["BLOCK_M"], a["BLOCK_N"], a["BLOCK_D"], a["D"]
    for offs_m, rows, key_tiles in query_blocks(a, B * H, ds):
        t.load(rows, a["DS"])
        for n0 in key_tiles:
            keys = count(n0, bn, T)
            for d0 in range(0, D, bd):
                cols = count(d0, bd, D)
                t.load(rows * cols, a["QM"]), t.load(keys * cols, a["KM"])
                t.dot(bm, bn, bd)
            t.useful += causal_valid(offs_m, range(n0, n0 + bn), T, ds) * 2 * D
        t.store(rows, a["LSE2"])
    return t


def walk_indexer_tile(a, t: Tally, rows: int, keys: int, scratch: bool = False):
    """k_I of the key tile, every indexer head's q_I k_I^T (with scratch: its tile stored, `fused.py`)."""
    di = count(0, a["BLOCK_DI"], a["DI"])
    t.load(keys * di, a["KI"])
    for _j in range(a["HI"]):
        t.load(rows * di, a["QI"]), t.load(rows, a["WI"])
        t.dot(a["BLOCK_M"], a["BLOCK_N"], a["BLOCK_DI"])
        if scratch:
            t.store(a["BLOCK_M"] * a["BLOCK_N"], a["SCR"])


def walk_dense_tiles(a, t: Tally, rows: int, keys: int, scratch: bool = False):
    """`_dense_tiles` (and the fused kernel's tile, with scratch): every main head's q k^T by D
    slices and lse2 (`_target_tile`), then `walk_indexer_tile`."""
    bm, bn, bd, D = a["BLOCK_M"], a["BLOCK_N"], a["BLOCK_D"], a["D"]
    for _h in range(a["H"]):
        for d0 in range(0, D, bd):
            cols = count(d0, bd, D)
            t.load(rows * cols, a["QM"]), t.load(keys * cols, a["KM"])
            t.dot(bm, bn, bd)
        t.load(rows, a["LSE2"])
    walk_indexer_tile(a, t, rows, keys, scratch)


def walk_dense_kl(launch) -> Tally:
    a, t = launch.args, Tally()
    T, H, ds = _programs(launch)
    bm, bn = a["BLOCK_M"], a["BLOCK_N"]
    di = count(0, a["BLOCK_DI"], a["DI"])
    for offs_m, rows, key_tiles in query_blocks(a, B, ds):
        t.load(rows, a["DS"])
        for n0 in key_tiles:
            if a["STATS"]:
                walk_dense_tiles(a, t, rows, count(n0, bn, T))
            pairs = causal_valid(offs_m, range(n0, n0 + bn), T, ds)
            t.useful += pairs * 2 * (H * a["D"] + a["HI"] * a["DI"] * (3 if a["GRAD"] else 1))
        if a["STATS"]:  # KL, KL to uniform, and the row's lse_I and target mass for the backward
            t.store(rows, a["KL"]), t.store(rows, a["KLU"]), t.store(rows, a["LSEI"]), t.store(rows, a["PSUM"])
        else:  # the gradient-only launch reads the forward's lse_I and target mass
            t.load(rows, a["LSEI"]), t.load(rows, a["PSUM"])
        if not a["GRAD"]:
            continue
        for n0 in key_tiles:
            keys = count(n0, bn, T)
            walk_dense_tiles(a, t, rows, keys)
            for _j in range(a["HI"]):
                t.load(rows * di, a["QI"]), t.load(rows, a["WI"])
                t.dot(bm, bn, a["BLOCK_DI"])  # a = q_I k_I^T
                t.load(rows, a["DWI"]), t.store(rows, a["DWI"])  # dw read-modify-write
                t.dot(bm, a["BLOCK_DI"], bn)  # da k_I
                t.store(rows * di, a["DQI"])  # dq_I atomic add
                t.dot(a["BLOCK_DI"], bn, bm)  # q_I^T da
            t.store(keys * di, a["DKI"])  # dk_I atomic add
    return t


@pytest.mark.parametrize("D, key_heads", [(40, H), (96, 1)], ids=["mha", "mqa"])
def test_dense_lse_formula(blocks_mode, D, key_heads):
    lse, _ = _dense_kl_launches(D, key_heads, True)
    assert_work(kl_specs.dense_lse_work(lse), walk_dense_lse(lse), B * T)
    other = with_blocks(lse, BLOCK_M=16, BLOCK_N=32, BLOCK_D=32)
    assert_work(kl_specs.dense_lse_work(other), walk_dense_lse(other), B * T)


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "forward"])
@pytest.mark.parametrize("D, key_heads", [(40, H), (96, 1)], ids=["mha", "mqa"])
def test_dense_kl_formula(blocks_mode, D, key_heads, grad):
    _, main = _dense_kl_launches(D, key_heads, grad)
    assert_work(kl_specs.dense_kl_work(main), walk_dense_kl(main), B * T)
    other = with_blocks(main, BLOCK_M=16, BLOCK_N=32, BLOCK_D=32)
    assert_work(kl_specs.dense_kl_work(other), walk_dense_kl(other), B * T)


# ---------------------------------------------------------------- sparse indexer KL
H_S, D_S, N, K_S, C = 5, 40, 90, 50, 7  # D = 32 + 8 (second operand padded to 16)


def _sparse_kl_launches(grad: bool):
    qm = torch.empty(B, T, H_S, D_S, dtype=torch.bfloat16, **META)
    kvm = torch.empty(B, N, D_S, dtype=torch.bfloat16, **META)
    idx = torch.empty(B, T, K_S, dtype=torch.int32, **META)
    n_slots = torch.empty(B, T, dtype=torch.int32, **META)
    lse = torch.empty(B, T, H_S, dtype=torch.float32, **META)
    p_sum = torch.empty(B, C, K_S, dtype=torch.float32, **META)
    target = kl_kernel.plan_sparse_kl_target(qm, kvm, idx, n_slots, lse, p_sum, T - C, D_S**-0.5)
    qi = torch.empty(B, T, H_I, D_I, dtype=torch.bfloat16, **META)
    ki = torch.empty(B, N, D_I, dtype=torch.bfloat16, **META)
    wi = torch.empty(B, T, H_I, dtype=torch.float32, **META)
    kl = torch.empty(B, T, dtype=torch.float32, **META)
    dq = torch.empty(B, T, H_I, D_I, dtype=torch.float32, **META)
    dk = torch.empty(B, N, D_I, dtype=torch.float32, **META)
    dw = torch.empty(B, T, H_I, dtype=torch.float32, **META)
    main = kl_kernel.plan_sparse_kl(qi, ki, wi, idx, n_slots, p_sum, T - C, H_S, kl, kl, dq, dk, dw, grad)
    return target, main


def walk_sparse_target(launch) -> tuple[Tally, int]:
    a, t = launch.args, Tally()
    bh, bk = a["BLOCK_H"], a["BLOCK_K"]
    H, n_slots = a["H"], a["IDX"].shape[-1]  # every slot valid
    d_a, d_b = count(0, a["BLOCK_DA"], a["D_A"]), count(0, a["BLOCK_DB"], a["D_B"])
    n_programs = launch.grid[0] * launch.grid[1]
    for _prog in range(n_programs):
        t.load(1, a["NSLOT"])
        for h0 in range(0, H, bh):
            heads = count(h0, bh, H)
            t.load(heads * d_a, a["QM"])
            if a["D_B"] > 0:
                t.load(heads * d_b, a["QM"])
            t.load(heads, a["LSE"])
            for k0 in range(0, n_slots, bk):
                slots = count(k0, bk, n_slots)
                t.load(slots, a["IDX"]), t.load(slots * d_a, a["KVM"], gathered=True)
                t.dot(bh, bk, a["BLOCK_DA"])
                if a["D_B"] > 0:
                    t.load(slots * d_b, a["KVM"], gathered=True)
                    t.dot(bh, bk, a["BLOCK_DB"])
                t.useful += heads * slots * 2 * (a["D_A"] + a["D_B"])
                if h0 > 0:
                    t.load(slots, a["P_SUM"])
                t.store(slots, a["P_SUM"])
    return t, n_programs


def walk_sparse_kl(launch) -> tuple[Tally, int]:
    a, t = launch.args, Tally()
    bk, bhi, bdi = a["BLOCK_K"], a["BLOCK_HI"], a["BLOCK_DI"]
    HI, n_slots = a["HI"], a["IDX"].shape[-1]
    di = count(0, bdi, a["DI"])
    n_programs = launch.grid[0] * launch.grid[1]
    for _prog in range(n_programs):
        t.load(count(0, bhi, HI) * di, a["QI"]), t.load(count(0, bhi, HI), a["WI"]), t.load(1, a["NSLOT"])
        for k0 in range(0, n_slots, bk):
            slots = count(k0, bk, n_slots)
            t.load(slots, a["IDX"]), t.load(slots, a["P_SUM"]), t.load(slots * di, a["KI"], gathered=True)
            t.dot(bhi, bk, bdi)
            t.useful += slots * HI * a["DI"] * 2 * (3 if a["GRAD"] else 1)
        t.store(1, a["KL"]), t.store(1, a["KLU"])
        if a["GRAD"]:
            for k0 in range(0, n_slots, bk):
                slots = count(k0, bk, n_slots)
                t.load(slots, a["IDX"]), t.load(slots, a["P_SUM"]), t.load(slots * di, a["KI"], gathered=True)
                t.dot(bhi, bk, bdi)  # a
                t.dot(bhi, bdi, bk)  # dq_I += da k_I
                t.dot(bk, bdi, bhi)  # dk = da^T q_I
                t.store(slots * di, a["DKI"])  # atomic add
            t.store(HI * di, a["DQI"]), t.store(HI, a["DWI"])
    return t, n_programs


def test_sparse_kl_target_formula():
    target, _ = _sparse_kl_launches(True)
    for launch in (target, with_blocks(target, BLOCK_H=2, BLOCK_K=16)):  # 3 head blocks: read-backs
        tally, rows = walk_sparse_target(launch)
        assert_work(kl_specs.sparse_target_work(launch), tally, rows)
    no_b = with_blocks(target, D_A=32, D_B=0)  # D = 32: one operand
    tally, rows = walk_sparse_target(no_b)
    assert_work(kl_specs.sparse_target_work(no_b), tally, rows)


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "forward"])
def test_sparse_kl_formula(grad):
    _, main = _sparse_kl_launches(grad)
    for launch in (main, with_blocks(main, BLOCK_K=16)):
        tally, rows = walk_sparse_kl(launch)
        assert_work(kl_specs.sparse_kl_work(launch), tally, rows)
