"""Time, TFLOPS and peak memory of the DSA ops versus T, against the PyTorch reference, dense
attention (SDPA) and megatron-core's DSA functions on the same inputs.

Every (op, impl, T) point runs in a fresh subprocess (peak memory per point; a failure or an
out-of-memory stays local). "ours" is what the dispatcher runs on the CPU, i.e. the chunked
PyTorch reference.

    python benchmarks/kernels.py --device cpu                        # T = 1K..16K, CPU shapes
    python benchmarks/kernels.py --device cuda [--out-dir DIR]       # = dsa-train gpu-check --only speed

On CUDA the timings are `dsa-train gpu-check`'s speed section (dsa_train/gpucheck/speed.py: forward
and backward timed separately with CUDA events, median of 10, TFLOPS counted as FlashMLA / TileLang
count them, beside those anchors and torch.topk / SDPA / the chunked PyTorch path); this script
runs that section and writes its report.json / report.md into --out-dir/gpu-check_speed, so there
is one GPU timing path. The per-point subprocess sweep below is the CPU benchmark.

Ops (fwd = forward only, fwd+bwd = forward and backward):
  sparse_mla         fwd+bwd  ours | megatron (unfused_dsa_fn: [b, heads, T, T] masked scores) | sdpa (dense causal)
  indexer_topk       fwd      ours | megatron (DSAIndexer._compute_index_scores + causal mask + torch.topk)
  dense_indexer_kl   fwd+bwd  ours | megatron (index scores + compute_dsa_indexer_loss, sparse_loss=False)
  sparse_indexer_kl  fwd+bwd  ours | megatron (index scores + compute_dsa_indexer_loss, sparse_loss=True)
  dense_attention    fwd+bwd  ours (MHA form) | sdpa (causal)
  dense_warmup       fwd+bwd  ours: what one warm-up layer runs, dense attention forward (no grad,
                              keeps lse) + the eq. 3 indexer KL from that lse, forward and backward
                              | sdpa (SDPA attention forward + backward on the same q/k/v)
megatron and sdpa points run under an address-space cap (--mem-cap-gb above the child's start)
so that a quadratic allocation fails cleanly instead of exhausting the machine.

Writes benchmarks/results/kernels_<device>.json and .md (and docs/kernels_<device>.png when
matplotlib is importable; otherwise it says so and skips the plot).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

# megatron's loss only asks the collection for its TP group size (one rank here)
_ONE_RANK = type("OneRank", (), {"tp": type("TP", (), {"size": staticmethod(lambda: 1)})()})()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# small enough for 2 cores; the ratios between impls are what matters (the 671B layer's shapes are
# gpu-check's: dsa_train/gpucheck/speed.py)
SHAPES = {"cpu": dict(H=16, D=160, DV=128, K=512, HI=8, DI=64, H_MHA=16, D_MHA=48, DV_MHA=32)}
OPS = {
    "sparse_mla": ["ours", "megatron", "sdpa"],
    "indexer_topk": ["ours", "megatron"],
    "dense_indexer_kl": ["ours", "megatron"],
    "sparse_indexer_kl": ["ours", "megatron"],
    "dense_attention": ["ours", "sdpa"],
    "dense_warmup": ["ours", "sdpa"],
}


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def vm_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def selected_keys(T: int, K: int) -> int:
    """sum_t min(K, t + 1): the number of (query, key) pairs a causal top-k attends."""
    full = min(T, K)
    return full * (full + 1) // 2 + (T - full) * K


def flops(op: str, impl: str, T: int, s: dict) -> float:
    causal = T * (T + 1) / 2
    if op == "sparse_mla":
        if impl == "sdpa":
            return 3.5 * 2 * s["H"] * causal * (s["D"] + s["DV"])
        return 3.5 * 2 * s["H"] * selected_keys(T, s["K"]) * (s["D"] + s["DV"])
    if op == "indexer_topk":
        return 2 * s["HI"] * s["DI"] * causal
    if op == "dense_indexer_kl":
        return 2 * causal * (s["H_MHA"] * s["D_MHA"] + 3 * s["HI"] * s["DI"])
    if op == "sparse_indexer_kl":
        return 2 * selected_keys(T, s["K"]) * (s["H"] * s["D"] + 3 * s["HI"] * s["DI"])
    attention_fwd_bwd = 3.5 * 2 * s["H_MHA"] * causal * (s["D_MHA"] + s["DV_MHA"])
    if op == "dense_attention" or (op == "dense_warmup" and impl != "ours"):
        return attention_fwd_bwd
    if op == "dense_warmup":  # attention forward + the KL (q.k for the target, indexer fwd + bwd)
        return 2 * s["H_MHA"] * causal * (s["D_MHA"] + s["DV_MHA"]) + flops("dense_indexer_kl", impl, T, s)
    raise ValueError(op)


# ----------------------------------------------------------------------------- one point
def make_inputs(op, T, s, dev, dtype):
    import torch

    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=g) * scale).to(dev, dt)

    B = 1
    ds = torch.zeros(B, T, dtype=torch.long, device=dev)
    x = {"doc_start": ds}
    if op in ("sparse_mla", "sparse_indexer_kl"):
        K = s["K"]
        t = torch.arange(T)[:, None]
        # random causal selections (the kernels' cost does not depend on which keys)
        idx = (torch.rand(T, K, generator=g) * (t + 1)).long()
        idx = torch.where(torch.arange(K)[None, :] <= t, idx, torch.full_like(idx, -1))
        x["indices"] = idx[None].to(torch.int32).to(dev)
        x["q"] = rnd(B, T, s["H"], s["D"], scale=0.5)
        x["kv"] = rnd(B, T, s["D"], scale=0.5)
    if op in ("indexer_topk", "dense_indexer_kl", "sparse_indexer_kl", "dense_warmup"):
        x["q_idx"] = rnd(B, T, s["HI"], s["DI"], scale=0.3)
        x["k_idx"] = rnd(B, T, s["DI"], scale=0.3)
        x["w_idx"] = rnd(B, T, s["HI"], dt=torch.float32) * (s["HI"] * s["DI"]) ** -0.5
    if op in ("dense_indexer_kl", "dense_attention", "dense_warmup"):
        x["q_main"] = rnd(B, T, s["H_MHA"], s["D_MHA"], scale=0.5)
        x["k_main"] = rnd(B, T, s["H_MHA"], s["D_MHA"], scale=0.5)
    if op in ("dense_attention", "dense_warmup"):
        x["v_main"] = rnd(B, T, s["H_MHA"], s["DV_MHA"], scale=0.5)
    return x


def dense_attention_baseline(q, k, v, scale):
    """Causal attention fwd + bwd by SDPA on [B, T, H, D] tensors."""
    import torch

    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale)
    o.backward(torch.ones_like(o))


def run_point(op, impl, T, device, dtype_name):
    import torch

    import dsa_kernels as K

    s = SHAPES[device]
    dev = torch.device(device)
    dtype = getattr(torch, dtype_name)
    x = make_inputs(op, T, s, dev, dtype)
    scale = s["D"] ** -0.5

    def grads_of(*ts):
        return [t.detach().requires_grad_() for t in ts]

    if op == "sparse_mla":
        if impl == "ours":
            def fn():
                q, kv = grads_of(x["q"], x["kv"])
                o, _ = K.sparse_mla(q, kv, x["indices"], scale, s["DV"])
                o.backward(torch.ones_like(o))
        elif impl == "sdpa":
            def fn():
                q, kv = grads_of(x["q"], x["kv"])
                qh = q.transpose(1, 2)  # [B, H, T, D]
                k = kv[:, None].expand(-1, s["H"], -1, -1)
                o = torch.nn.functional.scaled_dot_product_attention(
                    qh, k, k[..., : s["DV"]], is_causal=True, scale=scale)
                o.backward(torch.ones_like(o))
        else:
            from megatron.core.transformer.experimental_attention_variant.dsa import unfused_dsa_fn

            def fn():
                q, kv = grads_of(x["q"], x["kv"])
                qm = q[0].unsqueeze(1)  # [T, 1, H, D]
                k = kv[0][:, None, None, :].expand(T, 1, s["H"], s["D"])
                idx = x["indices"].long().clamp(min=0)  # megatron has no -1 slots: pad with key 0
                o = unfused_dsa_fn(qm, k, k[..., : s["DV"]], idx, scale)
                o.backward(torch.ones_like(o))
    elif op == "indexer_topk":
        if impl == "ours":
            def fn():
                K.indexer_topk(x["q_idx"], x["k_idx"], x["w_idx"], x["doc_start"], s["K"])
        else:
            from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexer

            def fn():
                with torch.no_grad():
                    sc = DSAIndexer._compute_index_scores(
                        None, x["q_idx"][0].unsqueeze(1), x["w_idx"][0].unsqueeze(1), x["k_idx"][0].unsqueeze(1))
                    mask = torch.triu(torch.full((T, T), float("-inf"), device=dev), diagonal=1)
                    torch.topk(sc + mask, min(s["K"], T), dim=-1)
    elif op == "dense_indexer_kl":
        if impl == "ours":
            def fn():
                qi, ki, wi = grads_of(x["q_idx"], x["k_idx"], x["w_idx"])
                kl, _ = K.dense_indexer_kl(qi, ki, wi, x["q_main"], x["k_main"], s["D_MHA"] ** -0.5, x["doc_start"])
                kl.backward()
        else:
            from megatron.core.transformer.experimental_attention_variant.dsa import (
                DSAIndexer, compute_dsa_indexer_loss)

            def fn():
                qi, ki, wi = grads_of(x["q_idx"], x["k_idx"], x["w_idx"])
                sc = DSAIndexer._compute_index_scores(None, qi[0].unsqueeze(1), wi[0].unsqueeze(1), ki[0].unsqueeze(1))
                topk = torch.zeros(1, T, 1, dtype=torch.long, device=dev)
                loss = compute_dsa_indexer_loss(
                    sc, topk, x["q_main"][0].unsqueeze(1), x["k_main"][0].unsqueeze(1), s["D_MHA"] ** -0.5, 1.0,
                    sparse_loss=False, pg_collection=_ONE_RANK)
                loss.backward()
    elif op == "sparse_indexer_kl":
        if impl == "ours":
            with torch.no_grad():
                _, lse = K.sparse_mla(x["q"], x["kv"], x["indices"], scale, s["DV"])

            def fn():
                qi, ki, wi = grads_of(x["q_idx"], x["k_idx"], x["w_idx"])
                kl, _ = K.sparse_indexer_kl(qi, ki, wi, x["indices"], x["q"], x["kv"], lse, scale)
                kl.backward()
        else:
            from megatron.core.transformer.experimental_attention_variant.dsa import (
                DSAIndexer, compute_dsa_indexer_loss)

            def fn():
                qi, ki, wi = grads_of(x["q_idx"], x["k_idx"], x["w_idx"])
                sc = DSAIndexer._compute_index_scores(None, qi[0].unsqueeze(1), wi[0].unsqueeze(1), ki[0].unsqueeze(1))
                kvh = x["kv"][0][:, None, None, :].expand(T, 1, s["H"], s["D"])
                loss = compute_dsa_indexer_loss(
                    sc, x["indices"].long().clamp(min=0), x["q"][0].unsqueeze(1), kvh, scale, 1.0,
                    sparse_loss=True, pg_collection=_ONE_RANK)
                loss.backward()
    elif op in ("dense_attention", "dense_warmup"):
        mha_scale = s["D_MHA"] ** -0.5
        if impl == "sdpa":
            def fn():
                q, k, v = grads_of(x["q_main"], x["k_main"], x["v_main"])
                dense_attention_baseline(q, k, v, mha_scale)
        elif op == "dense_attention":
            def fn():
                q, k, v = grads_of(x["q_main"], x["k_main"], x["v_main"])
                o, _ = K.dense_attention(q, k, v, mha_scale, x["doc_start"])
                o.backward(torch.ones_like(o))
        else:  # the warm-up layer: main attention frozen (forward + lse), indexer KL fwd + bwd
            def fn():
                with torch.no_grad():
                    _, lse = K.dense_attention(x["q_main"], x["k_main"], x["v_main"], mha_scale, x["doc_start"])
                qi, ki, wi = grads_of(x["q_idx"], x["k_idx"], x["w_idx"])
                kl, _ = K.dense_indexer_kl(qi, ki, wi, x["q_main"], x["k_main"], mha_scale, x["doc_start"], lse_main=lse)
                kl.backward()
    else:
        raise ValueError(op)

    for _ in range(1 if T <= 2048 else 0):  # warm-up
        fn()
    before = rss_mb()
    times = []
    for _ in range(2 if T <= 4096 else 1):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    sec = sorted(times)[len(times) // 2]
    return {"op": op, "impl": impl, "seq_len": T, "seconds": sec, "tflops": flops(op, impl, T, s) / sec / 1e12,
            "peak_extra_mb": peak_rss_mb() - before, "peak_rss_mb": peak_rss_mb()}


# ----------------------------------------------------------------------------- driver
def child(args):
    sys.path.insert(0, ROOT)
    from dsa_train.runtime import limit_heap_fragmentation

    limit_heap_fragmentation()
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    if args.impl in ("megatron", "sdpa") and args.mem_cap_gb:
        cap = vm_bytes() + int(args.mem_cap_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    try:
        row = run_point(args.op, args.impl, args.seq_lens[0], args.device, args.dtype)
    except (MemoryError, RuntimeError) as e:  # an allocation beyond the cap
        msg = str(e).splitlines()[0][:200]
        if "memory" not in msg.lower() and "alloc" not in msg.lower() and not isinstance(e, MemoryError):
            raise
        row = {"op": args.op, "impl": args.impl, "seq_len": args.seq_lens[0],
               "error": f"out of memory (cap {args.mem_cap_gb} GB above start): {msg}"}
    print("RESULT " + json.dumps(row), flush=True)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores (CPU)"


def write_outputs(rows, args):
    import torch

    out_dir = args.out_dir
    os.makedirs(out_dir, exist_ok=True)
    meta = {"command": "python " + " ".join(sys.argv), "machine": machine(), "torch": torch.__version__,
            "device": args.device, "dtype": args.dtype, "shapes": SHAPES[args.device],
            "mem_cap_gb": args.mem_cap_gb,
            "note": "ours = dispatcher (the chunked reference on the CPU); peak_extra_mb = peak RSS minus "
                    "resident size after the inputs were built"}
    order = list(OPS)
    rows = sorted(rows, key=lambda r: (order.index(r["op"]), r["impl"] != "ours", r["impl"], r["seq_len"]))
    base = os.path.join(out_dir, f"kernels_{args.device}")
    with open(base + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [f"# DSA op benchmark ({args.device})", "", f"Command: `{meta['command']}`  ",
             f"Machine: {meta['machine']}, torch {meta['torch']}, {args.dtype}  ",
             f"Shapes: {SHAPES[args.device]}  ", meta["note"], "",
             "time / ours: this impl's time over ours at the same op and T (> 1: ours is faster)", "",
             "| op | impl | T | time (s) | TFLOPS | time / ours | peak extra (MB) |", "|---|---|---|---|---|---|---|"]
    ours = {(r["op"], r["seq_len"]): r["seconds"] for r in rows if r["impl"] == "ours" and "error" not in r}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['op']} | {r['impl']} | {r['seq_len']} | - | - | - | {r['error'][:90]} |")
        else:
            mine = ours.get((r["op"], r["seq_len"]))
            ratio = f"{r['seconds'] / mine:.2f}" if mine else "-"
            lines.append(f"| {r['op']} | {r['impl']} | {r['seq_len']} | {r['seconds']:.3f} | "
                         f"{r['tflops']:.4f} | {ratio} | {r['peak_extra_mb']:.0f} |")
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not importable: plot skipped", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for op in OPS:
        for impl in OPS[op]:
            pts = [r for r in rows if r["op"] == op and r["impl"] == impl and "error" not in r]
            if pts:
                xs = [r["seq_len"] for r in pts]
                axes[0].plot(xs, [r["seconds"] for r in pts], marker="o", label=f"{op}/{impl}")
                axes[1].plot(xs, [r["peak_extra_mb"] for r in pts], marker="o", label=f"{op}/{impl}")
    for ax, name in zip(axes, ("time (s)", "peak extra memory (MB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("T")
        ax.set_ylabel(name)
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(os.path.join(ROOT, "docs", f"kernels_{args.device}.png"), dpi=110)


def cuda_speed(args) -> int:
    """--device cuda: gpu-check's speed section (one GPU timing implementation)."""
    sys.path.insert(0, ROOT)
    from dsa_train.gpucheck.runner import main as gpu_check

    out = os.path.join(args.out_dir, "gpu-check_speed")
    print(f"benchmarks/kernels.py --device cuda: running `dsa-train gpu-check --only speed --out {out}`", flush=True)
    return gpu_check(["--only", "speed", "--out", out])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seq-lens", type=int, nargs="+", default=None)
    ap.add_argument("--ops", nargs="+", default=list(OPS), choices=list(OPS))
    ap.add_argument("--impls", nargs="+", default=None, help="subset of ours/megatron/sdpa")
    ap.add_argument("--megatron-max-t", type=int, default=None,
                    help="largest T megatron is attempted at (default: every T, under --mem-cap-gb)")
    ap.add_argument("--mem-cap-gb", type=float, default=3.0)
    ap.add_argument("--timeout", type=int, default=1200)
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--resume", action="store_true", help="keep the points already in the JSON")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--op", help=argparse.SUPPRESS)
    ap.add_argument("--impl", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    if args.device == "cuda":
        return cuda_speed(args)
    seq_lens = args.seq_lens or [1024, 2048, 4096, 8192, 16384]
    rows, done = [], set()
    base = os.path.join(args.out_dir, f"kernels_{args.device}.json")
    if args.resume and os.path.exists(base):
        with open(base) as f:
            rows = json.load(f)["rows"]
        done = {(r["op"], r["impl"], r["seq_len"]) for r in rows}
    for op in args.ops:
        for impl in OPS[op]:
            if args.impls and impl not in args.impls:
                continue
            for T in seq_lens:
                if impl == "megatron" and args.megatron_max_t and T > args.megatron_max_t:
                    continue
                if (op, impl, T) in done:
                    continue
                cmd = [sys.executable, os.path.abspath(__file__), "--child", "--op", op, "--impl", impl,
                       "--device", args.device, "--dtype", args.dtype, "--seq-lens", str(T),
                       "--mem-cap-gb", str(args.mem_cap_gb)]
                env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
                try:
                    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
                    res = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
                    if res:
                        row = json.loads(res[-1][7:])
                    else:
                        tail = (proc.stderr.strip().splitlines() or ["?"])[-1][:200]
                        row = {"op": op, "impl": impl, "seq_len": T, "error": f"exit {proc.returncode}: {tail}"}
                except subprocess.TimeoutExpired:
                    row = {"op": op, "impl": impl, "seq_len": T, "error": f"timeout after {args.timeout}s"}
                rows.append(row)
                print(json.dumps(row), flush=True)
                write_outputs(rows, args)


if __name__ == "__main__":
    sys.exit(main())
