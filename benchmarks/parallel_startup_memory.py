"""Peak resident memory of each rank's meta-device start-up (docs/distributed.md, "Start-up").

    python benchmarks/parallel_startup_memory.py make DIR [experts|dense]   # tiny V3.1-Terminus-layout FP8 checkpoint
    python benchmarks/parallel_startup_memory.py single DIR        # the single-process load: peak, logits
    torchrun --nproc_per_node 2 benchmarks/parallel_startup_memory.py load DIR OUT.jsonl ep2   # or tp2

`make` writes a checkpoint in the V3.1-Terminus layout (FP8 128x128 blocks, ue8m0, MTP, no
indexer: the indexers are fresh) whose routed experts dominate (16 experts of [768, 256] in 3 MoE
layers, main + MTP: ~55% of the model) beside a tensor-parallel part (32 MLA heads in 5 layers,
2 dense MLPs, shared experts: ~33%), no tensor over 4.2 MB, and the sizes of those two parts
(counted by name). `make DIR dense` writes the shape TP 2 is measured on instead: three wide dense
MLPs (8192) and 8 small experts, the tensor-parallel part ~77% of the model, so that the share TP 2
saves (~57 MB of 149) stands well clear of the rank's fixed start-up overhead (17-35 MB measured
across machines). `single` measures the single-process load (`dsa_train.from_pretrained`) in a
fresh process: its peak growth, the whole model's size and the logits of one batch.

`load` runs on every rank, in fresh processes, the start-up the distributed trainer runs
(`dsa_train.trainer.startup.load_parallel_pretrained`) for one layout (ep2: EP 2 x DP 2;
tp2: TP 2), measuring the growth of the rank's peak resident set (VmHWM, reset through
/proc/self/clear_refs) over its resident set before the load, and appends one JSON line to OUT:
peak growth, the bytes it holds, the shard files it opened, the whole model's size and the largest
logit difference to the single-process load.
"""

from __future__ import annotations

import gc
import json
import math
import os
import re
import sys
from pathlib import Path

import torch

COMMON = dict(
    hidden_size=256, n_group=4, topk_group=2, num_attention_heads=32, num_key_value_heads=32, q_lora_rank=256,
    kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, num_hidden_layers=4,
)
SHAPES = {
    # routed experts dominate: what EP 2 saves
    "experts": dict(COMMON, intermediate_size=4096, moe_intermediate_size=768, n_routed_experts=16,
                    num_experts_per_tok=4, first_k_dense_replace=2),
    # tensor-parallel weights dominate: what TP 2 saves
    "dense": dict(COMMON, intermediate_size=8192, moe_intermediate_size=256, n_routed_experts=8,
                  num_experts_per_tok=2, first_k_dense_replace=3),
}
LAYOUTS = {"ep2": dict(tensor_parallel=1, expert_parallel=2), "tp2": dict(tensor_parallel=2, expert_parallel=1)}


def status_kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> int:
    """Reset VmHWM to the current resident set (Linux >= 4.0) and return it, in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_kib("VmHWM") * 1024


def tensor_bytes(model: torch.nn.Module) -> int:
    from dsa_train.trainer.startup import held_tensors

    return sum(t.numel() * t.element_size() for t in held_tensors(model).values())


def batch(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(0))


def opened_files(fn):
    """Run fn() and return (result, names of the .safetensors files it opened)."""
    from dsa_train.checkpoint import safetensors_file

    opened: list[str] = []
    original = safetensors_file.SafetensorsReader.__init__

    def record(self, path, *a, **k):
        opened.append(Path(path).name)
        original(self, path, *a, **k)

    safetensors_file.SafetensorsReader.__init__ = record
    try:
        return fn(), sorted(set(opened))
    finally:
        safetensors_file.SafetensorsReader.__init__ = original


def preload() -> None:
    """Import what the start-up imports lazily (megatron's TP layers, DeepSpeed's MoE base class),
    so the measured growth is tensors, not code."""
    import deepspeed.moe.layer  # noqa: F401
    import megatron.core.tensor_parallel  # noqa: F401

    import dsa_train.parallel.context  # noqa: F401
    import dsa_train.parallel.expert  # noqa: F401
    import dsa_train.parallel.model  # noqa: F401
    import dsa_train.parallel.tensor  # noqa: F401


def load(ckpt: Path, out: Path, layout: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from dsa_train.config import ParallelConfig, resolve_sizes
    from dsa_train.parallel.groups import ParallelState, init_distributed
    from dsa_train.trainer.startup import load_parallel_pretrained
    from dsa_train.runtime import limit_heap_fragmentation

    limit_heap_fragmentation()
    preload()
    init_distributed()
    rank = dist.get_rank()
    sizes = resolve_sizes(ParallelConfig(**LAYOUTS[layout]), dist.get_world_size())
    ps.initialize_model_parallel(tensor_model_parallel_size=sizes.tensor, expert_model_parallel_size=sizes.expert,
                                 create_gloo_process_groups=False)
    state = ParallelState(sizes)
    gc.collect()
    before = reset_peak()
    model, files = opened_files(lambda: load_parallel_pretrained(ckpt, state, torch.float32))
    peak = status_kib("VmHWM") * 1024 - before
    with torch.no_grad():
        logits = model(batch(model.config.vocab_size)).logits
    ref = json.loads((ckpt / "reference.json").read_text())
    ref_logits = torch.load(ckpt / "reference_logits.pt")
    row = {"layout": layout, "rank": rank, "tp": sizes.tensor, "ep": sizes.expert,
           "peak_growth_mb": peak / 1e6, "held_mb": tensor_bytes(model) / 1e6,
           "files_opened": len(files), "whole_model_mb": ref["whole_model_mb"], "single_peak_growth_mb": ref["peak_growth_mb"],
           "max_logit_diff": float((logits - ref_logits).abs().max()), "max_logit": float(ref_logits.abs().max())}
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row))
    ps.destroy_model_parallel()
    dist.destroy_process_group()


TP_SPLIT = re.compile(r"self_attn\.(q_b_proj|q_proj|kv_b_proj|o_proj)\.weight$|\.mlp\.(shared_experts\.)?(gate|up|down)_proj\.weight$")
EXPERT = re.compile(r"\.mlp\.experts\.\d+\.")


def make(path: Path, shape: str = "experts") -> None:
    """The checkpoint, and the fp32 bytes of its routed experts and of its tensor-parallel part
    (counted by name from the written weights, independently of the loader)."""
    from dsa_train.checkpoint.tiny import make_tiny_checkpoint

    make_tiny_checkpoint(path, seed=0, **SHAPES[shape])
    from dsa_train.checkpoint.safetensors_file import read_header

    expert = tp_split = 0
    for f in path.glob("*.safetensors"):
        for name, entry in read_header(f).items():
            n = 4 * math.prod(entry.shape)
            if EXPERT.search(name):
                expert += n
            elif TP_SPLIT.search(name):
                tp_split += n
    (path / "parts.json").write_text(json.dumps({"expert_mb": expert / 1e6, "tp_split_mb": tp_split / 1e6,
                                                 "files": len(list(path.glob("*.safetensors")))}))


def single(path: Path) -> None:
    """The single-process load (`dsa_train.from_pretrained`): its peak growth and logits."""
    import dsa_train
    from dsa_train.runtime import limit_heap_fragmentation

    limit_heap_fragmentation()
    preload()
    gc.collect()
    before = reset_peak()
    full = dsa_train.from_pretrained(path, dtype=torch.float32)
    peak = status_kib("VmHWM") * 1024 - before
    with torch.no_grad():
        torch.save(full(batch(full.config.vocab_size)).logits, path / "reference_logits.pt")
    row = {"whole_model_mb": tensor_bytes(full) / 1e6, "peak_growth_mb": peak / 1e6}
    (path / "reference.json").write_text(json.dumps(row))
    print(json.dumps(row))


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "make":
        make(Path(sys.argv[2]), *sys.argv[3:4])
    elif what == "single":
        single(Path(sys.argv[2]))
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        load(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4])
