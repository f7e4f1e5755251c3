"""gpu-check section `speed`: forward and backward of each Triton kernel timed separately, beside
the published anchors by name and beside baselines timed in the same run (our chunked PyTorch
path, torch.topk on the same score rows, PyTorch SDPA / FlashAttention for dense attention).

Timing (CUDA): CUDA events around each call after WARMUP calls, median of REPS (>= 10); a
backward is timed as `torch.autograd.grad(out, inputs, dout)` alone, on a fresh untimed forward
each time, so it excludes the forward and any host work before it. On the CPU (`--device cpu --small`,
the Triton interpreter) the same code runs once per timing with a wall-clock timer; those are
interpreter wall times, not speeds, and no TFLOPS are reported.

FLOP counts (the anchors' convention: FlashMLA's and TileLang's sparse-MLA benchmarks count
2 * tokens * heads * topk * (D + D_V) forward and 2 * tokens * heads * topk * (3 D + 2 D_V)
backward, i.e. one multiply-add = 2 FLOPs, every selected (query, key) pair, no softmax work):
pairs = the (query, key) pairs attended (sum over rows of min(k, visible keys); T(T+1)/2 causal)
  sparse MLA / dense attention fwd: 2 * pairs * H * (D_qk + D_v)          (QK^T, PV)
  sparse MLA / dense attention bwd: 2 * pairs * H * (3 D_qk + 2 D_v)      (QK^T again, dO V^T, dV, dQ, dK)
  index scores:                     2 * pairs * H_I * d_I
  sparse indexer KL fwd (value):    2 * pairs * (H * D_qk + H_I * d_I)       (target QK^T, index scores)
  sparse indexer KL bwd:            2 * pairs * (H * D_qk + 3 * H_I * d_I)   (both again, dq_I, dk_I)
  dense indexer KL fwd:              2 * pairs * (2 H * D_qk + H_I * d_I)    (the target's lse pass, statistics pass)
  dense indexer KL bwd:              2 * pairs * (H * D_qk + 3 * H_I * d_I)   (the gradient pass alone)
  warm-up KL step (split or fused):  2 * pairs * (H * D_qk + 3 * H_I * d_I)   (the same count for both paths:
                                     the rows compare times; the fused one issues 2*pairs*(H*D_qk + 4*H_I*d_I))
The KL kernels keep no gradient between forward and backward: the sparse backward recomputes the
value's pass; the dense one keeps each row's indexer logsumexp and target mass from the forward
and runs only the gradient pass. The counts above include every product the kernels perform.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time

import torch

from .budget import skip_reason
from .core import Check, Options, Outcome
from .inputs import dims_for, randn, topk_lists, valid_pairs

WARMUP, REPS = 3, 10  # CUDA
WARMUP_CPU, REPS_CPU = 0, 1  # the interpreter: one wall time each, not a speed
BASELINE_REPS = 5  # slow baselines (the chunked PyTorch paths), after one warm-up
BASELINE_CHUNK = 256  # query rows per chunk of the chunked PyTorch baselines on a GPU
DENSE_BASELINE_CHUNK, DENSE_BASELINE_REPS = 64, 3  # the dense PyTorch paths: [H, 64, T] fp32 blocks, slow

# published numbers, TFLOPS, counted as above (issue 21 quotes them; sources in docs/gpu-check.md)
ANCHORS = {
    "sparse_mla.fwd": [("FlashMLA sparse prefill fwd (H800)", 640.0), ("TileLang sparse_mla_fwd (H800)", 355.0),
                       ("TileLang sparse_mla_fwd_pipelined (H800)", 600.0)],
    "sparse_mla.bwd": [("TileLang sparse_mla_bwd (H800)", 100.0), ("TileLang sparse_mla_bwd (H200)", 115.0)],
}
INTERPRETER = "interpreter, not a speed"


def _reps(opts: Options, reps: int | None) -> tuple[int, int]:
    if opts.device == "cuda":
        return (WARMUP, REPS) if reps is None else (1, reps)  # baselines: one warm-up
    return WARMUP_CPU, REPS_CPU


def _time_ms(fn, opts: Options, reps: int | None = None, setup=None) -> float:
    """Median milliseconds of fn(setup()) (CUDA events around fn alone, after warm-up; wall clock
    on the CPU). setup() runs untimed before each call (e.g. the forward whose backward is timed)."""
    warmup, n = _reps(opts, reps)
    cuda = opts.device == "cuda"
    times = []
    for i in range(warmup + n):
        arg = setup() if setup is not None else None
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(arg) if setup is not None else fn()
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn(arg) if setup is not None else fn()
            ms = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(ms)
        del arg
    return statistics.median(times)


def _fwd_bwd(fwd, inputs, dout_like, opts: Options, reps: int | None = None) -> tuple[float, float]:
    """(fwd ms, bwd ms). fwd() -> output (or a tuple, first = the output); the backward is
    torch.autograd.grad(out, inputs, dout) timed alone, on a fresh untimed forward each time
    (some Functions free their saved state in backward)."""

    def first(x):
        return x[0] if isinstance(x, tuple) else x

    if opts.device != "cuda":  # the interpreter: one forward and its backward, wall clock
        t0 = time.perf_counter()
        out = first(fwd())
        t1 = time.perf_counter()
        torch.autograd.grad(out, inputs, dout_like(out.detach()))
        return (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3
    fwd_ms = _time_ms(fwd, opts, reps)
    dout = dout_like(first(fwd()).detach())

    def bwd(out):
        torch.autograd.grad(out, inputs, dout)

    bwd_ms = _time_ms(bwd, opts, reps, setup=lambda: first(fwd()))
    return fwd_ms, bwd_ms


def _passes(fwd, inputs, dout_like, opts: Options, reps: int | None = None) -> dict:
    """_fwd_bwd as {"fwd": ms, "bwd": ms}, the form Table.add_passes and Table.baseline take."""
    return dict(zip(("fwd", "bwd"), _fwd_bwd(fwd, inputs, dout_like, opts, reps)))


class Table:
    """Rows of one speed check: (pass, impl, ms, flops) -> metrics and a one-line summary."""

    def __init__(self, opts: Options, formula: str):
        self.opts, self.formula, self.rows = opts, formula, []

    def add(self, pass_: str, impl: str, ms: float, flops: float | None = None):
        row = {"pass": pass_, "impl": impl, "ms": round(ms, 4)}
        if flops and self.opts.device == "cuda":
            row["tflops"] = round(flops / (ms * 1e-3) / 1e12, 2)
        self.rows.append(row)

    def add_passes(self, impl: str, times: dict, flops: dict):
        """One row per {pass: ms} of times, each with its pass's FLOPs."""
        for p, ms in times.items():
            self.add(p, impl, ms, flops.get(p))

    def baseline(self, impl: str, run, flops: dict):
        """Time a baseline: run() -> {pass: ms}; its failure is a row with the error, not the
        check's failure (the baselines are comparisons, not what is checked)."""
        try:
            self.add_passes(impl, run(), flops)
        except Exception as err:  # e.g. an SDPA backend that refuses these head dims
            msg = " ".join(str(err).split())[:160]
            self.rows.append({"pass": "-", "impl": impl, "ms": None, "error": f"{type(err).__name__}: {msg}"})

    def outcome(self, key: str) -> Outcome:
        ours = {r["pass"]: r for r in self.rows if r["impl"] == "ours"}
        for r in self.rows:
            if "error" in r:
                continue
            base = ours.get(r["pass"])
            if base is not None and r["impl"] != "ours":
                r["time_over_ours"] = float(f"{r['ms'] / base['ms']:.3g}")  # > 1: ours is faster
        anchors = []
        if self.opts.device == "cuda":
            for p, row in ours.items():
                for name, tf in ANCHORS.get(f"{key}.{p}", []):
                    if "tflops" in row:
                        anchors.append({"pass": p, "anchor": name, "anchor_tflops": tf,
                                        "ours_over_anchor": round(row["tflops"] / tf, 3)})
        metrics = {"timings": self.rows, "anchors": anchors, "formula": self.formula,
                   "device_kind": "cuda" if self.opts.device == "cuda" else INTERPRETER}
        parts = []
        for r in self.rows:
            if "error" in r:
                parts.append(f"{r['impl']} failed ({r['error'][:60]})")
                continue
            s = f"{r['pass']} {r['impl']} {r['ms']:.3g} ms"
            if "tflops" in r:
                s += f" {r['tflops']:.0f} TFLOPS"
            if "time_over_ours" in r:
                s += f" (x{r['time_over_ours']:.3g})"
            parts.append(s)
        prefix = "" if self.opts.device == "cuda" else f"[{INTERPRETER}] "
        return Outcome("pass" if self.opts.device == "cuda" else "info", prefix + "; ".join(parts), metrics)


def _device(opts):
    return "cuda" if opts.device == "cuda" else "cpu"


def _budgeted(need_s: float, fn):
    def run(opts: Options) -> Outcome:
        reason = skip_reason(opts, "speed", need_s)
        if reason:
            return Outcome("skip", reason)
        return fn(opts)

    run.need_s = need_s  # budget.check_need_s: what a run that selects this check keeps back for it
    return run


def _single_doc(T, dev):
    return torch.zeros(1, T, dtype=torch.long, device=dev)


# ----------------------------------------------------------------------------- the checks
def sparse_mla_speed(opts: Options) -> Outcome:
    import dsa_kernels as K
    from dsa_kernels.ops.sparse_mla import sparse_mla_chunked

    d, dev = dims_for(opts.small), _device(opts)
    T = d.speed_T
    ds = _single_doc(T, dev)
    pos = torch.arange(T, device=dev)
    idx = topk_lists(ds, pos, d.K, seed=1, empty_rows=())
    pairs = valid_pairs(ds, pos, d.K)
    q = randn((1, T, d.H, d.D), dev, seed=2).requires_grad_()
    kv = randn((1, T, d.D), dev, seed=3).requires_grad_()
    scale = d.D**-0.5
    flops = {"fwd": 2 * pairs * d.H * (d.D + d.D_V), "bwd": 2 * pairs * d.H * (3 * d.D + 2 * d.D_V)}
    table = Table(opts, f"fwd 2*pairs*H*(D+D_V), bwd 2*pairs*H*(3D+2D_V); pairs={pairs}")
    table.add_passes("ours", _passes(lambda: K.sparse_mla(q, kv, idx, scale, d.D_V), (q, kv), torch.randn_like, opts),
                     flops)
    chunk = BASELINE_CHUNK if opts.device == "cuda" else None
    table.baseline("chunked PyTorch", lambda: _passes(lambda: sparse_mla_chunked(q, kv, idx, scale, d.D_V, chunk),
                                                      (q, kv), torch.randn_like, opts, BASELINE_REPS), flops)
    return _with_autotuned(table.outcome("sparse_mla"), ("sparse_mla_fwd", "sparse_mla_bwd"))


def _with_autotuned(outcome: Outcome, kernels: tuple[str, ...]) -> Outcome:
    """The outcome, with which config of each kernel's autotuning space ran (timed on the first
    call; nothing off the GPU) in its metrics and summary line."""
    from dsa_kernels import autotune

    chosen = {k: n for kernel in kernels for k, n in autotune.choices(kernel).items()}
    if chosen:
        outcome.metrics["autotune"] = chosen
        outcome.summary += "; autotuned: " + ", ".join(f"{e.split('|', 1)[0]}={n}" for e, n in chosen.items())
    return outcome


SELECT_GOAL = 1.2  # issue 31: the select within 1.2x torch.topk's time on the same rows
SCORES_SELECT_GOAL_MS = 40.0  # issue 31: the whole-sequence scores + select at T = 32K, one H100 / H200


def indexer_topk_speed(opts: Options) -> Outcome:
    import dsa_kernels as K
    from dsa_kernels.ops.indexer_topk.kernel import _select_chunk, index_scores_triton

    d, dev = dims_for(opts.small), _device(opts)
    T = d.speed_T
    ds = _single_doc(T, dev)
    q = randn((1, T, d.H_I, d.D_I), dev, seed=4)
    k = randn((1, T, d.D_I), dev, seed=5)
    w = randn((1, T, d.H_I), dev, seed=6, dtype=torch.float32, std=(d.H_I * d.D_I) ** -0.5)
    causal = valid_pairs(ds, torch.arange(T), None)
    table = Table(opts, "scores 2*pairs*H_I*d_I (pairs = T(T+1)/2 causal); select: no FLOPs, time only")
    # the whole-sequence call (the goal: <= SCORES_SELECT_GOAL_MS at T = 32K) with each chunk's
    # select on a side stream beside the next chunk's scores (indexer_topk/pipeline.py), and without
    from dsa_kernels.ops.indexer_topk.pipeline import OVERLAP_ENV

    whole, whole_flops = "scores+select", 2 * causal * d.H_I * d.D_I
    with _env(OVERLAP_ENV, "1"):
        table.add(whole, "ours", _time_ms(lambda: K.indexer_topk(q, k, w, ds, d.K), opts), whole_flops)

    def overlap_off():
        with _env(OVERLAP_ENV, "0"):
            return {whole: _time_ms(lambda: K.indexer_topk(q, k, w, ds, d.K), opts)}

    table.baseline("overlap off", overlap_off, {whole: whole_flops})
    # the autotuner picks each chunk's select alone (summary: `autotuned`); two paths forced beside it,
    # overlapped: the radix select (the default) and torch.topk + repair (the torch.topk-speed path)
    from dsa_kernels.ops.indexer_topk.kernel import indexer_topk_triton

    for path in ("radix", "repair"):
        table.baseline(f"overlap, {path} select", lambda p=path: {whole: _time_ms(
            lambda: indexer_topk_triton(q, k, w, ds, d.K, select=p, overlap=True), opts)}, {whole: whole_flops})
    # the last C rows' score block over the whole row: our select (autotuned: the radix select's
    # configs and the two torch.topk paths), each path forced, and plain torch.topk
    C = min(T, 4096)
    scores, k0 = index_scores_triton(q, k, w, ds, T - C, T)
    block_pairs = C * (T - C) + C * (C + 1) // 2
    table.add("scores (last rows)", "ours", _time_ms(lambda: index_scores_triton(q, k, w, ds, T - C, T), opts),
              2 * block_pairs * d.H_I * d.D_I)
    # FP8 scores (issue 31 item 5): the kernel alone on e4m3 q / k quantized beforehand (inference
    # keeps k quantized in its cache), and the whole selection with quantization (index_scores: fp8)
    from dsa_kernels.ops.indexer_topk import quantize_index_inputs
    from dsa_kernels.ops.indexer_topk.kernel import _score_chunk

    q8, qs, k8, ks = quantize_index_inputs(q, k)
    pos = torch.arange(T, device=dev, dtype=torch.int32)
    w32 = w.float().contiguous()
    table.add("scores fp8 (last rows)", "ours",
              _time_ms(lambda: _score_chunk(q8, k8, w32, ds, pos, T - C, T, k0, T, qs, ks), opts),
              2 * block_pairs * d.H_I * d.D_I)
    table.add("scores+select fp8", "ours", _time_ms(lambda: K.indexer_topk(q, k, w, ds, d.K, scoring="fp8"), opts),
              2 * causal * d.H_I * d.D_I)
    sel = "select (last rows)"
    table.add(sel, "ours", _time_ms(lambda: _select_chunk(scores, k0, d.K), opts))
    for path in ("radix", "composite", "fix-ties", "repair", "repair-count"):
        table.baseline(f"{path} select", lambda p=path: {sel: _time_ms(lambda: _select_chunk(scores, k0, d.K, path=p),
                                                                       opts)}, {})
    table.baseline("torch.topk", lambda: {sel: _time_ms(lambda: torch.topk(scores, d.K, dim=-1), opts)}, {})
    # the repair path's two stages apart: torch.topk for k + 1 sorted picks, then the repair kernel
    # alone on those picks (random scores: no tie or non-finite pick rewrites them, so it repeats)
    table.baseline("torch.topk k+1", lambda: {sel: _time_ms(lambda: torch.topk(scores, d.K + 1, dim=-1), opts)}, {})
    # what the contract's order costs inside torch.topk: its in-place sort of the k picks, skipped
    table.baseline("torch.topk unsorted", lambda: {sel: _time_ms(lambda: torch.topk(scores, d.K, dim=-1, sorted=False),
                                                                 opts)}, {})
    table.baseline("repair kernel", lambda: {sel: _time_ms(_repair_kernel_only(scores, d.K, k0), opts)}, {})
    table.baseline("tie count kernel", lambda: {sel: _time_ms(_tie_count_only(scores, d.K), opts)}, {})
    out = _with_autotuned(table.outcome("indexer_topk"), ("indexer_topk_select", "indexer_scores"))
    calls = {r["impl"]: r["ms"] for r in table.rows if r["pass"] == whole and r.get("ms")}
    if opts.device == "cuda" and "ours" in calls:  # the goal for the whole call, overlap on
        met = calls["ours"] <= SCORES_SELECT_GOAL_MS if T == 32768 else None  # the goal is stated at 32K
        out.metrics["scores_select_goal"] = {"T": T, "max_ms": SCORES_SELECT_GOAL_MS, "ms": calls["ours"], "met": met}
        out.summary += f"; scores+select {calls['ours']:.3g} ms (goal <= {SCORES_SELECT_GOAL_MS} ms at T = 32768)"
        if "overlap off" in calls:
            out.metrics["overlap_speedup"] = round(calls["overlap off"] / calls["ours"], 3)
            out.summary += f", overlap off {calls['overlap off']:.3g} ms"
    rows = {r["impl"]: r["ms"] for r in table.rows if r["pass"] == sel and r.get("ms")}
    if opts.device == "cuda" and "torch.topk" in rows:  # the goal: our select within SELECT_GOAL x torch.topk
        ratio = rows["ours"] / rows["torch.topk"]
        out.metrics["select_over_torch_topk"] = {
            impl: round(ms / rows["torch.topk"], 3) for impl, ms in rows.items() if impl != "torch.topk"}
        out.metrics["select_goal"] = {"max_ratio": SELECT_GOAL, "met": ratio <= SELECT_GOAL}
        out.summary += f"; select / torch.topk = {ratio:.2f} (goal <= {SELECT_GOAL})"
        for impl in ("repair select", "repair-count select"):
            if impl in rows:
                out.summary += f"; {impl} / torch.topk = {rows[impl] / rows['torch.topk']:.2f}"
    return out


def _tie_count_only(scores, K: int):
    """The repair-count path's tie count launch over `scores` [B, C, W] (its zeroed counts included)."""
    from dsa_kernels._triton_common import interp_upcast
    from dsa_kernels.ops.indexer_topk.repair import plan_count_ties

    B, C, W = scores.shape
    rows = scores.reshape(B * C, W)
    kk = min(K, W)
    picks_v, _ = torch.topk(rows, kk, dim=-1)
    counts = torch.zeros(B * C, dtype=torch.int32, device=scores.device)
    launch = plan_count_ties(interp_upcast(rows), interp_upcast(picks_v), counts, kk)

    def run():
        counts.zero_()
        launch.run()

    return run


def _repair_kernel_only(scores, K: int, k0: int):
    """The repair path's kernel launch on torch.topk's k + 1 picks of `scores` [B, C, W] (taken once)."""
    from dsa_kernels._triton_common import interp_upcast
    from dsa_kernels.ops.indexer_topk.repair import plan_topk_repair

    B, C, W = scores.shape
    rows = scores.reshape(B * C, W)
    kk = min(K, W)
    picks_v, picks_i = torch.topk(rows, min(kk + 1, W), dim=-1)
    idx = torch.empty((B * C, K), dtype=torch.int32, device=scores.device)
    val = torch.empty((B * C, K), dtype=torch.float32, device=scores.device)
    launch = plan_topk_repair(interp_upcast(rows), interp_upcast(picks_v), picks_i, idx, val, kk, k0)
    return launch.run


def sparse_kl_speed(opts: Options) -> Outcome:
    import dsa_kernels as K
    from dsa_kernels.ops.indexer_kl import sparse_indexer_kl_chunked

    d, dev = dims_for(opts.small), _device(opts)
    T = d.speed_T
    ds = _single_doc(T, dev)
    pos = torch.arange(T, device=dev)
    idx = topk_lists(ds, pos, d.K, seed=7, empty_rows=())
    pairs = valid_pairs(ds, pos, d.K)
    qm, kvm = randn((1, T, d.H, d.D), dev, seed=8), randn((1, T, d.D), dev, seed=9)
    with torch.no_grad():
        _, lse = K.sparse_mla(qm, kvm, idx, d.D**-0.5, d.D_V)
    qi = randn((1, T, d.H_I, d.D_I), dev, seed=10).requires_grad_()
    ki = randn((1, T, d.D_I), dev, seed=11).requires_grad_()
    wi = randn((1, T, d.H_I), dev, seed=12, dtype=torch.float32).requires_grad_()
    flops = {"fwd": 2 * pairs * (d.H * d.D + d.H_I * d.D_I), "bwd": 2 * pairs * (d.H * d.D + 3 * d.H_I * d.D_I)}
    table = Table(opts, f"fwd 2*pairs*(H*D + H_I*d_I), bwd 2*pairs*(H*D + 3*H_I*d_I); pairs={pairs}")
    ours = _passes(lambda: K.sparse_indexer_kl(qi, ki, wi, idx, qm, kvm, lse, d.D**-0.5)[0], (qi, ki, wi),
                   torch.ones_like, opts)
    flops["fwd+bwd"] = flops["fwd"] + flops["bwd"]
    table.add_passes("ours", {**ours, "fwd+bwd": ours["fwd"] + ours["bwd"]}, flops)
    # issue 31: the sparse stage's KL reading the target the attention's forward formed (no KV
    # gather, no main logits; the target's own cost is in the attention forward's time)
    with torch.no_grad():
        p_sum = K.sparse_mla(qm, kvm, idx, d.D**-0.5, d.D_V, return_target=True)[2]
    if p_sum is not None:
        t_flops = {"fwd": 2 * pairs * d.H_I * d.D_I, "bwd": 2 * pairs * 3 * d.H_I * d.D_I}
        t_flops["fwd+bwd"] = t_flops["fwd"] + t_flops["bwd"]
        given = _passes(lambda: K.sparse_indexer_kl(qi, ki, wi, idx, qm, kvm, lse, d.D**-0.5, target=p_sum)[0],
                        (qi, ki, wi), torch.ones_like, opts)
        table.add_passes("ours, target from the attention", {**given, "fwd+bwd": given["fwd"] + given["bwd"]}, t_flops)
        del p_sum
    chunk = BASELINE_CHUNK if opts.device == "cuda" else None
    # the chunked path computes its gradients inside the forward (its backward only scales them:
    # timed alone it read 1.3 ms, "10,000 TFLOPS", on the first GPU run): compared as one
    # forward + backward, timed together
    def chunked_step():
        kl = sparse_indexer_kl_chunked(qi, ki, wi, idx, qm, kvm, lse, d.D**-0.5, chunk)[0]
        torch.autograd.grad(kl, (qi, ki, wi), torch.ones_like(kl))

    table.baseline("chunked PyTorch", lambda: {"fwd+bwd": _time_ms(chunked_step, opts, BASELINE_REPS)}, flops)
    return table.outcome("sparse_indexer_kl")


def dense_kl_speed(opts: Options) -> Outcome:
    import dsa_kernels as K

    d, dev = dims_for(opts.small), _device(opts)
    T = d.speed_T
    ds = _single_doc(T, dev)
    pairs = valid_pairs(ds, torch.arange(T), None)
    qm, km = randn((1, T, d.H_MHA, d.D_MHA), dev, seed=13), randn((1, T, d.H_MHA, d.D_MHA), dev, seed=14)
    qi = randn((1, T, d.H_I, d.D_I), dev, seed=15).requires_grad_()
    ki = randn((1, T, d.D_I), dev, seed=16).requires_grad_()
    wi = randn((1, T, d.H_I), dev, seed=17, dtype=torch.float32).requires_grad_()
    scale = d.D_MHA**-0.5
    # fwd: the target's lse pass (QK^T of every head) + the statistics pass (QK^T again, scores);
    # bwd: the gradient pass alone (QK^T, scores, dq_I, dk_I; each row's lse_I and target mass kept
    # from the forward)
    flops = {"fwd": 2 * pairs * (2 * d.H_MHA * d.D_MHA + d.H_I * d.D_I),
             "bwd": 2 * pairs * (d.H_MHA * d.D_MHA + 3 * d.H_I * d.D_I)}
    table = Table(opts, "fwd 2*pairs*(2*H*D_qk + H_I*d_I) (lse pass + statistics pass), bwd 2*pairs*(H*D_qk + "
                        f"3*H_I*d_I) (gradient pass), pairs = T(T+1)/2 = {pairs}")
    table.add_passes("ours", _passes(lambda: K.dense_indexer_kl(qi, ki, wi, qm, km, scale, ds)[0], (qi, ki, wi),
                                     torch.ones_like, opts), flops)
    chunk = DENSE_BASELINE_CHUNK if opts.device == "cuda" else None
    table.baseline("chunked PyTorch", lambda: _passes(
        lambda: K.dense_indexer_kl_ref(qi, ki, wi, qm, km, scale, ds, chunk)[0], (qi, ki, wi), torch.ones_like, opts,
        DENSE_BASELINE_REPS), flops)
    return table.outcome("dense_indexer_kl")


def dense_attention_speed(opts: Options) -> Outcome:
    import importlib.util

    import dsa_kernels as K

    d, dev = dims_for(opts.small), _device(opts)
    T = d.speed_T
    ds = _single_doc(T, dev)
    pairs = valid_pairs(ds, torch.arange(T), None)
    q = randn((1, T, d.H_MHA, d.D_MHA), dev, seed=18).requires_grad_()
    k = randn((1, T, d.H_MHA, d.D_MHA), dev, seed=19).requires_grad_()
    v = randn((1, T, d.H_MHA, d.DV_MHA), dev, seed=20).requires_grad_()
    scale = d.D_MHA**-0.5
    flops = {"fwd": 2 * pairs * d.H_MHA * (d.D_MHA + d.DV_MHA),
             "bwd": 2 * pairs * d.H_MHA * (3 * d.D_MHA + 2 * d.DV_MHA)}
    table = Table(opts, f"fwd 2*pairs*H*(D_qk+D_v), bwd 2*pairs*H*(3D_qk+2D_v), causal pairs = T(T+1)/2 = {pairs}")
    table.add_passes("ours", _passes(lambda: K.dense_attention(q, k, v, scale, ds), (q, k, v), torch.randn_like, opts),
                     flops)

    def sdpa():
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale)
        return o.transpose(1, 2)

    def timed(fn):
        return lambda: _passes(fn, (q, k, v), torch.randn_like, opts)

    table.baseline("PyTorch SDPA", timed(sdpa), flops)
    chunk = DENSE_BASELINE_CHUNK if opts.device == "cuda" else None
    table.baseline("chunked PyTorch", lambda: _passes(lambda: K.dense_attention_ref(q, k, v, scale, ds, chunk),
                                                      (q, k, v), torch.randn_like, opts, DENSE_BASELINE_REPS), flops)
    if opts.device == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        def fa():  # one head dim for q/k/v: v zero-padded to 192, the padding's work not counted
            from flash_attn import flash_attn_func

            v_pad = torch.nn.functional.pad(v, (0, d.D_MHA - d.DV_MHA))
            return flash_attn_func(q, k, v_pad, softmax_scale=scale, causal=True)[..., : d.DV_MHA]

        table.baseline("FlashAttention", timed(fa), flops)
    return table.outcome("dense_attention")


WARMUP_LAYER_REPS = 2  # after one warm-up: a 32K KL backward takes seconds


def _layer_config(small: bool):
    """An MLA layer at the 671B attention dims (hidden 7168, 128 heads, q-LoRA 1536, latent 512,
    indexer 64 x 128, YaRN factor 40), or a tiny one for the CPU run."""
    from dsa_train.model.config import tiny_config

    if small:
        return tiny_config(num_attention_heads=4, index_n_heads=4, index_head_dim=16)
    return tiny_config(hidden_size=7168, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                       qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, index_n_heads=64,
                       index_head_dim=128, max_position_embeddings=163840,
                       rope_scaling={"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})


def _layer_memory(opts: Options, T: int) -> dict:
    """One warm-up attention layer (MLA + indexer, main weights frozen, bf16) at T tokens: the bytes
    it keeps from its forward to its backward with the indexer and KL checkpointed (`recompute`) and
    without, the peak of its forward + backward above its weights and input, and the milliseconds of
    each (one run; CUDA only)."""
    from dsa_train.model.mla import MLA, AttentionRequest
    from dsa_train.model.rope import RotaryEmbedding

    dev = _device(opts)
    cfg = _layer_config(opts.small)
    torch.manual_seed(0)
    with torch.device(dev):  # initialized on the device (201M parameters at the 671B dims)
        mla = MLA(cfg)
    for name, p in mla.named_parameters():
        keep_fp32 = name.endswith(("indexer.weights_proj.weight", "indexer.k_norm.weight", "indexer.k_norm.bias"))
        p.data = p.data.to(torch.float32 if keep_fp32 or dev == "cpu" else torch.bfloat16)
        p.requires_grad_(name.startswith("indexer."))
    dtype = torch.float32 if dev == "cpu" else torch.bfloat16
    cos, sin = RotaryEmbedding(cfg).to(dev)(torch.arange(T, device=dev)[None])
    x = randn((1, T, cfg.hidden_size), dev, seed=30, dtype=dtype)
    ds = _single_doc(T, dev)
    request = AttentionRequest(attention="dense", indexer_loss=True, main_frozen=True)
    cuda = dev == "cuda"
    result = {}
    for recompute in (True, False):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            events[0].record()
        out, aux = mla(x, cos, sin, ds, request, recompute_indexer=recompute)
        if cuda:
            events[1].record()
            torch.cuda.synchronize()
            kept = torch.cuda.memory_allocated() - base - out.numel() * out.element_size()
        aux.indexer_kl_sum.backward()
        del out, aux
        key = "checkpointed" if recompute else "not_checkpointed"
        if cuda:
            events[2].record()
            torch.cuda.synchronize()
            result[f"kept_mib_{key}"] = round(kept / 2**20, 1)
            result[f"peak_mib_{key}"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
            # one run each (the first includes any compile): projections, attention, indexer, KL
            result[f"fwd_ms_{key}"] = round(events[0].elapsed_time(events[1]), 1)
            result[f"bwd_ms_{key}"] = round(events[1].elapsed_time(events[2]), 1)
        mla.zero_grad(set_to_none=True)
    return result


def warmup_layer_speed(opts: Options) -> Outcome:
    """The dense warm-up's attention layer: the frozen main attention forward with its lse (the
    library kernel, `dense_attention_lse`), then the KL (eq. 3) from that lse, value and gradient
    of q_I, k_I, w; against PyTorch SDPA's forward on the same q, k, v."""
    import dsa_kernels as K
    from dsa_kernels.ops.dense_attention import dense_attention_lse, library

    d, dev = dims_for(opts.small), _device(opts)
    T = d.speed_T
    ds = _single_doc(T, dev)
    pairs = valid_pairs(ds, torch.arange(T), None)
    H, D, DV = d.H_MHA, d.D_MHA, d.DV_MHA
    q, k, v = (randn((1, T, H, n), dev, seed=40 + i) for i, n in enumerate((D, D, DV)))
    qi = randn((1, T, d.H_I, d.D_I), dev, seed=43).requires_grad_()
    ki = randn((1, T, d.D_I), dev, seed=44).requires_grad_()
    wi = randn((1, T, d.H_I), dev, seed=45, dtype=torch.float32, std=(d.H_I * d.D_I) ** -0.5).requires_grad_()
    scale = D**-0.5
    reps = WARMUP_LAYER_REPS if opts.device == "cuda" else None

    def attention():
        with torch.no_grad():
            return dense_attention_lse(q, k, v, scale, ds)

    _, lse = attention()

    def kl():
        return K.dense_indexer_kl(qi, ki, wi, q, k, scale, ds, lse_main=lse)[0]

    def step():
        with torch.no_grad():
            _, lse_s = dense_attention_lse(q, k, v, scale, ds)
        value = K.dense_indexer_kl(qi, ki, wi, q, k, scale, ds, lse_main=lse_s)[0]
        torch.autograd.grad(value, (qi, ki, wi))

    attn_flops = 2 * pairs * H * (D + DV)
    kl_fwd = 2 * pairs * (H * D + d.H_I * d.D_I)
    kl_bwd = 2 * pairs * (H * D + 3 * d.H_I * d.D_I)
    flops = {"attention fwd": attn_flops, "kl fwd": kl_fwd, "kl bwd": kl_bwd, "layer step": attn_flops + kl_fwd + kl_bwd,
             "kl fwd+bwd": kl_bwd}  # one KL step, either path: one pass of the main scores + the indexer's products
    table = Table(opts, "attention fwd 2*pairs*H*(D_qk+D_v); kl fwd 2*pairs*(H*D_qk + H_I*d_I) (target from the "
                        "attention's lse); kl bwd 2*pairs*(H*D_qk + 3*H_I*d_I); layer step = their sum; kl fwd+bwd "
                        "(split and fused alike) 2*pairs*(H*D_qk + 3*H_I*d_I); the fused rows use the same counts "
                        "as the split ones (their TFLOPS compare times, not work); "
                        f"pairs = T(T+1)/2 = {pairs}")
    table.add("attention fwd", "ours", _time_ms(attention, opts, reps), attn_flops)
    backend = library.LAST_BACKEND[0]  # the one that ran (efficient falls back to Triton if it raises)
    kl_ms = _fwd_bwd(kl, (qi, ki, wi), torch.ones_like, opts, reps)
    table.add("kl fwd", "ours", kl_ms[0], kl_fwd)
    table.add("kl bwd", "ours", kl_ms[1], kl_bwd)
    table.add("layer step", "ours", _time_ms(step, opts, reps), flops["layer step"])
    table.add("kl fwd+bwd", "ours", kl_ms[0] + kl_ms[1], flops["kl fwd+bwd"])  # the two medians above, added
    fused = _fused_kl_rows(table, opts, reps, kl, (qi, ki, wi, q, k, scale, ds), lse, flops, attention)

    def sdpa(backend_name=None):
        def run():
            qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            with torch.no_grad():
                if backend_name is None:
                    return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)
                from torch.nn.attention import SDPBackend, sdpa_kernel

                with sdpa_kernel(getattr(SDPBackend, backend_name)):
                    return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)
        return lambda: {"attention fwd": _time_ms(run, opts, reps)}

    table.baseline("PyTorch SDPA", sdpa(), flops)
    if opts.device == "cuda":
        table.baseline("SDPA cuDNN", sdpa("CUDNN_ATTENTION"), flops)
        table.baseline("SDPA efficient", sdpa("EFFICIENT_ATTENTION"), flops)

        def triton_attention():
            from dsa_kernels.ops.dense_attention.function import dense_attention_triton

            with torch.no_grad():
                return dense_attention_triton(q, k, v, scale, ds)

        table.baseline("Triton dense_attention", lambda: {"attention fwd": _time_ms(triton_attention, opts, reps)}, flops)
    outcome = table.outcome("warmup_layer")
    rows = {(r["pass"], r["impl"]): r for r in table.rows if r.get("ms")}
    sdpa_row = rows.get(("attention fwd", "PyTorch SDPA"))
    outcome.metrics["attention_backend"] = backend
    if sdpa_row:
        ratio = rows[("layer step", "ours")]["ms"] / sdpa_row["ms"]
        outcome.metrics["step_over_sdpa_fwd"] = round(ratio, 3)
        outcome.metrics["goal_step_over_sdpa_fwd"] = 2.5
        outcome.summary += f"; layer step / SDPA fwd = {ratio:.3g} (goal <= 2.5)"
        if ("layer step", "fused") in rows:
            fused_ratio = rows[("layer step", "fused")]["ms"] / sdpa_row["ms"]
            outcome.metrics["fused_step_over_sdpa_fwd"] = round(fused_ratio, 3)
            outcome.summary += f", fused {fused_ratio:.3g}"
    if fused is not None:
        outcome.metrics["fused_vs_split"] = fused
        if not fused["agree"]:  # a fused pass that computes something else is no speed-up
            outcome.status = "fail"
            outcome.summary = f"fused KL disagrees with the split path ({fused['worst']}); " + outcome.summary
    del qi, ki, wi, q, k, v, lse
    memory = _layer_memory(opts, T)
    outcome.metrics["layer_memory"] = memory
    if memory:
        outcome.summary += "; one layer kept fwd->bwd: " + ", ".join(
            f"{key.split('_mib_')[1]} {val:.0f} MiB" for key, val in memory.items() if key.startswith("kept"))
    for impl in ("fused", "fused-keep") if fused is not None else ():
        # the same layer on the fused KL (it keeps its gradients instead of its inputs; fused-keep also
        # through the checkpoint, which then reruns no KL)
        with _env("DSA_DENSE_KL", impl):
            fused_memory = _layer_memory(opts, T)
        outcome.metrics[f"layer_memory_{impl.replace('-', '_')}"] = fused_memory
        if fused_memory:
            outcome.summary += f"; {impl}: " + ", ".join(
                f"{key.split('_mib_')[1]} {val:.0f} MiB" for key, val in fused_memory.items() if key.startswith("kept"))
    return outcome


FUSED_AGREE = {"value": 1e-2, "grads": 3e-2}  # relative (gradients: L2), bf16 on a GPU; both paths' own contract is 1%


@contextlib.contextmanager
def _env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _fused_kl_rows(table, opts: Options, reps, kl, kl_args, lse, flops, attention) -> dict | None:
    """Issue 32 item 5: the fused KL pass (`indexer_kl/fused.py`, `DSA_DENSE_KL=fused`) beside the
    dispatched path ("ours": the split one unless DSA_DENSE_KL says otherwise; its "kl fwd+bwd" row
    is its fwd and bwd medians added): one KL step (value and gradients; the fused forward forms the
    gradients, its backward only scales them, so it is timed as one step), the layer step with the
    fused KL, and how far its value and
    gradients are from the dispatched path's -> {"agree", "worst", per-output relative
    differences, "ours_impl"}; None (no rows) where the KL does not take the Triton path."""
    from dsa_kernels._triton_common import use_triton
    from dsa_kernels.ops.indexer_kl.fused import dense_indexer_kl_fused, dense_kl_impl

    qi, ki, wi, q, k, scale, ds = kl_args
    if not use_triton(qi, ki, wi, q, k):
        return None
    inputs = (qi, ki, wi)

    def fused():
        return dense_indexer_kl_fused(qi, ki, wi, q, k, scale, ds, lse_main=lse)[0]

    def one_step(fn):
        def run():
            torch.autograd.grad(fn(), inputs)
        return run

    def step_fused():  # the frozen attention (its lse) + the fused KL, as `warmup_layer_speed`'s step
        _, lse_s = attention()
        value = dense_indexer_kl_fused(qi, ki, wi, q, k, scale, ds, lse_main=lse_s)[0]
        torch.autograd.grad(value, inputs)

    table.add("kl fwd+bwd", "fused", _time_ms(one_step(fused), opts, reps), flops["kl fwd+bwd"])
    table.add("layer step", "fused", _time_ms(step_fused, opts, reps), flops["layer step"])
    got, want = [], []
    for fn, out in ((fused, got), (kl, want)):
        value = fn()
        out.extend([value.detach(), *torch.autograd.grad(value, inputs)])
    diffs = {}
    for name, g, w in zip(("kl", "dq_I", "dk_I", "dw"), got, want):
        g, w = g.double(), w.double()
        diffs[name] = float((g - w).norm() / w.norm().clamp_min(1e-30))
    limits = {n: FUSED_AGREE["value" if n == "kl" else "grads"] for n in diffs}
    worst = max(diffs, key=lambda n: diffs[n] / limits[n])
    agree = all(diffs[n] <= limits[n] for n in diffs)
    return {"agree": agree, "worst": f"{worst} {diffs[worst]:.2e} (limit {limits[worst]:.0e})",
            "relative_difference": {n: float(f"{v:.3g}") for n, v in diffs.items()}, "ours_impl": dense_kl_impl()}


def checks(opts: Options) -> list[Check]:
    d = dims_for(opts.small)
    T = d.speed_T
    how = "CUDA events, median of 10 after 3 warm-ups" if not opts.small or opts.device == "cuda" else INTERPRETER
    return [
        Check("speed.sparse_mla", "speed", f"T={T} H={d.H} D={d.D} D_V={d.D_V} k={d.K}; fwd, bwd; ours vs chunked "
                                           f"PyTorch, FlashMLA/TileLang anchors; {how}",
              _budgeted(40, sparse_mla_speed)),
        Check("speed.indexer_topk", "speed", f"T={T} H_I={d.H_I} d_I={d.D_I} k={d.K}; scores+select "
                                             f"(overlap on / off; radix, repair select overlapped), our select "
                                             f"(autotuned), radix / composite-key / fix-ties / repair / repair-count "
                                             f"paths vs torch.topk on the same rows (and torch.topk k+1 / unsorted, "
                                             f"the repair and tie count kernels alone); {how}", _budgeted(25, indexer_topk_speed)),
        Check("speed.sparse_indexer_kl", "speed", f"T={T} k={d.K} H={d.H} H_I={d.H_I}; fwd, bwd; ours vs chunked "
                                                  f"PyTorch; {how}", _budgeted(30, sparse_kl_speed)),
        Check("speed.dense_indexer_kl", "speed", f"T={T} MHA H={d.H_MHA} D={d.D_MHA} H_I={d.H_I}; fwd, bwd; ours vs "
                                                 f"chunked PyTorch; {how}", _budgeted(40, dense_kl_speed)),
        Check("speed.dense_attention", "speed", f"T={T} MHA H={d.H_MHA} q/k {d.D_MHA} v {d.DV_MHA}; fwd, bwd; ours vs "
                                                f"SDPA (and FlashAttention if installed), chunked PyTorch; {how}",
              _budgeted(40, dense_attention_speed)),
        Check("speed.warmup_layer", "speed", f"T={T} MHA H={d.H_MHA} q/k {d.D_MHA} v {d.DV_MHA} H_I={d.H_I}; frozen "
                                             f"attention fwd (library, lse) + KL fwd/bwd from its lse, split and fused "
                                             f"(DSA_DENSE_KL), vs SDPA's fwd; one layer's memory under checkpointing; {how}",
              _budgeted(110, warmup_layer_speed)),
    ]
