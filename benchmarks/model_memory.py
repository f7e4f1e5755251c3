"""Peak memory of the model path on the CPU: one training micro-batch, forward + backward.

The model is the shipped `small_32k` recipe's architecture (16 heads x [128 nope | 64 rope] MLA,
kv latent 512 + 64, 16-head indexer, bf16) cut to one decoder layer and no MTP module, built and
stepped the way the trainer does it: `build_model` from the recipe, an `Engine` for the stage
(trainable parameters, fp32 masters), `forward_backward` on one micro-batch of T tokens packed
with two documents (position ids restart at T/2). Stages:

  warmup: `stages.warmup` (dense attention, only the indexer trains, loss eq. 3)
  sparse: `stages.sparse` (top-k attention, everything trains, LM loss + eq. 4)

Each measurement runs in a fresh subprocess and reports the process's own resident high-water
mark (VmHWM), its resident size before the forward and the difference ("extra").

    python benchmarks/model_memory.py --stages warmup sparse --seq-lens 16384
Writes JSON lines to stdout (and appends them to --out FILE if given). On a shared, loaded
machine `OMP_NUM_THREADS=1` runs faster than two threads (docs/kernels.md, model-path memory);
the figures there say which was used. Sparse stage at T = 16384, k = 2048: 2577 MB peak.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

RECIPE = "small_32k"


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mb() -> float:
    """VmHWM of this process (ru_maxrss would include what a child inherits from its parent)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def run_stage(stage_name: str, seq_len: int, topk: int | None) -> dict:
    import torch

    from dsa_train.config.recipes import load_recipe
    from dsa_train.data.tokenizer import load_tokenizer
    from dsa_train.trainer import Engine, forward_backward
    from dsa_train.trainer.trainer import build_model
    from dsa_train.stage import Stage

    overrides = [
        "device=cpu",
        f"data.seq_len={seq_len}",
        "model.arch.num_hidden_layers=1",
        "+model.arch.num_nextn_predict_layers=0",
    ]
    if topk is not None:
        overrides.append(f"stages.sparse.topk={topk}")
    cfg = load_recipe(RECIPE, overrides)
    torch.manual_seed(0)
    vocab_size = load_tokenizer(cfg.data.tokenizer).vocab_size
    model = build_model(cfg, vocab_size)
    model.train()
    stage = cfg.stages[stage_name]
    stage_type = Stage.of(stage_name, stage)
    engine = Engine(model, stage_type, cfg.optim)
    ids = torch.randint(0, vocab_size, (1, seq_len))
    half = seq_len // 2  # two packed documents
    position_ids = torch.cat([torch.arange(half), torch.arange(seq_len - half)])[None]
    labels = torch.roll(ids, -1, dims=1)
    labels[0, half - 1] = labels[0, -1] = -100
    micro_batch = {"input_ids": ids, "labels": labels, "position_ids": position_ids}
    before = rss_mb()
    t0 = time.perf_counter()
    metrics = forward_backward(engine, [micro_batch], stage_type)
    seconds = time.perf_counter() - t0
    peak = peak_mb()
    return {
        "bench": "model_memory", "recipe": RECIPE, "stage": stage_name, "seq_len": seq_len,
        "topk": stage_type.topk_for(model.config) if stage_type.sparse else None,
        "dtype": cfg.model.dtype.value, "heads": model.config.num_attention_heads, "layers": 1,
        "seconds": round(seconds, 1), "rss_before_mb": round(before, 1), "peak_rss_mb": round(peak, 1),
        "extra_mb": round(peak - before, 1), "loss": metrics["loss"],
        "machine": f"{platform.machine()} {os.cpu_count()} cpus", "torch": torch.__version__,
    }


def run_child(stage: str, seq_len: int, topk: int | None = None, timeout: float | None = None) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--stages", stage, "--seq-lens", str(seq_len)]
    if topk is not None:
        cmd += ["--topk", str(topk)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{stage} T={seq_len} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stages", nargs="+", choices=["warmup", "sparse"], default=["warmup", "sparse"])
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[16384])
    ap.add_argument("--topk", type=int, help="override the sparse stage's top-k (default: the recipe's)")
    ap.add_argument("--out")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        from dsa_train.runtime import limit_heap_fragmentation

        limit_heap_fragmentation()
        print(json.dumps(run_stage(args.stages[0], args.seq_lens[0], args.topk)))
        return
    for T in args.seq_lens:
        for stage in args.stages:
            try:
                row = run_child(stage, T, args.topk)
            except RuntimeError as err:
                row = {"bench": "model_memory", "stage": stage, "seq_len": T, "error": str(err)[-500:]}
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
