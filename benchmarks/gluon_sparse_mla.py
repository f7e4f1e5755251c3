"""The Gluon sparse MLA forward and backward (`dsa_kernels/ops/sparse_mla/gluon_fwd.py`, `gluon_bwd.py`)
against the Triton forward / interleaved backward, on one GPU: correctness and time at T = 4K and 32K, 671B dims (H = 128, D = 576, d_v = 512), k = 2048.

    python benchmarks/gluon_sparse_mla.py OUT_JSON [--T 4096 32768] [--budget 110] [--what fwd bwd]
    TRITON_INTERPRET=1 python benchmarks/gluon_sparse_mla.py OUT_JSON --small   # CPU smoke run of the script

Per T (one document, causal top-k lists as gpu-check builds them, the first row empty): the Triton
forward's default config (`plan_fwd`'s default: what runs today), then each Gluon config ("gluon":
each tile's PV waited for; "gluon-pv": PV in flight under the next tile's logits). Each Gluon config
is compared with the Triton forward on every row (out: max |a - b| / max |b|; lse: max |a - b|, the
-inf rows equal) and both with the fp32 PyTorch reference (`sparse_mla_ref`) on 32 rows (the first
rows, with few or no valid slots, and the last ones); then timed with CUDA events (median of 5 after
2 warm-ups). At the largest T, two timing diagnostics of "gluon" (outputs not compared):
without the producer's copies (compute and synchronization only) and without the consumers' math
(the gather and synchronization only). TFLOPS = 2 pairs H (D + d_v) / time, pairs = sum over rows of min(k, visible keys)
(docs/gpu-check.md's convention). A config that fails to compile or launch is a row with its error,
not a crash.

Backward (`--what bwd`, on by default with the forward): per T the interleaved Triton backward (the
autotuned config; 404 ms / 113 TFLOPS at 32K on an H200) into fp32 dkv, then each Gluon backward
config of the space (`gluon_bwd.py`: "gluon-k32-c64", and "gluon-k32-c128" under Triton 3.6) compared
with it (dq on every row, dkv: max |a - b| / max |b|, and the autotuner's verify criterion) and timed
the same way; at the largest T the first Gluon backward's two diagnostics (no gather, no math).
Backward TFLOPS = 2 pairs H (3 D + 2 d_v) / time (TileLang's count). Rows "bwd-triton", "bwd-gluon",
"bwd-diagnostic".

The measurements run in a child process under a deadline (`--budget` seconds, 110 by default): a kernel
that hangs (a synchronization bug) is killed with its process and reported as a timeout; the rows
written before stay. One JSON line per row on stdout; the list in OUT_JSON.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the harness beside this script
from child_bench import Child, add_child_arguments, run_child  # noqa: E402

GLUON_CONFIGS = (("gluon", 64, 2), ("gluon-pv", 64, 2))
REF_ROWS = 32


def _child(args) -> int:
    """Runs the measurements, appending one JSON line per row to args.rows_file."""
    import torch

    from dsa_kernels.ops.sparse_mla import kernel as SM
    from dsa_kernels.ops.sparse_mla.gluon_fwd import gluon_fwd_supported
    from dsa_kernels.ops.sparse_mla.reference import sparse_mla_ref
    from dsa_train.gpucheck.inputs import randn, topk_lists, valid_pairs

    child = Child(args, lambda cap: [c[0] for c in SM.fwd_config_space(cap)])
    emit, deadline, d, cuda, dev = child.emit, child.deadline, child.d, child.cuda, child.dev
    cap = divmod(child.capability, 10)
    sync, time_ms = child.sync, child.time_ms

    def rel(x, ref) -> float:
        return float((x.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))

    def lse_err(x, ref) -> float:
        inf = torch.isinf(ref)
        if not torch.equal(torch.isinf(x), inf) or not torch.equal(x[inf], ref[inf]):
            return math.inf
        return float((x[~inf] - ref[~inf]).abs().max()) if bool((~inf).any()) else 0.0

    def bwd_rows(q, kv, idx, n_slots, out, lse, scale, base, T):
        """The backward at this T: the interleaved Triton backward (the autotuned config measured at 404
        ms on an H200 at 32K), then each Gluon backward config of the space, compared with it (dq on
        every row, dkv; the autotuner's verify criterion `verify_pass`) and timed; at the largest T the
        first Gluon config's two diagnostics (no gather, no math; outputs not compared)."""
        from dsa_kernels.ops.sparse_mla.gluon_bwd import gluon_bwd_supported

        space = {c[0]: c for c in SM.bwd_config_space(cap[0] * 10 + cap[1])}
        ref_name = next((n for n, c in space.items() if c[1] == "interleaved"), next(iter(space)))
        gluon = [n for n, c in space.items() if c[1] == "gluon"] or [c[0] for c in SM.BWD_GLUON_CONFIGS]
        bflops = 2.0 * base["pairs"] * d.H * (3 * d.D + 2 * d.D_V)
        dout = randn(tuple(out.shape), dev, seed=T + 4, dtype=out.dtype)
        delta = SM.bwd_delta(out, dout, lse, None)

        def run_bwd(name, diag=0):
            dq = torch.empty_like(q)
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=dev)
            cfg = space.get(name) or next(c for c in SM.BWD_GLUON_CONFIGS_TRITON_36 if c[0] == name)
            launch = SM.plan_bwd_config(cfg, q, kv, idx, n_slots, dout, lse, delta, dq, dkv, scale, d.D_V)
            launch.args["DIAG"] = diag if diag else launch.args.get("DIAG", 0)
            t0 = time.time()
            launch.run()
            sync()
            return launch, dq, dkv, time.time() - t0

        try:
            launch, r_dq, r_dkv, first_s = run_bwd(ref_name)
            ms = time_ms(launch.run)
            emit(kind="bwd-triton", config=ref_name, **base, ms=round(ms, 3), tflops=round(bflops / ms / 1e9, 1),
                 first_call_s=round(first_s, 1))
        except Exception as err:
            emit(kind="bwd-triton", config=ref_name, **base, error=f"{type(err).__name__}: {str(err)[-400:]}")
            traceback.print_exc()
            return
        r_dqf = r_dq.float()
        del r_dq
        why = gluon_bwd_supported(q, kv, d.D_V, cap[0] * 10 + cap[1])
        for name in gluon:
            if why is not None:
                emit(kind="bwd-gluon", config=name, **base, error=f"not supported here: {why}")
                continue
            if time.time() > deadline - 5:
                emit(kind="bwd-gluon", config=name, **base, note="budget spent")
                continue
            try:
                launch, g_dq, g_dkv, first_s = run_bwd(name)
                row = dict(first_call_s=round(first_s, 1), nan=bool(torch.isnan(g_dq).any() or torch.isnan(g_dkv).any()),
                           dq_err_vs_triton=rel(g_dq, r_dqf), dkv_err_vs_triton=rel(g_dkv, r_dkv),
                           verify_pass=SM._close(g_dkv, r_dkv) and SM._close(g_dq.float(), r_dqf))
                del g_dq, g_dkv
                ms = time_ms(launch.run)
                emit(kind="bwd-gluon", config=name, **base, ms=round(ms, 3), tflops=round(bflops / ms / 1e9, 1), **row)
            except Exception as err:  # a compile / launch failure is a row
                emit(kind="bwd-gluon", config=name, **base, error=f"{type(err).__name__}: {str(err)[-600:]}")
                traceback.print_exc()
        if why is None and T == max(args.T):
            for diag, what in ((1, "no gather"), (2, "no math")):
                if time.time() > deadline - 5:
                    emit(kind="bwd-diagnostic", config=f"{gluon[0]} ({what})", **base, note="budget spent")
                    continue
                try:
                    launch, _, _, _ = run_bwd(gluon[0], diag)
                    ms = time_ms(launch.run)
                    emit(kind="bwd-diagnostic", config=f"{gluon[0]} ({what})", **base, ms=round(ms, 3),
                         tflops=round(bflops / ms / 1e9, 1))
                except Exception as err:
                    emit(kind="bwd-diagnostic", config=f"{gluon[0]} ({what})", **base,
                         error=f"{type(err).__name__}: {str(err)[-300:]}")
        del r_dqf, r_dkv, dout, delta

    for T in sorted(args.T):  # ascending: what runs at the largest T (diagnostics, the experiment) is last
        if time.time() > deadline - 5:
            emit(kind="skip", T=T, note="budget spent")
            continue
        ds = torch.zeros(1, T, dtype=torch.long, device=dev)
        pos = torch.arange(T, device=dev)
        idx = topk_lists(ds, pos, d.K, seed=T + 1).to(torch.int32).contiguous()
        pairs = valid_pairs(ds, pos, d.K)
        flops = 2.0 * pairs * d.H * (d.D + d.D_V)
        dt = torch.bfloat16 if cuda else torch.float32  # the interpreter's tl.dot is wrong on 16-bit operands
        q = randn((1, T, d.H, d.D), dev, seed=T + 2, dtype=dt)
        kv = randn((1, T, d.D), dev, seed=T + 3, dtype=dt)
        scale = d.D**-0.5
        n_slots = SM.slot_counts(idx, T)
        rows = torch.cat([torch.arange(REF_ROWS // 2), torch.arange(T - REF_ROWS // 2, T)]).to(dev)
        with torch.no_grad():
            r_out, r_lse = sparse_mla_ref(q[:, rows].float(), kv.float(), idx[:, rows], scale, d.D_V)

        def run_config(cfg):
            out = torch.empty((1, T, d.H, d.D_V), dtype=q.dtype, device=dev)
            lse = torch.empty((1, T, d.H), dtype=torch.float32, device=dev)
            launch = SM.plan_fwd(q, kv, idx, n_slots, out, lse, scale, d.D_V, cfg)
            t0 = time.time()
            launch.run()
            sync()
            return launch, out, lse, time.time() - t0

        base = dict(T=T, H=d.H, D=d.D, D_V=d.D_V, k=d.K, pairs=pairs)
        try:
            launch, t_out, t_lse, first_s = run_config(None)
            ms = time_ms(launch.run)
            emit(kind="triton", config=SM.fwd_config_space(cap[0] * 10 + cap[1])[0][0], **base, ms=round(ms, 3),
                 tflops=round(flops / ms / 1e9, 1), first_call_s=round(first_s, 1),
                 ref_out_err=rel(t_out[:, rows], r_out), ref_lse_err=lse_err(t_lse[:, rows], r_lse))
        except Exception as err:
            emit(kind="triton", **base, error=f"{type(err).__name__}: {str(err)[-400:]}")
            traceback.print_exc()
            continue
        why = gluon_fwd_supported(q, kv, d.D_V, cap[0] * 10 + cap[1])
        for cfg in GLUON_CONFIGS if "fwd" in args.what else ():
            if why is not None:
                emit(kind="gluon", config=cfg[0], **base, error=f"not supported here: {why}")
                continue
            if time.time() > deadline - 5:
                emit(kind="gluon", config=cfg[0], **base, note="budget spent")
                continue
            try:
                launch, g_out, g_lse, first_s = run_config(cfg)
                row = dict(first_call_s=round(first_s, 1), nan=bool(torch.isnan(g_out).any() or torch.isnan(g_lse).any()),
                           out_err_vs_triton=rel(g_out, t_out), lse_err_vs_triton=lse_err(g_lse, t_lse),
                           ref_out_err=rel(g_out[:, rows], r_out), ref_lse_err=lse_err(g_lse[:, rows], r_lse),
                           verify_pass=SM.fwd_outputs_close(g_out.float(), t_out.float(), g_lse, t_lse))
                del g_out, g_lse
                ms = time_ms(launch.run)
                emit(kind="gluon", config=cfg[0], **base, ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1), **row)
            except Exception as err:  # a compile / launch failure is a row
                emit(kind="gluon", config=cfg[0], **base, error=f"{type(err).__name__}: {str(err)[-600:]}")
                traceback.print_exc()
        # timing diagnostics at the largest T (outputs not compared): the "gluon" kernel with the
        # producer's copies left out (DIAG 1: compute and synchronization only) and with the
        # consumers' math left out (DIAG 2: the gather and synchronization only)
        if why is None and T == max(args.T) and "fwd" in args.what:
            for diag, what in ((1, "no gather"), (2, "no math")):
                if time.time() > deadline - 5:
                    emit(kind="diagnostic", config=f"gluon ({what})", **base, note="budget spent")
                    continue
                try:
                    launch, _, _, first_s = run_config(GLUON_CONFIGS[0])
                    launch.args["DIAG"] = diag
                    ms = time_ms(launch.run)
                    emit(kind="diagnostic", config=f"gluon ({what})", **base, ms=round(ms, 3),
                         tflops=round(flops / ms / 1e9, 1))
                except Exception as err:
                    emit(kind="diagnostic", config=f"gluon ({what})", **base,
                         error=f"{type(err).__name__}: {str(err)[-300:]}")
        if "bwd" in args.what:
            bwd_rows(q, kv, idx, n_slots, t_out, t_lse, scale, base, T)
        del q, kv, idx, t_out, t_lse
        if cuda:
            torch.cuda.empty_cache()
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_json")
    p.add_argument("--T", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--what", nargs="+", choices=["fwd", "bwd"], default=["fwd", "bwd"],
                   help="the forward's rows, the backward's rows, or both")
    add_child_arguments(p, budget=110.0)
    args = p.parse_args(argv)
    if args.child:
        return _child(args)
    if args.small:
        args.T = [t for t in args.T if t <= 256] or [64, 128]
    return run_child(__file__, args.out_json, ["--T", *map(str, args.T), "--what", *args.what], args.budget, args.small,
                     "gluon_sparse_mla")


if __name__ == "__main__":
    sys.exit(main())
