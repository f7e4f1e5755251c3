"""Process groups for distributed training, from megatron-core's `parallel_state`.

Layout (megatron order `tp-cp-ep-dp`, no pipeline parallelism):
    world = tensor_parallel * context_parallel * data_parallel
    expert_parallel divides context_parallel * data_parallel (expert layers see CP*DP ranks as data)

Dense parameters are replicated over DP x CP (their gradients are averaged there: that group is
what DeepSpeed sees as "data parallel"); tensor-parallel shards live in the TP group; routed
experts are sharded over the EP group and replicated over the expert-data-parallel group.
Backends: with CUDA the world is NCCL only, initialized with this rank's `device_id` (the world
communicator is created eagerly, so a broken fabric fails at start-up, and megatron-core's groups,
which inherit the world's backend, are NCCL only: no gloo mesh per TP/CP/DP/EP group). CPU
collectives (checkpoint agreement, DCP planning, object collectives over the whole job) go through
one gloo group over the world, `cpu_group()`, created on first use. Without CUDA (or with
`DSA_TRAIN_BACKEND=gloo`) everything is gloo, as `cpu_group()` is. With `DSA_STRICT_DEVICES=1`
every collective checks that its tensors are on the compute device (`dsa_train.parallel.strict_devices`).
What each costs at 1024 ranks: docs/distributed.md, "Process groups at scale".
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from dsa_train.config import ConfigError, ParallelConfig, ParallelSizes, resolve_sizes
from dsa_train.errors import DSATrainError
from dsa_train.parallel import strict_devices


def check_model_divisibility(sizes: ParallelSizes, model_config) -> None:
    """Heads and experts must split evenly over TP and EP ranks."""
    if model_config.num_attention_heads % sizes.tensor:
        raise ConfigError(
            f"parallel.tensor_parallel={sizes.tensor} does not divide num_attention_heads="
            f"{model_config.num_attention_heads}"
        )
    for name in ("intermediate_size", "moe_intermediate_size"):
        if getattr(model_config, name) % sizes.tensor:
            raise ConfigError(f"parallel.tensor_parallel={sizes.tensor} does not divide {name}={getattr(model_config, name)}")
    if model_config.n_routed_experts % sizes.expert:
        raise ConfigError(
            f"parallel.expert_parallel={sizes.expert} does not divide n_routed_experts={model_config.n_routed_experts}"
        )


# The world's backend before issue 19: every megatron-core group inherited gloo as well, an eager
# gloo mesh (a TCP connection per peer) per group. Kept to count what it opened (tests, docs).
MIXED_BACKEND = "cpu:gloo,cuda:nccl"
CPU_GROUP_DESC = "dsa_cpu_collectives"


def uses_nccl() -> bool:
    """NCCL for the world when this process has CUDA (unless DSA_TRAIN_BACKEND=gloo)."""
    return torch.cuda.is_available() and os.environ.get("DSA_TRAIN_BACKEND") != "gloo"


def world_backend(nccl: bool) -> str:
    """The world's (and so every megatron-core group's) backend: NCCL only on GPUs, gloo without."""
    return "nccl" if nccl else "gloo"


def process_group_args(nccl: bool, local_rank: int) -> dict:
    """`init_process_group` arguments: on GPUs the backend and this rank's device (`device_id`:
    eager NCCL init; new groups are then split from the world communicator)."""
    if nccl:
        return {"backend": world_backend(True), "device_id": torch.device("cuda", local_rank)}
    return {"backend": world_backend(False)}


class MoreRanksThanGPUs(DSATrainError, RuntimeError):
    """A node runs more ranks than it shows GPUs (one GPU per rank)."""


def check_local_gpu(local_rank: int) -> None:
    """The GPU of this node's rank `local_rank` exists: else one line naming the counts and the fix
    (CUDA's own "invalid device ordinal" is a traceback, and torchrun would restart into it again)."""
    gpus = torch.cuda.device_count()
    if local_rank >= gpus:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        shown = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        raise MoreRanksThanGPUs(
            f"LOCAL_RANK={local_rank}: this node shows {gpus} GPU(s){shown}, one per rank",
            fix=f"start at most {gpus} processes per node (dsa-train launch torchrun --nproc-per-node {gpus}) "
                "or make more GPUs visible")


def init_distributed(timeout_minutes: int = 30) -> None:
    """torch.distributed from the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR, ...)."""
    if dist.is_initialized():
        return
    nccl = uses_nccl()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if nccl:
        check_local_gpu(local_rank)
        torch.cuda.set_device(local_rank)
    dist.init_process_group(**process_group_args(nccl, local_rank), timeout=datetime.timedelta(minutes=timeout_minutes))


_CPU_GROUP = None  # (the world it belongs to, the group)


def cpu_group():
    """The gloo group over the world for CPU collectives (checkpoint agreement and DCP planning,
    object gathers), created on first use: every rank must reach its first use at the same point
    (as with any new group), which the checkpoint code does. Its own group on a gloo world too,
    so an async save's background thread never shares a group with the training collectives. Under
    the `fake` backend (`dsa-train plan --trace`, tests) it is a fake group: a fake world has no peers."""
    global _CPU_GROUP
    world = dist.group.WORLD
    if _CPU_GROUP is None or _CPU_GROUP[0] is not world:  # (a new world: a new group)
        backend = "fake" if dist.get_backend() == "fake" else "gloo"
        _CPU_GROUP = (world, dist.new_group(backend=backend, group_desc=CPU_GROUP_DESC))
    return _CPU_GROUP[1]


class ParallelState:
    """Sizes, this rank's coordinates and the process groups (megatron-core's)."""

    def __init__(self, sizes: ParallelSizes):
        from megatron.core import parallel_state as ps

        self.sizes = sizes
        self.ps = ps
        self.device = strict_devices.compute_device()  # where collective tensors live (NCCL: CUDA tensors only)
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.cp_group = ps.get_context_parallel_group()
        self.dp_group = ps.get_data_parallel_group()  # without CP
        self.dense_dp_group = ps.get_data_parallel_group(with_context_parallel=True)
        self.ep_group = ps.get_expert_model_parallel_group()
        self.expert_dp_group = ps.get_expert_data_parallel_group()
        self.rank = dist.get_rank()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.cp_rank = ps.get_context_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.ep_rank = ps.get_expert_model_parallel_rank()

    def describe(self) -> str:
        s = self.sizes
        return (
            f"rank {self.rank}/{s.world}: tp {self.tp_rank}/{s.tensor} cp {self.cp_rank}/{s.context} "
            f"dp {self.dp_rank}/{s.data} ep {self.ep_rank}/{s.expert}"
        )


def init_parallel(parallel: ParallelConfig) -> ParallelState:
    """Initialize torch.distributed (if needed) and megatron-core's groups for the recipe's layout."""
    from megatron.core import parallel_state as ps

    init_distributed()
    strict_devices.install()  # only with DSA_STRICT_DEVICES=1
    sizes = resolve_sizes(parallel, dist.get_world_size())
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=sizes.tensor,
        context_parallel_size=sizes.context,
        expert_model_parallel_size=sizes.expert,
        create_gloo_process_groups=False,
    )
    return ParallelState(sizes)


def destroy_parallel() -> None:
    from megatron.core import parallel_state as ps

    global _CPU_GROUP
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    _CPU_GROUP = None
    strict_devices.uninstall()
    if dist.is_initialized():
        dist.destroy_process_group()


class MegatronMPU:
    """The `mpu` object DeepSpeed expects, backed by megatron-core's groups. DeepSpeed's "data
    parallel" is the group over which dense gradients are averaged: DP x CP."""

    def __init__(self, state: ParallelState):
        self.state = state
        ps = state.ps
        self.get_model_parallel_rank = ps.get_tensor_model_parallel_rank
        self.get_model_parallel_world_size = ps.get_tensor_model_parallel_world_size
        self.get_model_parallel_group = ps.get_tensor_model_parallel_group
        self.get_tensor_model_parallel_rank = ps.get_tensor_model_parallel_rank
        self.get_tensor_model_parallel_world_size = ps.get_tensor_model_parallel_world_size
        self.get_tensor_model_parallel_group = ps.get_tensor_model_parallel_group
        self.get_pipeline_model_parallel_rank = lambda: 0
        self.get_pipeline_model_parallel_world_size = lambda: 1

    def get_data_parallel_group(self):
        return self.state.dense_dp_group

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self.state.dense_dp_group)

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self.state.dense_dp_group)
