"""DeepSpeed engine on megatron-core's process groups: the distributed counterpart of
`dsa_train.engine.Engine` (same methods: backward, step, zero_grad, lr).

* ZeRO stage 0/1/2/3 from `parallel.zero_stage`; DeepSpeed's data-parallel group is DP x CP
  (the ranks holding replicas of a dense parameter, `MegatronMPU`), tensor-parallel shards are
  known to it through the same `mpu` (gradient clipping counts each shard once).
* bf16 parameters -> DeepSpeed bf16 with fp32 master weights (ZeRO >= 1).
* Gradient accumulation is driven by the caller (`managed_gradient_accumulation: false`):
  `backward` only accumulates, `step` is the boundary (reduce, clip, update, schedule).
  Losses arrive already scaled for accumulation (see `dsa_train.parallel.step`), so DeepSpeed
  does not divide by the accumulation steps.
* MoE parameter groups: routed-expert parameters (marked `allreduce=False`, `group_name` by
  `dsa_train.parallel.expert.shard_experts`) go into DeepSpeed MoE param groups whose gradients
  are reduced over the expert-data-parallel group (megatron-core's). DeepSpeed learns the groups
  through its MoE layer API (`set_deepspeed_parallelism`, `_deepspeed_moe_marker`), which fills
  its group registry (`register_expert_groups`, the one place that writes DeepSpeed's dicts).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os

import torch

from dsa_train.config import OptimConfig, StageConfig
from dsa_train.engine.schedule import build_scheduler
from dsa_train.engine.trainable import set_trainable
from dsa_train.parallel.groups import MegatronMPU, ParallelState

log = logging.getLogger(__name__)


def _quiet_deepspeed() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)


def register_expert_groups(state: ParallelState, group_name: str) -> None:
    """Make megatron-core's expert groups DeepSpeed's expert groups named `group_name`."""
    import torch.distributed as dist
    from deepspeed.utils import groups as dsg

    dsg._EXPERT_PARALLEL_GROUP[group_name] = state.ep_group
    dsg._EXPERT_PARALLEL_GROUP_RANKS[group_name] = dist.get_process_group_ranks(state.ep_group)
    dsg._EXPERT_DATA_PARALLEL_GROUP[group_name] = state.expert_dp_group
    dsg._EXPERT_DATA_PARALLEL_GROUP_RANKS[group_name] = dist.get_process_group_ranks(state.expert_dp_group)


def param_groups(trainable: list[tuple[str, torch.nn.Parameter]], optim: OptimConfig) -> list[dict]:
    """Matrices decay, vectors do not (as `build_optimizer`); expert parameters in MoE groups."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    decay = [p for _, p in trainable if p.ndim >= 2]
    no_decay = [p for _, p in trainable if p.ndim < 2]
    groups = [
        {"name": "decay", "params": decay, "weight_decay": optim.weight_decay},
        {"name": "no_decay", "params": no_decay, "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if any(getattr(p, "allreduce", True) is False for _, p in trainable):
        groups = split_params_into_different_moe_groups_for_optimizer(groups)
    return groups


def deepspeed_config(zero_stage: int, micro_batch_size: int, dp_size: int, bf16: bool, grad_clip: float,
                     grad_fp32: bool = True) -> dict:
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
        cfg["zero_optimization"].update({"reduce_scatter": True, "overlap_comm": False, "contiguous_gradients": True,
                                         "reduce_bucket_size": REDUCE_BUCKET, "allgather_bucket_size": REDUCE_BUCKET})
    if zero_stage == 3:
        cfg["zero_optimization"].update({"stage3_param_persistence_threshold": 0, "overlap_comm": False})
    if bf16:
        # bf16 parameters, fp32 master weights in the ZeRO optimizer; gradients accumulated over
        # micro-batches and reduced over data parallel in fp32 (`optim.grad_accum_dtype`, default)
        # or in bf16. Only ZeRO-2 gets fp32 here (see DeepSpeedEngine.__init__).
        cfg["bf16"] = {"enabled": True}
        if grad_fp32:
            cfg["data_types"] = {"grad_accum_dtype": "fp32"}
            cfg["communication_data_type"] = "fp32"
    return cfg


def _deepspeed_moe_marker(num_experts: int, state: ParallelState, group_name: str) -> torch.nn.Module:
    """DeepSpeed configures expert parameter groups (ZeRO's expert-data-parallel reduction) when
    the model it initializes contains a `deepspeed.moe.layer.MoE`, and asks each such module for
    its groups through `set_deepspeed_parallelism` (its MoE API). This parameter-free module is
    such a layer (DeepSpeed's __init__ not run: it builds its own experts); it answers with
    megatron-core's expert groups. It is attached to the model only for `deepspeed.initialize`."""
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    class ExpertGroups(DeepSpeedMoE):
        def __init__(self):
            torch.nn.Module.__init__(self)
            self.num_experts = num_experts

        def set_deepspeed_parallelism(self, *args, **kwargs) -> None:
            register_expert_groups(state, group_name)

    return ExpertGroups()


@contextlib.contextmanager
def _expert_groups_visible(model: torch.nn.Module, state: ParallelState, trainable: list):
    """Let DeepSpeed see expert parallelism during initialize when expert parameters train (in a
    stage whose experts are frozen, e.g. the dense warm-up, DeepSpeed must see none: it then
    requires MoE parameter groups). The groups are registered whenever the model has expert
    parameters: DeepSpeed broadcasts every parameter marked `allreduce=False` over its group."""
    names = {getattr(p, "group_name", None) for p in model.parameters() if getattr(p, "allreduce", True) is False}
    for name in names - {None}:
        register_expert_groups(state, name)
    trained = {getattr(p, "group_name", None) for _, p in trainable if getattr(p, "allreduce", True) is False}
    if not trained:
        yield
        return
    (group_name,) = trained
    model.add_module("_deepspeed_expert_groups", _deepspeed_moe_marker(model.config.n_routed_experts, state, group_name))
    try:
        yield
    finally:
        del model._deepspeed_expert_groups


REDUCE_BUCKET = int(5e7)  # elements; `dsa-train plan` counts one such bucket


class DeepSpeedEngine:
    def __init__(
        self,
        model: torch.nn.Module,
        stage: StageConfig,
        optim: OptimConfig,
        state: ParallelState,
        zero_stage: int,
        micro_batch_size: int = 1,
    ):
        _quiet_deepspeed()
        import deepspeed

        self.module = model
        self.state = state
        self.trainable = set_trainable(model, stage.trainable)
        groups = param_groups(self.trainable, optim)
        optimizer = torch.optim.AdamW(groups, lr=stage.lr, betas=(optim.betas[0], optim.betas[1]), eps=optim.eps)
        scheduler = build_scheduler(optimizer, stage)
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
            grad_fp32=grad_fp32,
        )
        self.grad_clip = optim.grad_clip
        self.zero_stage = zero_stage
        with _expert_groups_visible(model, state, self.trainable):
            self.ds, self.optimizer, _, self.scheduler = deepspeed.initialize(
                model=model,
                optimizer=optimizer,
                lr_scheduler=scheduler,
                config=self.ds_config,
                mpu=MegatronMPU(state),
                dist_init_required=False,
            )
        if self.own_norm:
            self.ds.enable_backward_allreduce = False  # `reduce_gradients` does it in `step`
        self.model = self.ds  # forward through DeepSpeed (ZeRO-3 gathers parameters in its hooks)

    @property
    def lr(self) -> float:
        return self.ds.get_lr()[0]

    def backward(self, loss: torch.Tensor) -> None:
        self.ds.backward(loss, scale_wrt_gas=False)

    def capture_gradients(self) -> None:
        """Record this rank's gradient contributions from the next backward passes (tensor hooks
        see them before ZeRO takes them into its buckets); `full_grads` reduces them."""
        self._captured: dict[str, torch.Tensor] = {}
        self._hooks = []
        if self.zero_stage == 3:
            return
        for name, p in self.trainable:
            def hook(grad, name=name):
                prev = self._captured.get(name)
                self._captured[name] = grad.detach().float().clone() if prev is None else prev + grad.float()
            self._hooks.append(p.register_hook(hook))

    def full_grads(self) -> dict[str, torch.Tensor]:
        """name -> fp32 gradient of each trainable parameter (this rank's shard for TP/EP
        parameters) averaged over data parallel, as the optimizer will see it before clipping.
        ZeRO-3: DeepSpeed's reduced gradients; stages 0-2: the contributions recorded since
        `capture_gradients`, reduced here the way DeepSpeed reduces them. Call before `step`."""
        import torch.distributed as dist
        from deepspeed.utils import safe_get_full_grad

        if self.zero_stage == 3:
            return {name: safe_get_full_grad(p).detach().float().clone() for name, p in self.trainable}
        for h in self._hooks:
            h.remove()
        out = {}
        for name, p in self.trainable:
            g = self._captured.get(name, torch.zeros(p.shape, dtype=torch.float32, device=p.device))
            group = self.state.expert_dp_group if getattr(p, "allreduce", True) is False else self.state.dense_dp_group
            dist.all_reduce(g, group=group)
            out[name] = g / self.state.sizes.dense_dp
        return out

    def gradient_tensors(self) -> list[torch.Tensor]:
        """The gradients this rank holds between backward and step, where DeepSpeed keeps them:
        ZeRO-2 reduces each bucket during backward and accumulates this rank's partition over the
        step's backwards (`all_grad_tensors`, caller-driven accumulation; `grads_in_partition` /
        `averaged_gradients` at the boundary; `p.grad` is released), ZeRO-3 into its flat
        partition buffer; bf16 ZeRO-1 with fp32 accumulation (DeepSpeed's BF16_Optimizer) into fp32 flat
        buffers; otherwise ZeRO-0/1 keep them in `p.grad` until `step` reduces them."""
        opt = self.ds.optimizer
        grads = [p.grad for _, p in self.trainable if p.grad is not None]
        for name in ("grads_in_partition", "grad_partitions_flat_buffer"):
            buffer = getattr(opt, name, None)
            if isinstance(buffer, torch.Tensor):
                grads.append(buffer)
        grads.extend(g for g in getattr(opt, "fp32_groups_gradients_flat", None) or [] if isinstance(g, torch.Tensor))
        for name in ("all_grad_tensors", "averaged_gradients"):  # {param group: [tensor]}
            for group in (getattr(opt, name, None) or {}).values():
                grads.extend(g for g in (group or []) if isinstance(g, torch.Tensor))
        return grads

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
                by_group[getattr(p, "allreduce", True) is False].append(p.grad)
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
        world (dense: world / TP shards; experts: world / (EP x TP shards)) and one all-reduce sums."""
        import torch.distributed as dist

        sizes = self.state.sizes
        total = torch.zeros((), dtype=torch.float64)
        for _, p in self.trainable:
            if p.grad is None:
                continue
            copies = sizes.world
            if getattr(p, "dsa_shard", None) is not None:
                copies //= sizes.tensor
            if getattr(p, "allreduce", True) is False:
                copies //= sizes.expert
            total += p.grad.detach().double().pow(2).sum().cpu() / copies
        total = total.to(next(iter(self.module.parameters())).device)
        if sizes.world > 1:
            dist.all_reduce(total)
        return float(total.sqrt())

    def zero_grad(self) -> None:
        self.ds.zero_grad()

    def close(self) -> None:
        """End of the stage: remove DeepSpeed's gradient hooks from the parameters. Without it a
        later stage's backward still runs the earlier engines' ZeRO-2/3 reduction hooks on the
        parameters they trained (the warm-up's indexer): their buckets grew every step (~4 MB/step
        on the tiny demo model) and they handled gradients that belong to the new engine."""
        import gc

        self.zero_grad()
        self.ds.destroy()
        self.ds = self.model = self.optimizer = self.scheduler = None
        gc.collect()

    # Checkpointed state: engine/sharded_state.py reads and writes this rank's ZeRO fragments of
    # each parameter (`param._hp_mapping`: fp32 master, AdamW moments) as pieces of global
    # tensors, so a checkpoint resumes under any layout. The masters always come from the
    # checkpoint, never from the bf16 weights (that would drop every update below bf16 resolution).
