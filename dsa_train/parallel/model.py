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


RECOMPUTE = ("none", "attention", "moe", "full")


def _checkpointed(forward):
    from torch.utils.checkpoint import checkpoint

    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def enable_recompute(model: torch.nn.Module, mode: str) -> None:
    """Selective activation checkpointing: recompute attention blocks, MoE blocks, or whole
    decoder layers in the backward (non-reentrant torch checkpoint; collectives inside run again
    in the same order on every rank). The MoE expert loads of a recomputed block are counted
    twice, which leaves the sign-based bias update unchanged."""
    if mode not in RECOMPUTE:
        from dsa_train.config import ConfigError

        raise ConfigError(f"parallel.recompute={mode!r}: one of {', '.join(RECOMPUTE)}")
    if mode == "none":
        return
    from dsa_train.model.moe import MoE

    for layer in model.main_layers():
        if mode == "full":
            layer.forward = _checkpointed(layer.forward)
        elif mode == "attention":
            layer.self_attn.forward = _checkpointed(layer.self_attn.forward)
        elif mode == "moe" and isinstance(layer.mlp, MoE):
            layer.mlp.forward = _checkpointed(layer.mlp.forward)


def parallelize_model(
    model: torch.nn.Module, state: ParallelState, recompute: str = "none", grouped_experts: bool = True
) -> torch.nn.Module:
    sizes = state.sizes
    from dsa_train.parallel.groups import check_model_divisibility

    check_model_divisibility(sizes, model.config)
    if sizes.world > 1:
        from dsa_train.parallel.expert import shard_experts

        shard_experts(model, state, grouped=grouped_experts)
    if sizes.tensor > 1:
        from dsa_train.parallel.tensor import shard_tensor_parallel

        shard_tensor_parallel(model, state)
    if sizes.context > 1:
        from dsa_train.parallel.context import enable_context_parallel

        enable_context_parallel(model, state)
    enable_recompute(model, recompute)
    return model
