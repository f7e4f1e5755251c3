"""Measured peak memory of a distributed CPU run vs `dsa-train plan`'s estimate for it:

    torchrun --nproc_per_node 2 -m dsa_train.testing.memcheck --zero 2 --seq-len 1024

Each rank reads its resident-set size before it builds anything (after imports and process
groups), trains a few steps of a mid-sized DeepSeek-V3-shaped model (about 100M parameters,
so that model state and activations dominate the process's fixed overhead) with the DeepSpeed
engine, and reports its peak (VmHWM) minus that baseline next to the plan's total for the same
recipe and layout. Rank 0 writes the JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings


def vm(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak() -> None:
    """Linux: writing 5 to clear_refs resets VmHWM to the current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


ARCH = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, moe_intermediate_size=384,
            num_hidden_layers=4, num_nextn_predict_layers=0, num_attention_heads=8, q_lora_rank=256,
            kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=32,
            n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1,
            index_n_heads=8, index_head_dim=64, index_topk=128, max_position_embeddings=8192)


def recipe_overrides(args) -> list[str]:
    return [
        f"data.seq_len={args.seq_len}", "data.micro_batch_size=1",
        f"parallel.zero_stage={args.zero}", f"parallel.expert_parallel={args.ep}", "parallel.data_parallel=-1",
        f"parallel.recompute={args.recompute}", "stages.sparse.topk=128",
        f"stages.sparse.global_batch_size={args.global_batch}", "stages.sparse.lr=1e-4",
    ]


def main(argv: list[str] | None = None) -> int:
    from dsa_train.runtime import limit_heap_fragmentation

    warnings.filterwarnings("ignore")
    limit_heap_fragmentation()  # as the training entry points: a measured peak without heap fragmentation
    p = argparse.ArgumentParser()
    p.add_argument("--zero", type=int, default=2)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--global-batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--recompute", default="none")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    limit = ARCH["max_position_embeddings"]
    if not 0 < args.seq_len <= limit:  # the step takes its positions unchecked, as the trainer's
        p.error(f"--seq-len {args.seq_len}: the memcheck model's positions run 0 .. {limit - 1}; "
                f"pass --seq-len 1 .. {limit}")

    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from dsa_train.config import compose_recipe
    from dsa_train.model import DSAForCausalLM, tiny_config
    from dsa_train.trainer.deepspeed_engine import DeepSpeedEngine
    from dsa_train.parallel.groups import destroy_parallel, init_parallel
    from dsa_train.parallel.model import parallelize_model
    from dsa_train.plan.estimate import make_plan, parse_opts
    from dsa_train.trainer.step import train_step
    from dsa_train.parallel.reduction import parallel_reduction
    from dsa_train.stage import Stage

    torch.set_num_threads(1)
    cfg = OmegaConf.to_object(compose_recipe("demo", ["stage@stages.sparse=sparse", *recipe_overrides(args)]))
    cfg.stages = {"sparse": cfg.stages["sparse"]}
    cfg.model.arch = dict(ARCH)
    state = init_parallel(cfg.parallel)
    stage = Stage.of("sparse", cfg.stages["sparse"])
    import gc

    gc.collect()
    base = vm("VmRSS")
    reset_peak()
    torch.manual_seed(0)
    model = DSAForCausalLM(tiny_config(**ARCH))
    model = parallelize_model(model, state, recompute=args.recompute)
    engine = DeepSpeedEngine(model, stage, cfg.optim, state, zero_stage=args.zero, micro_batch_size=1)
    after_init = vm("VmHWM") - base
    g = torch.Generator().manual_seed(state.rank)
    micro = args.global_batch // state.sizes.data
    for _ in range(args.steps):
        mbs = [{"input_ids": torch.randint(0, ARCH["vocab_size"], (1, args.seq_len), generator=g, device="cpu"),
                "position_ids": torch.arange(args.seq_len, device="cpu")[None]} for _ in range(micro)]
        for mb in mbs:
            mb["labels"] = torch.roll(mb["input_ids"], -1, 1)
        train_step(engine, mbs, stage, reduction=parallel_reduction(state))
    peak = vm("VmHWM") - base
    opts, _ = parse_opts(["--world", str(dist.get_world_size())])
    plan = make_plan(cfg, opts, world=dist.get_world_size())
    planned = plan["stages"][0]
    result = {"rank": state.rank, "layout": plan["layout"], "seq_len": args.seq_len,
              "measured_peak_gib": peak / 2**30, "measured_after_init_gib": after_init / 2**30,
              "planned_gib": planned["total_gib"], "planned": planned["gib"],
              "ratio": (peak / 2**30) / planned["total_gib"]}
    print("MEMCHECK " + json.dumps(result), flush=True)
    if args.out and state.rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)
    destroy_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
