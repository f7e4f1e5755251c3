"""`parallelize_model(model, state)`: swap a single-process `DSAForCausalLM`'s modules for their
tensor-, expert- and context-parallel versions, in place, keeping Hugging Face parameter names.

The model is built whole (same seed on every rank, or loaded) and each rank keeps its slices:
TP shards of MLA heads and MLPs (megatron-core Column/RowParallelLinear), its EP share of the
routed experts, and a context-parallel forward. Each sharded parameter records where it sits in
the full tensor (`dsa_shard = (dim, start, stop)`), used by checkpoint gathering and tests.
"""

from __future__ import annotations

import torch

from dsa_train.parallel.groups import ParallelState


def full_tensor_slice(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """The part of the full (single-process) tensor `full` that the shard `param` holds."""
    shard = getattr(param, "dsa_shard", None)
    if shard is None:
        return full
    dim, start, stop = shard
    return full.narrow(dim, start, stop - start)


def parallelize_model(model: torch.nn.Module, state: ParallelState) -> torch.nn.Module:
    sizes = state.sizes
    from dsa_train.parallel.groups import check_model_divisibility

    check_model_divisibility(sizes, model.config)
    if sizes.world > 1:
        from dsa_train.parallel.expert import shard_experts

        shard_experts(model, state)
    if sizes.tensor > 1:
        from dsa_train.parallel.tensor import shard_tensor_parallel

        shard_tensor_parallel(model, state)
    if sizes.context > 1:
        from dsa_train.parallel.context import enable_context_parallel

        enable_context_parallel(model, state)
    return model
