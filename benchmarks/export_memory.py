"""Peak memory per rank of the end-of-run export (docs/checkpoints.md, "Export at the end of a run").

    python benchmarks/export_memory.py make DIR                       # a ~404 MB fp32 training checkpoint
    torchrun --nproc_per_node 2 benchmarks/export_memory.py export DIR OUT   # the export, 2 gloo ranks
    python benchmarks/export_memory.py full DIR                       # every model tensor in memory at once

`make` writes a sharded training checkpoint (checkpoint/training.py, as a run's end writes it) of
the ~100 M-parameter model of benchmarks/checkpoint_load_memory.py. `export` runs
`export_training_checkpoint` on every rank (world from torchrun, gloo), as `CheckpointManager.export`
does at the end of a run, with 40 MB shards so that both ranks write several; each rank prints one
JSON line (also written to OUT.rank<r>.json): the growth of its peak resident set during the export (VmHWM reset through
/proc/self/clear_refs just before, minus the resident set then), the shards it wrote and the
largest tensor. `full` reads every model tensor of the checkpoint into one dict (what a gather of
the full state holds on a rank): its growth shows that the measurement sees a whole model.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint_load_memory import CONFIG, peak_rss_bytes  # noqa: E402

SHARD_BYTES = 40 * 10**6


def rss_bytes() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise OSError("no VmRSS in /proc/self/status")


def reset_peak() -> None:
    """Set VmHWM to the current resident set (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def make(path: Path) -> None:
    import dsa_train
    from dsa_train.checkpoint import training as ckpt
    from dsa_train.checkpoint.sharded_state import model_pieces

    torch.manual_seed(0)
    model = dsa_train.DSAForCausalLM(dsa_train.tiny_config(**CONFIG))
    ckpt.save_checkpoint(path, ckpt.TrainerState(global_step=1), model_pieces(model), {}, {}, keep_last=0,
                         config_json=model.config.to_hf_dict())


def export(src: Path, out: Path) -> dict:
    from dsa_train.runtime import limit_heap_fragmentation

    limit_heap_fragmentation()
    import torch.distributed as dist

    from dsa_train.checkpoint.export import ExportOptions
    from dsa_train.checkpoint.streamed_export import export_training_checkpoint
    from dsa_train.checkpoint.training_source import open_training_checkpoint

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    def agree(problem):
        every = [None] * world
        dist.all_gather_object(every, problem)
        return next((p for p in every if p is not None), None)

    meta = open_training_checkpoint(src).state.meta
    largest = max(t.numel() * t.element_size() for t in meta.values())
    model_bytes = sum(t.numel() * t.element_size() for t in meta.values())
    agree(None)
    reset_peak()
    before = rss_bytes()
    start = time.perf_counter()
    result = export_training_checkpoint(src, out, ExportOptions(dtype=None, max_shard_bytes=SHARD_BYTES),
                                        rank=rank, world_size=world, agree=agree)
    growth = peak_rss_bytes() - before
    mine = list(range(rank, len(result.files), world))
    # both ranks past their last collective before the group goes: under load a rank tearing gloo down
    # while the other still talked to it aborted ("terminate called without an active exception")
    dist.barrier()
    dist.destroy_process_group()
    return {"rank": rank, "world": world, "peak_growth_bytes": growth, "largest_tensor_bytes": largest,
            "model_bytes": model_bytes, "shards": len(result.files), "shards_written": len(mine),
            "seconds": round(time.perf_counter() - start, 2)}


def full(src: Path) -> dict:
    from dsa_train.runtime import limit_heap_fragmentation

    limit_heap_fragmentation()
    from dsa_train.checkpoint.training import read_tensors

    reset_peak()
    before = rss_bytes()
    state = read_tensors(src)
    growth = peak_rss_bytes() - before
    return {"peak_growth_bytes": growth, "model_bytes": sum(t.numel() * t.element_size() for t in state.values())}


if __name__ == "__main__":
    how, src = sys.argv[1], Path(sys.argv[2])
    if how == "make":
        make(src)
    elif how == "export":
        out = Path(sys.argv[3])
        line = json.dumps(export(src / "step_00000001", out))
        (out.parent / f"{out.name}.rank{os.environ.get('RANK', '0')}.json").write_text(line + "\n")
        print(line, flush=True)
    elif how == "full":
        print(json.dumps(full(src / "step_00000001")), flush=True)
    else:
        raise SystemExit(__doc__)
