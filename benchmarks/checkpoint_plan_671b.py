"""What one rank of a 671B recipe proposes when it saves a checkpoint, and what that costs
(docs/checkpoints.md, "Planning at 1024 ranks").

    python benchmarks/checkpoint_plan_671b.py v3.2_sparse [RANK]     # world 1024 (v3.2_warmup: 128)

Rank RANK (default 0) of the recipe's layout at its full world size is built as `dsa-train plan
--trace` builds it: torch's fake process group, megatron-core's groups, the 671B model
(`DSAConfig()`, 61 layers + MTP) on the meta device, parallelized. Its checkpoint pieces are the
real `model_pieces` / `optimizer_pieces` (checkpoint/sharded_state.py) over that model and over the
stage's ZeRO partitions (the optimizer stand-in below cuts the trainable parameters into even
flat partitions over DP x CP, experts over expert-DP, as the planner's traced ZeRO step does), and
DCP's own save planner makes the rank's local plan from them: metadata only, no tensor. Prints
one JSON line: write items and pickled plan bytes before (every holder proposes) and after (one
holder per replica), the planning time and the peak Python memory (tracemalloc) of the local
plan, and the rank-0 totals they imply at the full world size; and the largest model tensor (what
bounds the end-of-run export's memory per rank).
"""

from __future__ import annotations

import json
import math
import pickle
import sys
import time
import tracemalloc
from types import SimpleNamespace

import torch


def zero_fragments(trainable, state, zero_stage: int) -> list:
    """This rank's fragments of an even flat ZeRO partition of the trainable parameters."""
    from dsa_train.checkpoint.sharded_state import Fragment
    from dsa_train.sharding import sharding_of

    ps = state.ps
    groups = [([(n, p) for n, p in trainable if not sharding_of(p).expert],
               ps.get_data_parallel_rank(with_context_parallel=True), state.sizes.dense_dp),
              ([(n, p) for n, p in trainable if sharding_of(p).expert],
               ps.get_expert_data_parallel_rank(), state.sizes.expert_dp)]
    out = []
    for params, index, parts in groups:
        total = sum(p.numel() for _, p in params)
        if not total:
            continue
        part = math.ceil(total / parts) if zero_stage >= 1 else total
        lo, hi = (index * part, (index + 1) * part) if zero_stage >= 1 else (0, total)
        flat = torch.empty(part, dtype=torch.float32, device="meta")
        optimizer = SimpleNamespace(state={flat: {k: torch.empty_like(flat) for k in ("exp_avg", "exp_avg_sq")}})
        pos = 0
        for name, p in params:
            start, stop = max(lo, pos), min(hi, pos + p.numel())
            if start < stop:
                out.append(Fragment(name, p, start - pos, stop - start, optimizer, flat, start - lo))
            pos += p.numel()
    return out


def local_plan(pieces: dict):
    from dsa_train.checkpoint.sharded_state import _save_planner

    planner = _save_planner()
    planner.set_up_planner(pieces, is_coordinator=False)
    return planner.create_local_plan()


def measure(recipe: str, rank: int = 0) -> dict:
    from dsa_train.checkpoint.skeleton import empty_model
    from omegaconf import OmegaConf

    from dsa_train.config import compose_recipe
    from dsa_train.checkpoint.sharded_state import model_pieces, optimizer_pieces
    from dsa_train.model.config import DSAConfig
    from dsa_train.parallel.layout import replica_coordinates
    from dsa_train.parallel.model import parallelize_model
    from dsa_train.plan.trace import close_fake_world, init_fake_world
    from dsa_train.stage import Stage

    composed = compose_recipe(recipe, [])  # as `dsa-train plan`: no data sources or checkpoint needed
    composed.model.pretrained = "<model.pretrained>"
    cfg = OmegaConf.to_object(composed)
    world = cfg.cluster.nodes * (cfg.cluster.procs_per_node or cfg.cluster.gpus_per_node)
    stage_name = list(cfg.stages)[-1]
    stage = Stage.of(stage_name, cfg.stages[stage_name])
    zero = cfg.parallel.zero_stage
    state = init_fake_world(cfg.parallel, rank, world)
    try:
        start = time.perf_counter()
        model = empty_model(DSAConfig())
        with torch.device("meta"):
            parallelize_model(model, state, recompute=cfg.parallel.recompute, grouped_experts=cfg.parallel.grouped_experts)
        model.to(getattr(torch, cfg.model.dtype.value))
        engine = SimpleNamespace(fragments=lambda: zero_fragments(stage.select_trainable(model), state, zero))
        built = time.perf_counter() - start
        coords = replica_coordinates(state, zero)
        out = {"recipe": recipe, "world": world, "rank": rank, "zero_stage": zero, "stage": stage_name,
               "model_build_seconds": round(built, 1)}
        for label, writer in (("every_holder", None), ("one_holder", coords)):
            tracemalloc.start()
            t0 = time.perf_counter()
            pieces = model_pieces(model, state.sizes.tensor, writer)
            pieces.update(optimizer_pieces(engine, state.sizes.tensor, writer=writer))
            plan = local_plan(pieces)
            seconds = time.perf_counter() - t0
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            items = len(plan.items)
            model_items = sum(1 for i in plan.items if i.index.fqn.startswith("model/"))
            out[label] = {"items": items, "model_items": model_items, "optimizer_items": items - model_items,
                          "pickled_bytes": len(pickle.dumps(plan)), "seconds": round(seconds, 2),
                          "peak_python_bytes": peak}
            del pieces, plan
        # rank 0 gathers every rank's local plan: model items are spread over the holders (their
        # total is the number of distinct model chunks, counted here from the held model); ZeRO
        # fragments are each rank's own (one per rank and partition, `world` times this rank's)
        held = model_pieces(model, state.sizes.tensor)
        # the end-of-run export holds one tensor at a time (up to 3x in DCP's read): its largest
        largest = max(held.items(), key=lambda kv: math.prod(kv[1].shape) * kv[1].dtype.itemsize)
        out["largest_tensor"] = largest[0]
        out["largest_tensor_bytes"] = math.prod(largest[1].shape) * largest[1].dtype.itemsize
        dense_chunks = sum(1 for k, p in held.items() if "mlp.experts." not in k)
        expert_chunks = sum(1 for k in held if "mlp.experts." in k) * state.sizes.expert
        after, before = out["one_holder"], out["every_holder"]
        per_item = after["pickled_bytes"] / max(after["items"], 1)
        out["rank0_items_after"] = int(dense_chunks + expert_chunks + world * after["optimizer_items"])
        out["rank0_items_before"] = int(world * before["items"])
        out["rank0_plan_bytes_after"] = int(out["rank0_items_after"] * per_item)
        out["rank0_plan_bytes_before"] = int(out["rank0_items_before"] * before["pickled_bytes"] / max(before["items"], 1))
        return out
    finally:
        close_fake_world()


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0)), flush=True)
