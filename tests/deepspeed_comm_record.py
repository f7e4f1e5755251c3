"""Records every collective one rank of a real DeepSpeed data-parallel step issues, per ZeRO stage.

Run under torchrun on the CPU (gloo, DeepSpeed's CPU accelerator):

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node=2 \
        -m tests.deepspeed_comm_record --zero 0,1,2 --out comm.json -- --config-name demo data.seq_len=64

For each ZeRO stage: the recipe's model (`model_config_of`, as `dsa-train plan` sizes it), the
recipe's last stage (the demo's sparse stage, the one its `plan --trace` traces), the trainer's
`DeepSpeedEngine` (the router's bias update, a trainer hook, is not run), one
micro-batch's forward and backward (`forward_backward`, metrics reduced over the layout) and the
engine's `step`. `plan.trace_comm.CollectiveRecorder` records each c10d call (op, group role and
size, payload in the plan's convention, dtype) with its phase: `backward` inside the engine's
backward (ZeRO-2's hooks and its epilogue), `step` inside `step` and for the metric sums. Rank 0
writes {"zero": {stage: [calls]}, "micro_batches": ..., "stage": ...} to --out.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import warnings


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--zero", default="0,1,2")
    p.add_argument("--out", required=True)
    p.add_argument("recipe", nargs=argparse.REMAINDER, help="-- --config-name NAME overrides...")
    args = p.parse_args(argv)
    recipe_args = [a for a in args.recipe if a != "--"]
    name, overrides = "demo", []
    if recipe_args[:1] == ["--config-name"]:
        name, overrides = recipe_args[1], recipe_args[2:]
    else:
        overrides = recipe_args

    import torch

    from dsa_train.config import to_train_config
    from dsa_train.config.hydra_errors import compose_checked
    from dsa_train.model import DSAForCausalLM
    from dsa_train.parallel.groups import init_parallel
    from dsa_train.parallel.model import parallelize_model
    from dsa_train.parallel.reduction import parallel_reduction
    from dsa_train.plan.estimate import model_config_of
    from dsa_train.plan.trace_comm import CollectiveRecorder
    from dsa_train.stage import Stage
    from dsa_train.trainer.deepspeed_engine import DeepSpeedEngine
    from dsa_train.trainer.step import forward_backward

    torch.set_num_threads(1)
    out: dict = {"zero": {}}
    state = None
    for zero in [int(z) for z in args.zero.split(",")]:
        cfg = to_train_config(compose_checked(name, [*overrides, f"parallel.zero_stage={zero}"]))
        if state is None:
            state = init_parallel(cfg.parallel)
        stage_name = list(cfg.stages)[-1]
        stage = Stage.of(stage_name, cfg.stages[stage_name])
        model_cfg, _ = model_config_of(cfg)
        torch.manual_seed(0)
        dtype = getattr(torch, cfg.model.dtype.value)
        model = DSAForCausalLM(copy.deepcopy(model_cfg)).cast(dtype)
        model = parallelize_model(model, state, recompute=cfg.parallel.recompute,
                                  grouped_experts=cfg.parallel.grouped_experts)
        model.train()
        engine = DeepSpeedEngine(model, stage, cfg.optim, state, zero_stage=zero,
                                 micro_batch_size=cfg.data.micro_batch_size)
        recorder = CollectiveRecorder(state, int(os.environ.get("LOCAL_WORLD_SIZE", state.sizes.world)))
        backward = engine.backward

        def recorded_backward(loss, backward=backward, recorder=recorder):
            with recorder.phase("backward"):
                backward(loss)

        engine.backward = recorded_backward
        B, T = cfg.data.micro_batch_size, cfg.data.seq_len
        g = torch.Generator().manual_seed(1 + state.dp_rank)
        ids = torch.randint(0, model_cfg.vocab_size, (B, T), generator=g)
        batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(T).expand(B, T).contiguous()}
        with recorder:
            forward_backward(engine, [batch], stage, reduction=parallel_reduction(state))
            with recorder.phase("step"):
                engine.step()
        out["zero"][str(zero)] = recorder.calls
        out["stage"] = stage_name
        out["micro_batches"] = max(stage.config.global_batch_size // (B * state.sizes.data), 1)
        out["layout"] = {"dp": state.sizes.data, "dense_dp": state.sizes.dense_dp, "expert_dp": state.sizes.expert_dp}
        engine.close()
    if torch.distributed.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(out, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
