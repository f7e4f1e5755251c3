"""The layout of a run behind one object: how many ranks, how the model is split over them, and
everything that follows from it for the trainer.

    layout, cfg = init_layout(cfg, distributed)

`Layout` is one process: every question has the trivial answer (no collectives, the
single-process `Engine`, whole tensors). `DistributedLayout` is N ranks on megatron-core's groups
(`dsa_train.parallel.groups`): the model parallelized (`parallelize_model`), the DeepSpeed engine,
the step's numbers combined over ranks (`parallel_reduction`), checkpoint pieces placed in the
global tensors (`dsa_train.checkpoint.sharded_state`). The export streams from the checkpoint
(`dsa_train.checkpoint.streamed_export`): the layout gathers the model only for the in-training
evaluation of small models (`full_state_dict`).
The trainer asks the layout and never tests which one it has.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging

import torch
import torch.distributed as dist

from dsa_train.config import ConfigError, TrainConfig, WandbMode
from dsa_train.config.validate import check_global_batches
from dsa_train.stage import Stage
from dsa_train.checkpoint.sharded_state import GlobalPieces, ReplicaCoordinates, model_pieces, optimizer_pieces
from dsa_train.training_engine import TrainingEngine
from dsa_train.parallel import deepspeed_compat
from dsa_train.parallel.groups import ParallelState, cpu_group, init_parallel
from dsa_train.parallel.expert import use_grouped_experts
from dsa_train.parallel.model import parallelize_model
from dsa_train.sharding import parallelized_state, sharding_of
from dsa_train.parallel.reduction import parallel_reduction

log = logging.getLogger(__name__)


class Layout:
    """One process: rank 0 of 1, no collectives."""

    distributed = False
    rank, world_size, dp_rank, dp_size, tp_size = 0, 1, 0, 1, 1
    reduction = None  # how a step's numbers combine over ranks (`dsa_train.loss.Reduction`)
    checkpoint_group = None  # the process group DCP plans checkpoints over
    parallel_state: ParallelState | None = None

    def barrier(self) -> None:
        """Wait for every rank (nothing to wait for here)."""

    def any_rank(self, flag: bool | torch.Tensor, device) -> bool:
        """True when `flag` (a bool, or a 0-dim tensor on the device: read once here) is true on any rank."""
        return bool(flag)

    def all_gather_object(self, obj) -> list:
        """[every rank's `obj`] in rank order, over the checkpoint group."""
        return [obj]

    def prepare_model(self, model: torch.nn.Module, cfg: TrainConfig) -> torch.nn.Module:
        """The model laid out for this rank (here: as built, its routed experts as grouped GEMMs
        with `parallel.grouped_experts`, as in every layout: `use_grouped_experts`)."""
        use_grouped_experts(model, cfg.parallel.grouped_experts)
        return model

    def gathered(self, model: torch.nn.Module):
        """A context in which every parameter of `model` holds its values (ZeRO-3 partitions them)."""
        return contextlib.nullcontext()

    replicas: ReplicaCoordinates | None = None  # which holder of a replicated piece writes it

    def model_pieces(self, model: torch.nn.Module, to_write: bool = False) -> dict[str, GlobalPieces]:
        """model/<name> -> this rank's pieces of every model tensor, placed in the global tensor
        (`to_write`: only those this rank writes, one holder per replica)."""
        return model_pieces(model, self.tp_size, self.replicas if to_write else None)

    def optimizer_pieces(self, engine: TrainingEngine, create: bool = False, to_write: bool = False) -> dict[str, GlobalPieces]:
        """optim/<kind>/<name> -> this rank's fragments of the optimizer state (`create`: zeros
        where the optimizer has no state yet, to load into; `to_write`: as model_pieces)."""
        writer = None
        if to_write and self.replicas is not None:
            # DeepSpeed partitions the optimizer state unless it steps the parameters themselves
            # (fp32 ZeRO-0); bf16 ZeRO-0 (its BF16 optimizer) partitions over DP x CP as ZeRO-1
            partitioned = deepspeed_compat.optimizer_kind(engine.optimizer) != "torch"
            writer = dataclasses.replace(self.replicas, zero_stage=max(self.replicas.zero_stage, int(partitioned)))
        return optimizer_pieces(engine, self.tp_size, create=create, writer=writer)

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The single-process state dict of `model`, on every rank."""
        return dict(model.state_dict())


class DistributedLayout(Layout):
    """N ranks (torchrun / Slurm): megatron-core's process groups for `cfg.parallel`."""

    distributed = True

    def __init__(self, state: ParallelState, zero_stage: int, micro_batch_size: int):
        self.parallel_state = state
        self.zero_stage = zero_stage
        self.micro_batch_size = micro_batch_size
        self.reduction = parallel_reduction(state)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.dp_rank, self.dp_size = state.dp_rank, state.sizes.data
        self.tp_size = state.sizes.tensor
        self.replicas = replica_coordinates(state, zero_stage)

    @property
    def checkpoint_group(self):
        """DCP's planning and the checkpoint agreement run on the one gloo group (`groups.cpu_group`:
        CPU objects on an NCCL world; created at the first checkpoint, not at start-up)."""
        return cpu_group()

    def barrier(self) -> None:
        dist.barrier()

    def any_rank(self, flag: bool | torch.Tensor, device) -> bool:
        if isinstance(flag, torch.Tensor):  # a device flag: combined, then the one host read
            t = flag.detach().reshape(1).to(device=device, dtype=torch.float32)
        else:
            t = torch.tensor([1.0 if flag else 0.0], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def all_gather_object(self, obj) -> list:
        every = [None] * self.world_size
        dist.all_gather_object(every, obj, group=self.checkpoint_group)
        return every

    def prepare_model(self, model: torch.nn.Module, cfg: TrainConfig) -> torch.nn.Module:
        """Parallelize the whole model built on every rank (a model built parallel by the
        meta-device start-up stays as it is); rank 0 logs every rank's layout."""
        if parallelized_state(model) is None:
            model = parallelize_model(model, self.parallel_state, recompute=cfg.parallel.recompute,
                                      grouped_experts=cfg.parallel.grouped_experts)
        layouts = [None] * self.world_size
        dist.all_gather_object(layouts, self.parallel_state.describe())
        if self.rank == 0:
            for line in layouts:
                log.info("%s", line)
        return model

    def gathered(self, model: torch.nn.Module):
        if self.zero_stage == 3:
            import deepspeed

            return deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None)
        return contextlib.nullcontext()

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Gathered to every rank: TP shards concatenated, EP experts collected. Only for models
        that fit one device (the recipe's in-training `eval`, `dsa_train.eval.in_training`); the
        export never gathers (it streams from the checkpoint)."""
        st = self.parallel_state
        out: dict[str, torch.Tensor] = {}
        experts: dict[str, torch.Tensor] = {}  # this rank's routed experts (EP), global names
        with self.gathered(model):
            for name, p in model.state_dict(keep_vars=True).items():
                if p is None:
                    continue
                t = p.detach().clone()
                record = sharding_of(p)
                if record.expert:
                    experts[name] = t
                    continue
                if record.tensor_parallel:
                    parts = [torch.empty_like(t) for _ in range(st.sizes.tensor)]
                    dist.all_gather(parts, t.contiguous(), group=st.tp_group)
                    t = torch.cat(parts, dim=record.tp_dim)
                out[name] = t
        if st.sizes.expert > 1:
            gathered = [None] * st.sizes.expert
            dist.all_gather_object(gathered, experts, group=st.ep_group)
            for part in gathered:
                out.update(part)
        else:
            out.update(experts)
        return out


def replica_coordinates(state: ParallelState, zero_stage: int) -> ReplicaCoordinates:
    """This rank's coordinates in megatron-core's dense and expert grids (sharded_state.replica_slot)."""
    ps, sizes = state.ps, state.sizes
    return ReplicaCoordinates(
        rank=state.rank, world=sizes.world, tp_rank=state.tp_rank, tp_size=sizes.tensor,
        dense_dp_rank=ps.get_data_parallel_rank(with_context_parallel=True),
        dense_dp_size=ps.get_data_parallel_world_size(with_context_parallel=True),
        etp_rank=ps.get_expert_tensor_parallel_rank(), etp_size=ps.get_expert_tensor_parallel_world_size(),
        edp_rank=ps.get_expert_data_parallel_rank(), edp_size=ps.get_expert_data_parallel_world_size(),
        zero_stage=zero_stage)


def check_single_process(cfg: TrainConfig) -> None:
    p = cfg.parallel
    sizes = {
        "parallel.tensor_parallel": p.tensor_parallel,
        "parallel.context_parallel": p.context_parallel,
        "parallel.expert_parallel": p.expert_parallel,
        "parallel.data_parallel": max(p.data_parallel, 1),
    }
    for key, size in sizes.items():
        if size != 1:
            raise ConfigError(f"{key}={size}: the single-process trainer runs one rank; set it to 1")


def init_layout(cfg: TrainConfig, distributed: bool) -> tuple[Layout, TrainConfig]:
    """The layout of the recipe and the config this rank runs with. One process: checks that the
    recipe asks for one rank. N ranks: torch.distributed and megatron-core's groups, the
    checkpoint group, the batch divisibility check, this rank's CUDA device; ranks other than 0
    get a copy of `cfg` without W&B and without progress bar (rank 0 logs)."""
    if not distributed:
        check_single_process(cfg)
        return Layout(), cfg
    state = init_parallel(cfg.parallel)
    layout = DistributedLayout(state, cfg.parallel.zero_stage, cfg.data.micro_batch_size)
    check_global_batches(cfg, state.sizes.data)
    if cfg.device.value == "cuda" or (cfg.device.value == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(torch.cuda.current_device())
    if layout.rank != 0:
        cfg = copy.deepcopy(cfg)
        cfg.logging.wandb_mode = WandbMode.disabled
        cfg.logging.progress_bar = False
    return layout, cfg
