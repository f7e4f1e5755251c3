"""`parallelize_model(model, state)`: where tensor, expert and context parallelism and activation
recompute are applied to a single-process `DSAForCausalLM`, in place, keeping Hugging Face
parameter names.

The model is built whole (same seed on every rank, or loaded) and each rank keeps its slices:
TP shards of MLA heads and MLPs (megatron-core Column/RowParallelLinear), its EP share of the
routed experts, and its context-parallel share of every sequence. Each sharded parameter carries a
`dsa_train.sharding.Sharding` record of where it sits in the full tensor (read by
checkpoints, the full-state gather, the gradient norm and DeepSpeed's MoE groups).
"""

from __future__ import annotations

import torch

from dsa_train.config import ConfigError
from dsa_train.parallel.context import ContextParallel
from dsa_train.parallel.expert import shard_experts
from dsa_train.parallel.groups import ParallelState, check_model_divisibility
from dsa_train.sharding import mark_parallelized, sharding_of
from dsa_train.parallel.tensor import shard_tensor_parallel


def full_tensor_slice(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """The part of the full (single-process) tensor `full` that the shard `param` holds."""
    return sharding_of(param).slice_of(full)


RECOMPUTE = ("none", "attention", "moe", "full")


def check_recompute(mode: str) -> None:
    if mode not in RECOMPUTE:
        raise ConfigError(f"parallel.recompute={mode!r}: one of {', '.join(RECOMPUTE)}")


def parallelize_model(
    model: torch.nn.Module, state: ParallelState, recompute: str = "none", grouped_experts: bool = True
) -> torch.nn.Module:
    """Apply the layout to a plain `DSAForCausalLM`, in place and in this order (the one place
    where parallelism meets the model; the engine, DeepSpeed, comes after: `Layout.make_engine`):
      1. tensor parallel: MLA heads and dense MLPs / shared experts split over TP
         (megatron-core Column/RowParallelLinear; `MLA.heads` = `TensorParallelHeads`; those MLPs
         run their linears, not the row-chunked path: `MLP.row_chunked`);
      2. expert parallel: each MoE's routed experts sharded over EP, its token dispatcher an
         all-to-all over the EP group, grouped GEMMs or a loop (`MoE.set_layout`; with one rank
         too: the grouped GEMMs replace the loop over experts);
      3. context parallel: `model.context_parallel`, which gives attention its per-sequence handle;
      4. activation recompute: `DecoderLayer.recompute` of every main layer.
    Sharded parameters get their `Sharding` record, and the model is recorded as laid out for
    `state` (`sharding.parallelized_state`). The model's forwards are the single-process ones."""
    sizes = state.sizes
    check_model_divisibility(sizes, model.config)
    check_recompute(recompute)
    if sizes.tensor > 1:
        shard_tensor_parallel(model, state)
    # every layout, one rank included: the experts as grouped GEMMs (`parallel.grouped_experts`),
    # the router loads summed over replicas, with EP > 1 the all-to-all dispatcher
    shard_experts(model, state, grouped=grouped_experts)
    if sizes.context > 1:
        model.context_parallel = ContextParallel(state)
    for layer in model.main_layers():
        layer.recompute = recompute
    mark_parallelized(model, state)
    return model
