"""The Gluon index-score kernel (`dsa_kernels/ops/indexer_topk/gluon_scores.py`) against the Triton score
kernel's configs, on one GPU: correctness and time at T = 32K, 671B dims (H_I = 64, d_I = 128, bf16 q/k,
fp32 w), one document, causal.

    python benchmarks/gluon_index_scores.py OUT_JSON [--T 32768] [--rows 2048] [--budget 70]
    TRITON_INTERPRET=1 python benchmarks/gluon_index_scores.py OUT_JSON --small   # CPU smoke run of the script

Rows ("kind"):
- "block": the last `--rows` query rows (the driver's chunk at 32K: 2^26 / 32K = 2048) over the whole
  key window, an fp32 score block, for every config of sm_90's score space (`kernel.score_config_space`:
  the Triton "heads-rows" (the default) and "keys-rows", the Gluon "gluon-keys-rows" (4 queries x 64
  heads per wgmma, N = 256) and "gluon-keys-rows-q2" (N = 128)), each run forced (`plan_scores(...,
  config=)`), compared with the default's block (the -inf pattern equal; max |a - b| / max |b| over
  the finite scores; `verify_pass`: the autotuner's criterion, SCORE_VERIFY_RTOL) and with the fp32
  PyTorch reference on 8 rows, then timed with CUDA events (median of 5 after 2 warm-ups). Then the
  default and "gluon-keys-rows" on a bf16 score block ("block-bf16").
- "diagnostic": "gluon-keys-rows" on the fp32 block without the producer's k copies (DIAG 1) and
  without the consumers' epilogue (DIAG 2): is a tile's time the copies', the tensor cores' or the
  epilogue's? (outputs meaningless, not compared).
- "full": the whole 32K causal scores pass as the driver runs it (16 chunks of 2048 rows, each over
  its window [0, last row]; one launch per chunk into one reused block), per config: the time of the
  16 launches together. The default's row is today's default run time of the pass.
TFLOPS = useful FLOPs / time, useful = 2 H_I d_I per causal (query, key) pair (8.8 TFLOP for the full
pass at 32K): the convention of docs/kernels.md's "Scores + select at 32K".

The measurements run in a child process under a deadline (`--budget` seconds, 70 by default): a kernel
that hangs (a producer / consumer handshake bug: the Gluon kernel has never run on a GPU) is killed with
its process and reported as a timeout; the rows written before stay. One JSON line per row on stdout;
the list in OUT_JSON. A config that fails to compile or launch is a row with its error, not a crash.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the harness beside this script
from child_bench import Child, add_child_arguments, run_child  # noqa: E402

REF_ROWS = 8


def _child(args) -> int:
    import torch

    from dsa_kernels._triton_common import interpreted
    from dsa_kernels.ops.indexer_topk import kernel as TK
    from dsa_train.gpucheck.inputs import randn

    child = Child(args, lambda cap: [name for name, _ in TK.score_config_space(cap)])
    emit, deadline, d, cuda, dev, capability = (child.emit, child.deadline, child.d, child.cuda, child.dev,
                                                child.capability)
    sync, time_ms = child.sync, child.time_ms
    space = [name for name, _ in TK.score_config_space(capability)]
    gluon = {name for name, kind in TK.score_config_space(capability) if kind == "gluon"}

    T = args.T
    dt = torch.bfloat16 if cuda else torch.float32  # the interpreter's tl.dot is wrong on 16-bit operands
    q = randn((1, T, d.H_I, d.D_I), dev, seed=T + 11, dtype=dt)
    k = randn((1, T, d.D_I), dev, seed=T + 12, dtype=dt)
    w = randn((1, T, d.H_I), dev, seed=T + 13, dtype=torch.float32, std=(d.H_I * d.D_I) ** -0.5)
    ds = torch.zeros(1, T, dtype=torch.long, device=dev)
    pos = torch.arange(T, device=dev, dtype=torch.int32)
    C = min(args.rows, T)
    q0, q1 = T - C, T
    pairs = sum(t + 1 for t in range(q0, q1))  # causal (query, key) pairs of the block, one document
    flops = 2.0 * d.H_I * d.D_I * pairs
    base = dict(T=T, H_I=d.H_I, D_I=d.D_I, rows=C, window=q1)
    # the fp32 reference on the block's last REF_ROWS rows (the longest windows): keys [0, q1), causal
    from dsa_kernels.ops.indexer_topk.reference import index_scores_block

    ref_rows = list(range(C - REF_ROWS, C))
    with torch.no_grad():
        ref = index_scores_block(q[:, q1 - REF_ROWS:q1].float(), k[:, :q1].float(), w[:, q1 - REF_ROWS:q1])
    s = torch.arange(q1, device=dev)
    ref = ref.masked_fill(s[None, None, :] > torch.arange(q1 - REF_ROWS, q1, device=dev)[None, :, None], float("-inf"))

    def rel(x, y) -> float:
        fin = torch.isfinite(y)
        if not torch.equal(fin, torch.isfinite(x)):
            return float("inf")
        if not bool(fin.any()):
            return 0.0
        return float((x[fin].float() - y[fin].float()).abs().max() / y[fin].float().abs().max().clamp_min(1e-30))

    def plan(name, out, r0=q0, r1=q1):
        return TK.plan_scores(q, k, w, ds, out, pos, r0, r1, 0, config=name)

    runnable = [n for n in space if not (n in gluon and (not cuda or interpreted()))]
    default = space[0]
    blocks = {}
    for dtype, kind in ((torch.float32, "block"), (torch.bfloat16, "block-bf16")):
        names = runnable if dtype == torch.float32 else [n for n in (default, "gluon-keys-rows") if n in runnable]
        for name in names:
            if time.time() > deadline - 5:
                emit(kind=kind, config=name, **base, note="budget spent")
                continue
            try:
                out = torch.empty((1, C, q1), dtype=dtype, device=dev)
                launch = plan(name, out)
                t0 = time.time()
                launch.run()
                sync()
                first_s = time.time() - t0
                row = dict(first_call_s=round(first_s, 1), nan=bool(torch.isnan(out).any()),
                           ref_err=rel(out[:, ref_rows], ref if dtype == torch.float32 else ref.to(dtype)))
                if name == default:
                    blocks[dtype] = out
                else:
                    row["err_vs_default"] = rel(out, blocks[dtype])
                    row["verify_pass"] = row["err_vs_default"] <= TK.SCORE_VERIFY_RTOL[dtype]
                    del out
                ms = time_ms(launch.run)
                emit(kind=kind, config=name, gluon=name in gluon, **base, ms=round(ms, 3),
                     tflops=round(flops / ms / 1e9, 1), **row)
            except Exception as err:  # a compile / launch failure is a row
                emit(kind=kind, config=name, **base, error=f"{type(err).__name__}: {str(err)[-600:]}")
                traceback.print_exc()
    for name in space:
        if name not in runnable:
            emit(kind="block", config=name, **base, note="not run: Gluon kernels run only compiled on an sm_90 GPU")
    # timing diagnostics of the first Gluon config on the fp32 block (outputs not compared): without the
    # producer's k copies (DIAG 1: the tensor cores, the epilogue and the handshake) and without the
    # consumers' epilogue (DIAG 2: the copies, the tensor cores and the handshake)
    first = next((n for n in space if n in gluon and n in runnable), None)
    for diag, what in ((1, "no k copies"), (2, "no epilogue")) if first else ():
        if time.time() > deadline - 5:
            emit(kind="diagnostic", config=f"{first} ({what})", **base, note="budget spent")
            continue
        try:
            out = torch.empty((1, C, q1), dtype=torch.float32, device=dev)
            launch = plan(first, out)
            launch.args["DIAG"] = diag
            ms = time_ms(launch.run)
            emit(kind="diagnostic", config=f"{first} ({what})", **base, ms=round(ms, 3),
                 tflops=round(flops / ms / 1e9, 1))
            del out
        except Exception as err:
            emit(kind="diagnostic", config=f"{first} ({what})", **base, error=f"{type(err).__name__}: {str(err)[-300:]}")
    blocks.clear()
    if cuda:
        torch.cuda.empty_cache()

    # the whole causal pass as the driver chunks it: chunks of C rows, each over [0, its last row]
    chunks = [(r0, min(T, r0 + C)) for r0 in range(0, T, C)]
    full_flops = 2.0 * d.H_I * d.D_I * T * (T + 1) / 2
    buf = torch.empty((1, C, T), dtype=torch.float32, device=dev)
    for name in runnable:
        if time.time() > deadline - 5:
            emit(kind="full", config=name, T=T, note="budget spent")
            continue
        try:
            launches = [plan(name, buf[:, :r1 - r0, :r1], r0, r1) for r0, r1 in chunks]

            def run_all():
                for launch in launches:
                    launch.run()

            ms = time_ms(run_all)
            emit(kind="full", config=name, gluon=name in gluon, T=T, chunks=len(chunks), rows_per_chunk=C,
                 ms=round(ms, 3), tflops=round(full_flops / ms / 1e9, 1), default=name == default)
        except Exception as err:
            emit(kind="full", config=name, T=T, error=f"{type(err).__name__}: {str(err)[-600:]}")
            traceback.print_exc()
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_json")
    p.add_argument("--T", type=int, default=32768)
    p.add_argument("--rows", type=int, default=2048, help="query rows of the timed block (the driver's chunk)")
    add_child_arguments(p, budget=70.0)
    args = p.parse_args(argv)
    if args.child:
        return _child(args)
    if args.small:
        args.T, args.rows = min(args.T, 128), min(args.rows, 32)
    return run_child(__file__, args.out_json, ["--T", str(args.T), "--rows", str(args.rows)], args.budget, args.small,
                     "gluon_index_scores")


if __name__ == "__main__":
    sys.exit(main())
