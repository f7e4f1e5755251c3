"""DeepSpeed engine on megatron-core's process groups: the distributed counterpart of
`dsa_train.trainer.Engine`, a `TrainingEngine` as it is (dsa_train/trainer/trainer.py). `.model` is
the model as built, as in `Engine`; DeepSpeed's engine wrapping it is `.ds` (the forward runs
through it).

* ZeRO stage 0/1/2/3 from `parallel.zero_stage`; DeepSpeed's data-parallel group is DP x CP
  (the ranks holding replicas of a dense parameter, `MegatronMPU`), tensor-parallel shards are
  known to it through the same `mpu` (gradient clipping counts each shard once).
* bf16 parameters -> DeepSpeed bf16 with fp32 master weights (ZeRO >= 1).
* Gradient accumulation is driven by the caller (`managed_gradient_accumulation: false`):
  `backward` only accumulates, `step` is the boundary (reduce, clip, update, schedule). ZeRO-0/1
  reduce once per step there; ZeRO-2 reduce-scatters each micro-batch into its partition, overlapped
  with the backward (`overlap_comm`), in fp32 by default (docs/distributed.md, "Gradient reduction").
  Losses arrive already scaled for accumulation (see `dsa_train.parallel.reduction`), so DeepSpeed
  does not divide by the accumulation steps.
* MoE parameter groups: routed-expert parameters (their `Sharding` record names an expert group,
  set by `dsa_train.parallel.expert.shard_experts`) go into DeepSpeed MoE param groups whose
  gradients are reduced over the expert-data-parallel group (megatron-core's). How DeepSpeed
  learns the groups and the parameters (its MoE marks, group registry and MoE layer API) is in
  `dsa_train.parallel.deepspeed_compat`, with every other DeepSpeed private name this engine needs.
"""

from __future__ import annotations

import logging
import math
import os

import torch

from dsa_train.config import OptimConfig
from dsa_train.stage import Stage
from dsa_train.trainer.optimizer import weight_decay_groups
from dsa_train.trainer.schedule import build_scheduler
from dsa_train.checkpoint.sharded_state import Fragment
from dsa_train.parallel import deepspeed_compat
from dsa_train.parallel.buckets import REDUCE_BUCKET
from dsa_train.parallel.groups import MegatronMPU, ParallelState
from dsa_train.sharding import copies_in_world, sharding_of

log = logging.getLogger(__name__)


def _quiet_deepspeed() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)


def param_groups(trainable: list[tuple[str, torch.nn.Parameter]], optim: OptimConfig) -> list[dict]:
    """Matrices decay, vectors do not (`weight_decay_groups`, as `build_optimizer`); expert
    parameters in MoE groups."""
    groups = weight_decay_groups(trainable, optim.weight_decay)
    if any(sharding_of(p).expert for _, p in trainable):
        groups = deepspeed_compat.moe_param_groups(groups)
    return groups


def deepspeed_config(zero_stage: int, micro_batch_size: int, dp_size: int, bf16: bool, grad_clip: float,
                     grad_fp32: bool = True, reduce_fp32: bool | None = None, overflow_check: bool = True) -> dict:
    """DeepSpeed's config. Gradient reduction: ZeRO-0/1 reduce once per step (in `step`, the
    caller-owned accumulation boundary); ZeRO-2 must reduce-scatter every micro-batch's gradients
    into its partition (it keeps no full gradient), so it overlaps that reduction with the backward
    (`overlap_comm`). bf16 gradients are reduced in fp32 with `grad_fp32` (`reduce_fp32` None), or
    in bf16 and accumulated in fp32 with `reduce_fp32=False` (measured against fp32:
    docs/distributed.md, "Gradient reduction"). `overflow_check=False` turns off DeepSpeed's bf16
    overflow check (an amax/amin and two isfinite per parameter every step) where the caller checks
    first (the trainer's NonFiniteGuard: docs/training.md, "Host overhead of a step")."""
    cfg = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": 1,
        "train_batch_size": micro_batch_size * dp_size,
        "managed_gradient_accumulation": False,
        "gradient_clipping": grad_clip if grad_clip > 0 else 0.0,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": zero_stage},
    }
    if zero_stage in (1, 2):
        cfg["zero_optimization"].update({"reduce_scatter": True, "overlap_comm": zero_stage == 2, "contiguous_gradients": True,
                                         "reduce_bucket_size": REDUCE_BUCKET, "allgather_bucket_size": REDUCE_BUCKET})
    if zero_stage == 3:
        cfg["zero_optimization"].update({"stage3_param_persistence_threshold": 0, "overlap_comm": False})
    if bf16:
        # bf16 parameters, fp32 master weights in the ZeRO optimizer; gradients accumulated over
        # micro-batches and reduced over data parallel in fp32 (`optim.grad_accum_dtype`, default)
        # or in bf16. Only ZeRO-2 gets fp32 here (see DeepSpeedEngine.__init__).
        cfg["bf16"] = {"enabled": True, "check_grad_overflow": overflow_check}
        if grad_fp32:
            cfg["data_types"] = {"grad_accum_dtype": "fp32"}
            cfg["communication_data_type"] = "fp32" if reduce_fp32 in (None, True) else "bf16"
    return cfg


class DeepSpeedEngine:
    def __init__(
        self,
        model: torch.nn.Module,
        stage: Stage,
        optim: OptimConfig,
        state: ParallelState,
        zero_stage: int,
        micro_batch_size: int = 1,
        reduce_fp32: bool | None = None,  # bf16 reduce under fp32 accumulation: for benchmarks/grad_reduce_error.py
        overflow_check: bool = True,  # DeepSpeed's own bf16 overflow check; off where the caller checks first
    ):
        _quiet_deepspeed()
        import deepspeed

        self.model = model
        self.state = state
        self.trainable = stage.select_trainable(model)
        deepspeed_compat.mark_expert_parameters(model.parameters())  # before the MoE param groups
        groups = param_groups(self.trainable, optim)
        optimizer = torch.optim.AdamW(groups, lr=stage.config.lr, betas=(optim.betas[0], optim.betas[1]), eps=optim.eps)
        scheduler = build_scheduler(optimizer, stage.config)
        bf16 = any(p.dtype == torch.bfloat16 for _, p in self.trainable)
        # fp32 without ZeRO: DeepSpeed wraps no optimizer, keeps no gradient norm, and its clipping
        # norm averages MoE parameters over data parallel. Here the norm is computed (each
        # parameter counted once over TP/EP shards) and the clipping done by this class.
        self.own_norm = zero_stage == 0 and not bf16
        grad_fp32 = getattr(optim.grad_accum_dtype, "value", optim.grad_accum_dtype) == "float32"
        if bf16 and grad_fp32 and zero_stage != 2:
            # ZeRO-0: DeepSpeed has none; ZeRO-1: its BF16_Optimizer reports a gradient norm ~1.6x the
            # single-process one under caller-driven accumulation (selftest --bf16 --zero 1);
            # ZeRO-3: not checked here. These stay in bf16, said once per stage.
            log.warning(
                "optim.grad_accum_dtype=float32 is implemented for ZeRO-2 (and the single-process engine); "
                "parallel.zero_stage=%d accumulates and reduces bf16 gradients in bf16", zero_stage
            )
            grad_fp32 = False
        self.ds_config = deepspeed_config(
            zero_stage, micro_batch_size, state.sizes.dense_dp, bf16, 0.0 if self.own_norm else optim.grad_clip,
            grad_fp32=grad_fp32, reduce_fp32=reduce_fp32, overflow_check=overflow_check,
        )
        self.grad_clip = optim.grad_clip
        self.zero_stage = zero_stage
        with deepspeed_compat.expert_groups_visible(model, state, self.trainable):
            self.ds, self.optimizer, _, self.scheduler = deepspeed.initialize(
                model=model,
                optimizer=optimizer,
                lr_scheduler=scheduler,
                config=self.ds_config,
                mpu=MegatronMPU(state),
                dist_init_required=False,
            )
        if self.own_norm:
            deepspeed_compat.disable_backward_allreduce(self.ds)  # `reduce_gradients` does it in `step`
        # ZeRO-1/2's gradient norm in one fused norm, not one per parameter (docs/training.md, "Host overhead")
        deepspeed_compat.fuse_grad_norm(self.ds.optimizer)

    @property
    def lr(self) -> float:
        return self.ds.get_lr()[0]

    def forward(self, *args, **kwargs):
        """Forward through DeepSpeed's engine (ZeRO-3 gathers parameters in its hooks)."""
        return self.ds(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        self.ds.backward(loss, scale_wrt_gas=False)

    def gradient_tensors(self) -> list[torch.Tensor]:
        """The gradients this rank holds between backward and step: `p.grad` (ZeRO-0/1 until
        `step` reduces them) and DeepSpeed's own gradient buffers (ZeRO-2/3, the BF16 optimizer:
        `deepspeed_compat.gradient_buffers`)."""
        grads = [p.grad for _, p in self.trainable if p.grad is not None]
        return grads + deepspeed_compat.gradient_buffers(self.ds.optimizer)

    def step(self) -> float:
        """Reduce, clip, update, advance the schedule, clear gradients. Returns the pre-clip norm."""
        if not self.own_norm:
            self.ds.step()
            norm = self.ds.get_global_grad_norm()
            self.zero_grad()
            return float(norm) if norm is not None else math.nan
        # ZeRO-0 fp32: reduce over data parallel here (DeepSpeed's reduction is switched off),
        # take the norm of the reduced gradients, clip, then let DeepSpeed update
        self.reduce_gradients()
        norm = self.replica_grad_norm()
        if self.grad_clip > 0 and math.isfinite(norm) and norm > self.grad_clip:
            coef = self.grad_clip / (norm + 1e-6)
            for _, p in self.trainable:
                if p.grad is not None:
                    p.grad.mul_(coef)
        self.ds.step()
        self.zero_grad()
        return norm

    def reduce_gradients(self, bucket_elements: int = REDUCE_BUCKET) -> None:
        """Data-parallel gradient reduction as DeepSpeed's ZeRO-0 does it: dense gradients summed
        over the dense data-parallel group (DP x CP), expert gradients over the expert-data-parallel
        group, both divided by the dense data-parallel size; flattened into buckets."""
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        dense_dp = self.state.sizes.dense_dp
        if dense_dp == 1:
            return
        by_group: dict[bool, list[torch.Tensor]] = {True: [], False: []}
        for _, p in self.trainable:
            if p.grad is not None:
                by_group[sharding_of(p).expert].append(p.grad)
        for expert, grads in by_group.items():
            group = self.state.expert_dp_group if expert else self.state.dense_dp_group
            if dist.get_world_size(group) == 1:
                for g in grads:
                    g.div_(dense_dp)
                continue
            bucket: list[torch.Tensor] = []
            for i, g in enumerate(grads):
                bucket.append(g)
                if sum(t.numel() for t in bucket) >= bucket_elements or i == len(grads) - 1:
                    flat = _flatten_dense_tensors(bucket)
                    dist.all_reduce(flat, group=group)
                    flat.div_(dense_dp)
                    for g_, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                        g_.copy_(reduced)
                    bucket = []

    def replica_grad_norm(self) -> float:
        """Global L2 norm of the (already data-parallel-reduced) gradients in `p.grad`, each
        parameter counted once: a copy's squared norm is divided by its number of copies in the
        world (dense: world / TP shards; experts: world / (EP x TP shards)) and one all-reduce sums.
        Summed on the gradients' device: one host read, the norm returned (a `.cpu()` per
        parameter waited for the GPU once per parameter)."""
        import torch.distributed as dist

        sizes = self.state.sizes
        total = torch.zeros((), dtype=torch.float64, device=next(iter(self.model.parameters())).device)
        for _, p in self.trainable:
            if p.grad is None:
                continue
            total += p.grad.detach().double().pow(2).sum() / copies_in_world(p, sizes)
        if sizes.world > 1:
            dist.all_reduce(total)
        return float(total.sqrt())

    def zero_grad(self) -> None:
        """Clear the gradients, those DeepSpeed accumulated into its partition included (after a
        skipped step they would otherwise join the next step's: `deepspeed_compat.drop_accumulated_gradients`)."""
        self.ds.zero_grad()
        deepspeed_compat.drop_accumulated_gradients(self.ds.optimizer)

    def close(self) -> None:
        """End of the stage: remove DeepSpeed's gradient hooks from the parameters. Without it a
        later stage's backward still runs the earlier engines' ZeRO-2/3 reduction hooks on the
        parameters they trained (the warm-up's indexer): their buckets grew every step (~4 MB/step
        on the tiny demo model) and they handled gradients that belong to the new engine."""
        import gc

        self.zero_grad()
        self.ds.destroy()
        self.ds = self.optimizer = self.scheduler = None
        gc.collect()

    def fragments(self) -> list[Fragment]:
        """This rank's ZeRO fragments of the trainable parameters (fp32 master, AdamW moments),
        which checkpoint/sharded_state.py reads and writes as pieces of global tensors, so a
        checkpoint resumes under any layout."""
        return deepspeed_compat.zero_fragments(self.ds.optimizer, self.trainable)
