"""Process groups for distributed training, from megatron-core's `parallel_state`.

Layout (megatron order `tp-cp-ep-dp`, no pipeline parallelism):
    world = tensor_parallel * context_parallel * data_parallel
    expert_parallel divides context_parallel * data_parallel (expert layers see CP*DP ranks as data)

Dense parameters are replicated over DP x CP (their gradients are averaged there: that group is
what DeepSpeed sees as "data parallel"); tensor-parallel shards live in the TP group; routed
experts are sharded over the EP group and replicated over the expert-data-parallel group.
Backend: with CUDA `cpu:gloo,cuda:nccl` (device collectives on NCCL; CPU tensors made on purpose
for bookkeeping, `device="cpu"`, on gloo: megatron-core's groups inherit both), gloo without it.
`DSA_TRAIN_BACKEND=gloo` forces gloo. With `DSA_STRICT_DEVICES=1` every collective checks that its
tensors are on the compute device (`dsa_train.parallel.strict_devices`).
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from dsa_train.config import ConfigError, ParallelConfig, ParallelSizes, resolve_sizes
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


CUDA_BACKEND = "cpu:gloo,cuda:nccl"


def default_backend() -> str:
    """Both backends with CUDA (NCCL rejects CPU tensors; gloo takes the CPU-side bookkeeping)."""
    return CUDA_BACKEND if torch.cuda.is_available() and os.environ.get("DSA_TRAIN_BACKEND") != "gloo" else "gloo"


def init_distributed(timeout_minutes: int = 30) -> None:
    """torch.distributed from the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR, ...)."""
    if dist.is_initialized():
        return
    backend = default_backend()
    if "nccl" in backend:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=timeout_minutes))


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

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
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
