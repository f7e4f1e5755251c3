"""Peak memory of the dense warm-up indexer loss (eq. 3), forward + backward, versus T.

Each measurement runs in a fresh subprocess and reports its peak resident set size (ru_maxrss)
and the increase over the process's resident size just before the loss (the "extra" memory).

  ours:     a one-layer dsa_train model (16 heads), dense attention + indexer KL, fwd + bwd
  megatron: megatron-core's `compute_dsa_indexer_loss` on inputs of the same shapes
            (it builds [b, heads, sq, sk] fp32 score tensors)

    python benchmarks/indexer_loss_memory.py --impl ours --seq-lens 4096 8192 16384
    python benchmarks/indexer_loss_memory.py --impl megatron --seq-lens 1024 2048 4096
Writes JSON lines to stdout (and --out FILE if given).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

HEADS = 16


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mb() -> float:
    """This process's own resident high-water mark (VmHWM). ru_maxrss is not used: on Linux a child
    inherits its parent's maximum through fork/exec, so under pytest it would report pytest's peak."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def model_config(seq_len: int):
    import dsa_train

    return dsa_train.tiny_config(
        vocab_size=1024,
        hidden_size=256,
        num_hidden_layers=1,
        num_nextn_predict_layers=0,
        num_attention_heads=HEADS,
        q_lora_rank=128,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        first_k_dense_replace=1,
        index_n_heads=8,
        index_head_dim=64,
        max_position_embeddings=max(seq_len, 4096),
        rope_scaling=None,
    )


def run_ours(seq_len: int) -> dict:
    import torch

    import dsa_train
    from dsa_train.stage import STAGE_KINDS

    torch.manual_seed(0)
    model = dsa_train.DSAForCausalLM(model_config(seq_len))
    for n, p in model.named_parameters():
        p.requires_grad_(STAGE_KINDS["indexer"].trains(n))  # the dense warm-up's trainable set
    ids = torch.randint(0, 1024, (1, seq_len))
    before = rss_mb()
    t0 = time.perf_counter()
    out = model(ids, attention="dense", indexer_loss=True, compute_logits=False)
    out.indexer_loss.backward()
    return {"impl": "ours", "seq_len": seq_len, "seconds": time.perf_counter() - t0,
            "rss_before_mb": before, "peak_rss_mb": peak_mb(), "extra_mb": peak_mb() - before}


def run_megatron(seq_len: int) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.experimental_attention_variant.dsa import compute_dsa_indexer_loss

    # a real single-rank gloo group as megatron's tensor-parallel group (TP = 1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + seq_len % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    pg_collection = ProcessGroupCollection(tp=dist.group.WORLD)
    torch.manual_seed(0)
    b, h, d, hi = 1, HEADS, 48, 8
    query = torch.randn(seq_len, b, h, d)
    key = torch.randn(seq_len, b, h, d)
    index_scores = torch.randn(b, seq_len, seq_len, requires_grad=True)  # the indexer's [b, sq, sk] output
    topk_indices = torch.zeros(b, seq_len, 1, dtype=torch.long)
    before = rss_mb()
    t0 = time.perf_counter()
    loss = compute_dsa_indexer_loss(
        index_scores, topk_indices, query, key, d**-0.5, 1.0, sparse_loss=False, pg_collection=pg_collection
    )
    loss.backward()
    return {"impl": "megatron", "seq_len": seq_len, "seconds": time.perf_counter() - t0,
            "rss_before_mb": before, "peak_rss_mb": peak_mb(), "extra_mb": peak_mb() - before}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=["ours", "megatron"], default="ours")
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--out")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        from dsa_train.runtime import limit_heap_fragmentation

        limit_heap_fragmentation()
        fn = run_ours if args.impl == "ours" else run_megatron
        print(json.dumps(fn(args.seq_lens[0])))
        return
    rows = []
    for T in args.seq_lens:
        proc = subprocess.run([sys.executable, __file__, "--child", "--impl", args.impl, "--seq-lens", str(T)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            row = {"impl": args.impl, "seq_len": T, "error": proc.stderr.strip().splitlines()[-1:]}
        else:
            row = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
