"""Peak memory of loading a multi-shard checkpoint (docs/checkpoints.md).

    python benchmarks/checkpoint_load_memory.py make DIR     # ~404 MB fp32 model, 11 shards <= 40 MB
    python benchmarks/checkpoint_load_memory.py load DIR     # dsa_train's streaming loader
    python benchmarks/checkpoint_load_memory.py naive DIR    # all shards into one state dict, then the model

`load` and `naive` print one JSON line: the checkpoint and model sizes and the growth of the
peak resident set (VmHWM, i.e. ru_maxrss of a process started from a shell) over its peak
before loading. Run each in a fresh process. glibc's dynamic mmap threshold is pinned first (dsa_train.runtime), otherwise heap
fragmentation inflates RSS beyond what is actually held.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import torch

# About 100 M parameters (404 MB in fp32): 4 layers (1 dense + 3 MoE with 16 experts), hidden 1024, vocab 4096.
CONFIG = dict(
    vocab_size=4096, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
    num_hidden_layers=4, num_nextn_predict_layers=0, num_attention_heads=8, q_lora_rank=256,
    kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
    n_routed_experts=16, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
    index_n_heads=8, index_head_dim=64,
)
SHARD_BYTES = 40 * 10**6


def peak_rss_bytes() -> int:
    """This process's peak resident set: VmHWM. (getrusage's ru_maxrss is the same number in a
    process started from a shell, but a child of a large process, e.g. under pytest, inherits its
    parent's high-water mark through fork + exec, which hides the growth being measured.)"""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def make(path: Path) -> None:
    import dsa_train

    torch.manual_seed(0)
    model = dsa_train.DSAForCausalLM(dsa_train.tiny_config(**CONFIG))
    dsa_train.save_pretrained(model, path, max_shard_bytes=SHARD_BYTES)


def measure(path: Path, how: str) -> dict:
    from dsa_train.runtime import limit_heap_fragmentation

    limit_heap_fragmentation()
    import dsa_train
    from dsa_train.checkpoint.skeleton import empty_model  # noqa: F401  (import cost before the baseline)

    shards = sorted(path.glob("*.safetensors"))
    before = peak_rss_bytes()
    start = time.perf_counter()
    if how == "load":
        model = dsa_train.from_pretrained(path, dtype=torch.float32)
    else:
        from safetensors.torch import load

        state = {}
        for f in shards:  # copies in anonymous memory (load_file's memory map could be paged out)
            state.update(load(f.read_bytes()))
        model = dsa_train.DSAForCausalLM(dsa_train.DSAConfig.from_pretrained(path))
        model.load_state_dict(state, strict=False)
    seconds = time.perf_counter() - start
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return {
        "how": how,
        "model_mb": round(model_bytes / 1e6, 1),
        "checkpoint_mb": round(sum(f.stat().st_size for f in shards) / 1e6, 1),
        "shards": len(shards),
        "largest_shard_mb": round(max(f.stat().st_size for f in shards) / 1e6, 1),
        "peak_growth_mb": round((peak_rss_bytes() - before) / 1e6, 1),
        "peak_before_mb": round(before / 1e6, 1),
        "seconds": round(seconds, 2),
    }


if __name__ == "__main__":
    what, directory = sys.argv[1], Path(sys.argv[2])
    if what == "make":
        make(directory)
    else:
        print(json.dumps(measure(directory, what)))
