"""`parallelize_model(model, state)`: where tensor, expert and context parallelism and activation
recompute are applied to a single-process `DSAForCausalLM`, in place, keeping Hugging Face
parameter names.

The model is built whole (same seed on every rank, or loaded) and each rank keeps its slices:
TP shards of MLA heads and MLPs (megatron-core Column/RowParallelLinear), its EP share of the
routed experts, and its context-parallel share of every sequence. Each sharded parameter records where it sits in
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


def check_recompute(mode: str) -> None:
    if mode not in RECOMPUTE:
        from dsa_train.config import ConfigError

        raise ConfigError(f"parallel.recompute={mode!r}: one of {', '.join(RECOMPUTE)}")


def parallelize_model(
    model: torch.nn.Module, state: ParallelState, recompute: str = "none", grouped_experts: bool = True
) -> torch.nn.Module:
    """Apply the layout to a plain `DSAForCausalLM`, in place and in this order (the one place
    where parallelism meets the model; the engine, DeepSpeed, comes after, in the trainer):
      1. tensor parallel: MLA heads and dense MLPs / shared experts split over TP
         (megatron-core Column/RowParallelLinear; `MLA.heads` = `TensorParallelHeads`);
      2. expert parallel: each MoE's routed experts sharded over EP, its token dispatcher an
         all-to-all over the EP group (`MoE.dispatcher`);
      3. context parallel: `model.context_parallel`, which gives attention its per-sequence handle;
      4. activation recompute: `DecoderLayer.recompute` of every main layer.
    The model's forwards are the single-process ones throughout."""
    sizes = state.sizes
    from dsa_train.parallel.groups import check_model_divisibility

    check_model_divisibility(sizes, model.config)
    check_recompute(recompute)
    if sizes.tensor > 1:
        from dsa_train.parallel.tensor import shard_tensor_parallel

        shard_tensor_parallel(model, state)
    if sizes.world > 1:
        from dsa_train.parallel.expert import shard_experts

        shard_experts(model, state, grouped=grouped_experts)
    if sizes.context > 1:
        from dsa_train.parallel.context import ContextParallel

        model.context_parallel = ContextParallel(state)
    for layer in model.main_layers():
        layer.recompute = recompute
    return model
