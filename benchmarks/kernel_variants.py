"""Launch variants of the sparse MLA forward / backward and the top-k select, timed on one GPU.

The sweep behind the tuned defaults (docs/kernels.md, "Measured on a GPU"; results of the first run:
docs/gpu-check/NVIDIA-H200/variants.json). The kernels' own launch plans (`plan_fwd`, `plan_bwd`,
`plan_select`) with their block sizes, stages, warps or value split changed, and the interleaved
backward (`plan_bwd_interleaved`, docs/kernels.md "Backward v2") at 16- and 32-key tiles, 4 and 8
warps. 671B dims, T = 32K (one document), k = 2048; top-k on the last 4096 rows' fp32 scores.

Each variant is compiled once (the registers and spill its compile reports are recorded), its
output compared with the first variant of its kind (forward: max |out - out_0| / max |out_0|;
backward: the same over dq and dkv; top-k: the selected index sets equal on every row), then
timed with CUDA events: median of 5 after 2 warm-ups. One JSON line per variant on stdout; the
list in OUT_JSON, rewritten after each variant (a crash keeps what ran).

    python benchmarks/kernel_variants.py OUT_JSON [--only fwd bwd topk] [--budget S]
        [--old-kernel FILE]      # also time a forward from another commit: FILE = that commit's
                                 # dsa_kernels/ops/sparse_mla/kernel.py with its relative imports made
                                 # absolute (`from dsa_kernels._triton_common import ...`)
        [--no-interleaved]       # skip the interleaved backward's configs (BWD_INTERLEAVED)
    TRITON_INTERPRET=1 python benchmarks/kernel_variants.py OUT_JSON --small --only fwd   # CPU smoke run
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the harness beside this script
from child_bench import time_ms as bench_time_ms  # noqa: E402

# name, block_k, stages, warps, value split (None: the plan's own)
FWD_VARIANTS = [
    ("default", None, None, None, None),
    ("k16-s2", 16, 2, 8, 1),
    ("k16-s3", 16, 3, 8, 1),
    ("k16-s1", 16, 1, 8, 1),
    ("k32-s2", 32, 2, 8, 1),
    ("k32-s3", 32, 3, 8, 1),
    ("k64-s2", 64, 2, 8, 1),
    ("k16-s2 split2", 16, 2, 8, 2),
    ("k32-s2 split2", 32, 2, 8, 2),
    ("k64-s2 split2", 64, 2, 8, 2),
    ("k16-s2 w4 split2", 16, 2, 4, 2),
    ("k32-s2 w4 split2", 32, 2, 4, 2),
]
# name, block_k, stages (None: Triton's default), warps
BWD_VARIANTS = [
    ("default", None, "plan", None),
    ("k16 s2", 16, 2, 8),
    ("k16 s1", 16, 1, 8),
    ("k16 s2 w4", 16, 2, 4),
    ("k32 s3 (Triton default)", 32, None, 8),
    ("k32 s2", 32, 2, 8),
    ("k32 s1", 32, 1, 8),
]
# the interleaved backward (`plan_bwd_interleaved`, 32 heads a program; its 32-key, 2-stage config
# is in the autotuning space), timed after the variants above and compared with the first of them:
# (name, its keyword arguments). All compile without spill at the 671B shapes except 4 warps (one
# warp group: no replicated logits, products twice as wide; 316 / 84 B of spill under Triton 3.9 /
# 3.6), which only this sweep times.
BWD_INTERLEAVED = [
    ("interleaved h32 k32 s2 (autotune space)", dict(block_k=32, num_stages=2)),
    ("interleaved h32 k16 s2", dict(block_k=16, num_stages=2)),
    ("interleaved h32 k32 s3", dict(block_k=32, num_stages=3)),
    ("interleaved h32 k16 s2 w4", dict(block_k=16, num_stages=2, num_warps=4)),
]
# warps, score block (None: the plan's own)
TOPK_VARIANTS = [(8, None), (8, 1024), (8, 2048), (8, 4096), (4, 512), (4, 1024), (4, 2048), (16, 1024)]


class Sweep:
    def __init__(self, out_json: str, budget_s: float, cuda: bool):
        self.out_json, self.deadline, self.cuda = out_json, time.time() + budget_s, cuda
        self.t0, self.rows = time.time(), []

    def record(self, **row):
        row["t_s"] = round(time.time() - self.t0, 1)
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        with open(self.out_json, "w") as f:
            json.dump(self.rows, f, indent=1)

    def over_budget(self, kind: str, name: str) -> bool:
        if time.time() > self.deadline:
            self.record(kind=kind, name=name, status="skipped: --budget spent")
            return True
        return False

    def time_ms(self, fn) -> float:
        """Median of 5 after 2 warm-ups (CUDA events); one wall-clock call off the GPU."""
        return bench_time_ms(fn, self.cuda)

    def compile_and_run(self, launch):
        """Runs the launch once (compiling it) -> (compiled kernel or None, seconds)."""
        t = time.time()
        compiled = launch.kernel[launch.grid](**launch.args, **launch.options())
        if self.cuda:
            torch.cuda.synchronize()
        return compiled, time.time() - t


def resources(compiled) -> dict:
    return {"registers": getattr(compiled, "n_regs", None), "spill_bytes": getattr(compiled, "n_spills", None)}


def _load(path):
    """A kernel module from a file (another commit's kernel.py)."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_json")
    p.add_argument("--only", nargs="+", choices=("fwd", "bwd", "topk"), default=("fwd", "bwd", "topk"))
    p.add_argument("--budget", type=float, default=600.0, help="seconds; later variants are skipped after it")
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU interpreter smoke run)")
    p.add_argument("--variants", type=int, default=None, help="only the first N variants of each kind")
    p.add_argument("--old-kernel", default=None, help="a sparse_mla kernel.py from another commit (forward)")
    p.add_argument("--no-interleaved", action="store_true", help="skip the interleaved backward's configs (BWD_INTERLEAVED)")
    args = p.parse_args(argv)

    import triton

    from dsa_kernels.ops.indexer_topk import kernel as TK
    from dsa_kernels.ops.sparse_mla import kernel as SM
    from dsa_train.gpucheck.correctness import compare
    from dsa_train.gpucheck.inputs import dims_for, randn, topk_lists, valid_pairs

    def rel_err(x, ref) -> float:  # max |x - ref| / max |ref| (gpu-check's measure)
        return compare(x, ref, math.inf)["err"]

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    if not cuda and not args.small:
        print("kernel_variants: no CUDA GPU; run it on one, or add --small under TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    d = dims_for(args.small)
    T = d.speed_T
    sweep = Sweep(args.out_json, args.budget, cuda)
    cut = slice(None, args.variants)
    print(f"T={T} H={d.H} D={d.D} D_V={d.D_V} k={d.K} device="
          f"{torch.cuda.get_device_name() if cuda else 'cpu'} triton {triton.__version__} torch {torch.__version__}",
          flush=True)
    ds = torch.zeros(1, T, dtype=torch.long, device=dev)
    pos = torch.arange(T, device=dev)
    idx = topk_lists(ds, pos, d.K, seed=1, empty_rows=()).to(torch.int32).contiguous()
    pairs = valid_pairs(ds, pos, d.K)
    # bf16 on the GPU; fp32 under the interpreter, whose tl.dot is wrong on 16-bit operands
    # (dsa_kernels._triton_common.interp_upcast), so the smoke run's comparisons mean something
    dt = torch.bfloat16 if cuda else torch.float32
    q = randn((1, T, d.H, d.D), dev, seed=2, dtype=dt)
    kv = randn((1, T, d.D), dev, seed=3, dtype=dt)
    scale = d.D**-0.5
    n_slots = SM.slot_counts(idx, T)
    flops = {"fwd": 2 * pairs * d.H * (d.D + d.D_V), "bwd": 2 * pairs * d.H * (3 * d.D + 2 * d.D_V)}

    def tflops(kind, ms):
        return round(flops[kind] / ms / 1e9, 1) if cuda else None

    if "fwd" in args.only:
        first = None
        variants = [(n, bk, st, w, sp, None) for n, bk, st, w, sp in FWD_VARIANTS[cut]]
        if args.old_kernel:
            variants.append(("--old-kernel", None, None, None, None, args.old_kernel))
        for name, bk, stages, warps, split, old in variants:
            if sweep.over_budget("fwd", name):
                continue
            try:
                out = torch.empty((1, T, d.H, d.D_V), dtype=q.dtype, device=dev)
                lse = torch.empty((1, T, d.H), dtype=torch.float32, device=dev)
                if old:
                    module = _load(old)
                    launch = module.plan_fwd(q, kv, idx, n_slots, out, lse, scale, d.D_V)
                else:
                    launch = SM.plan_fwd(q, kv, idx, n_slots, out, lse, scale, d.D_V,
                                         None if bk is None else (name, bk, stages))
                    if warps is not None:
                        launch.num_warps = warps
                    if split is not None and split != launch.args["VALUE_SPLIT"]:
                        launch.grid = (launch.grid[0] * split // launch.args["VALUE_SPLIT"], launch.grid[1])
                        launch.args["VALUE_SPLIT"] = split
                compiled, compile_s = sweep.compile_and_run(launch)
                err = None if first is None else rel_err(out, first)
                first = out.clone() if first is None else first
                ms = sweep.time_ms(launch.run)
                a = launch.args
                sweep.record(kind="fwd", name=name, ms=round(ms, 3), tflops=tflops("fwd", ms), err_vs_first=err,
                             block_k=a["BLOCK_K"], stages=launch.num_stages, warps=launch.num_warps,
                             value_split=a.get("VALUE_SPLIT", a.get("SPLIT_V")), compile_s=round(compile_s, 1),
                             **resources(compiled))
            except Exception as err:  # one variant's failure is a row, the sweep goes on
                sweep.record(kind="fwd", name=name, status=f"error {type(err).__name__}: {str(err)[:300]}")
                traceback.print_exc()

    if "bwd" in args.only:
        with torch.no_grad():
            out0, lse0 = SM.sparse_mla_fwd(q, kv, idx, n_slots, scale, d.D_V)
        dout = randn((1, T, d.H, d.D_V), dev, seed=4, dtype=dt)
        delta = SM.bwd_delta(out0, dout, lse0, None)
        first = None
        variants = [(n, bk, st, w, None, None) for n, bk, st, w in BWD_VARIANTS[cut]]
        variants += [(n, None, None, None, True, kw) for n, kw in BWD_INTERLEAVED if not args.no_interleaved]
        for name, bk, stages, warps, interleaved, kwargs in variants:
            if sweep.over_budget("bwd", name):
                continue
            try:
                dq = torch.empty_like(q)
                dkv = torch.zeros(kv.shape, dtype=torch.float32, device=dev)
                if interleaved:
                    launch = SM.plan_bwd_interleaved(q, kv, idx, n_slots, dout, lse0, delta, dq, dkv, scale, d.D_V,
                                                     **kwargs)
                else:
                    launch = SM.plan_bwd(q, kv, idx, n_slots, dout, lse0, delta, dq, dkv, scale, d.D_V)
                if stages != "plan" and not interleaved:
                    launch.num_stages = stages
                if warps is not None:
                    launch.num_warps = warps
                if bk is not None:
                    launch.args["BLOCK_K"] = bk

                def run(launch=launch, dkv=dkv):
                    dkv.zero_()  # dkv accumulates with atomics: zeroed in every timed call (~0.03 ms)
                    launch.run()

                dkv.zero_()
                compiled, compile_s = sweep.compile_and_run(launch)
                err = None if first is None else max(rel_err(dq, first[0]), rel_err(dkv, first[1]))
                first = (dq.clone(), dkv.clone()) if first is None else first
                ms = sweep.time_ms(run)
                sweep.record(kind="bwd", name=name, ms=round(ms, 3), tflops=tflops("bwd", ms), err_vs_first=err,
                             block_k=launch.args["BLOCK_K"], stages=launch.num_stages, warps=launch.num_warps,
                             compile_s=round(compile_s, 1), **resources(compiled))
            except Exception as err:
                sweep.record(kind="bwd", name=name, status=f"error {type(err).__name__}: {str(err)[:300]}")
                traceback.print_exc()

    if "topk" in args.only and not sweep.over_budget("topk", "select"):
        qi = randn((1, T, d.H_I, d.D_I), dev, seed=4)
        ki = randn((1, T, d.D_I), dev, seed=5)
        wi = randn((1, T, d.H_I), dev, seed=6, dtype=torch.float32, std=(d.H_I * d.D_I) ** -0.5)
        C = min(T, 4096)
        scores, k0 = TK.index_scores_triton(qi, ki, wi, ds, T - C, T)
        B, C, W = scores.shape
        first = None
        for warps, block in TOPK_VARIANTS[cut]:
            name = f"select w{warps} block {block or 'plan'}"
            if sweep.over_budget("topk", name):
                continue
            try:
                sel_i = torch.full((B, C, d.K), -1, dtype=torch.int32, device=dev)
                sel_v = torch.full((B, C, d.K), float("-inf"), dtype=torch.float32, device=dev)
                launch = TK.plan_select(scores, sel_i, sel_v, *TK.candidate_buffers(B, C, device=dev), k0, d.K, block)
                launch.num_warps = warps
                compiled, compile_s = sweep.compile_and_run(launch)
                got = torch.sort(sel_i, -1).values
                same = None if first is None else bool(torch.equal(got, first))
                first = got if first is None else first
                ms = sweep.time_ms(launch.run)
                sweep.record(kind="topk", name=name, ms=round(ms, 3), same_sets_as_first=same, rows=C, width=W,
                             block=launch.args["BLOCK"], warps=warps, **resources(compiled))
            except Exception as err:
                sweep.record(kind="topk", name=name, status=f"error {type(err).__name__}: {str(err)[:300]}")
                traceback.print_exc()
        if cuda:
            sweep.record(kind="topk", name="torch.topk", ms=round(sweep.time_ms(lambda: torch.topk(scores, d.K, -1)), 3))
    print(f"kernel_variants: {len(sweep.rows)} rows in {time.time() - sweep.t0:.0f} s -> {args.out_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
