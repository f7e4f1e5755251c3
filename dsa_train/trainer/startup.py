"""Meta-device start-up: each rank builds the model without memory, applies the parallel layout,
then materializes and loads only what it holds, straight from the Hugging Face checkpoint.

    model = load_parallel_pretrained(path, state, dtype, device)

1. `empty_model(config)`: every parameter on the meta device (buffers -- RoPE tables, the
   Hadamard matrix, router biases -- are small and real).
2. `parallelize_model` on that model, under `torch.device("meta")`: the TP layers and EP
   dispatchers replace their modules as usual, their parameters stay on the meta device.
3. Materialize in place: each parameter this rank holds gets an empty tensor of its shard's shape
   and final dtype on `device` (`param.data = ...`: the Parameter object, its attributes -- its
   `Sharding` record, megatron's TP marks -- and its gradient hooks stay).
4. Stream the checkpoint (`CheckpointPlan.tensors`): `param_filter` passes only the names this
   rank holds -- decided from the index before any byte is read, so a rank opens only the shard
   files that hold its tensors and never reads other ranks' experts -- and `shard_fn` narrows each
   full tensor to this rank's TP slice (its `Sharding` record) as it arrives. FP8 weights are dequantized
   tensor by tensor. Peak: the rank's share plus one full tensor in flight.
5. Fresh indexers (a dense V3 / V3.1 checkpoint has none): `fresh_indexer_tensor` gives each
   tensor a value that depends only on its name, so every rank holding it (any layout) and the
   single-process load agree.
"""

from __future__ import annotations

import logging
import os

import torch

from dsa_train.checkpoint.errors import CheckpointError
from dsa_train.checkpoint.loader import fresh_indexer_tensor, open_checkpoint
from dsa_train.checkpoint.skeleton import empty_model, target_dtype
from dsa_train.model.dtypes import apply as apply_dtype_policy
from dsa_train.parallel.groups import ParallelState
from dsa_train.parallel.model import full_tensor_slice, parallelize_model

log = logging.getLogger(__name__)


def held_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{Hugging Face name: parameter or persistent buffer} this rank holds (tied ones once)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen.add(id(p))
            out[name] = p
    for name, b in model.state_dict(keep_vars=True).items():  # persistent buffers (router biases)
        if isinstance(b, torch.Tensor) and id(b) not in seen:  # (megatron's `_extra_state` is not one)
            seen.add(id(b))
            out.setdefault(name, b)
    return out


@torch.no_grad()
def materialize(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Give every meta parameter and buffer real (uninitialized) storage on `device`, in place.
    Parameters get their loaded dtype (`target_dtype`: fp32 for the indexer's weights_proj / k_norm),
    buffers created by the parallel wrappers on the meta device (expert-load counters) zeros."""
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    replaced: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for key, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) in replaced:  # a tied parameter already given a new object
                module._parameters[key] = replaced[id(p)]
            elif p.is_meta:
                data = torch.empty(p.shape, dtype=target_dtype(names[id(p)], dtype), device=device)
                if _is_fake(data):  # `dsa-train plan --trace`: fake tensors cannot be swapped in
                    replaced[id(p)] = module._parameters[key] = _replacement(p, data)
                else:
                    _swap_in(p, data)
        for key, b in module._buffers.items():
            if b is not None and b.is_meta:
                module._buffers[key] = torch.zeros(b.shape, dtype=b.dtype, device=device)


def _swap_in(param: torch.nn.Parameter, data: torch.Tensor) -> None:
    """Give the meta parameter `param` the storage of `data`, keeping the Parameter object: its
    attributes (its `Sharding` record, megatron's TP marks) and its gradient hooks (TP averaging of
    replicated parameters) stay. (`param.data = data` refuses meta -> real; `swap_tensors` moves
    the attributes and drops the autograd hooks, so both are put back.)"""
    hooks = list((param._backward_hooks or {}).values())
    real = torch.nn.Parameter(data, requires_grad=param.requires_grad)
    torch.utils.swap_tensors(param, real)
    param.__dict__.update(real.__dict__)  # `real` now holds param's old attributes
    param._backward_hooks = None
    for hook in hooks:
        param.register_hook(hook)


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _replacement(param: torch.nn.Parameter, data: torch.Tensor) -> torch.nn.Parameter:
    """A new Parameter holding `data` with `param`'s attributes and gradient hooks."""
    new = torch.nn.Parameter(data, requires_grad=param.requires_grad)
    new.__dict__.update(param.__dict__)
    new._backward_hooks = None
    for hook in (param._backward_hooks or {}).values():
        new.register_hook(hook)
    return new


def load_parallel_pretrained(
    path: str | os.PathLike,
    state: ParallelState,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    recompute: str = "none",
    grouped_experts: bool = True,
) -> torch.nn.Module:
    """This rank's part of the model of a Hugging Face directory, parallelized (`parallelize_model`,
    which records it: the layout does not parallelize it again) and loaded; never the whole
    model. Raises CheckpointError if the checkpoint does not fit."""
    device = torch.device(device)
    plan = open_checkpoint(path)
    model = empty_model(plan.config)
    if plan.match.tied_lm_head or plan.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    full_shapes = {name: tuple(t.shape) for name, t in held_tensors(model).items()}
    with torch.device("meta"):
        parallelize_model(model, state, recompute=recompute, grouped_experts=grouped_experts)
    materialize(model, device, dtype)

    held = held_tensors(model)
    loaded: set[str] = set()

    def slice_for(name: str, full: torch.Tensor) -> torch.Tensor:
        return full_tensor_slice(held[name], full)

    with torch.no_grad():
        for name, t in plan.tensors(dtype, param_filter=held.__contains__, shard_fn=slice_for):
            target = held[name]
            if tuple(t.shape) != tuple(target.shape):
                raise CheckpointError(f"{plan.path}: {name} slice {list(t.shape)} != this rank's {list(target.shape)}")
            target.copy_(t)
            loaded.add(name)
        if plan.match.dense:
            log.info("%s is a dense checkpoint: initializing the lightning indexers", plan.path)
            std = plan.config.initializer_range
            for name in plan.match.missing_indexer:
                if name in held:
                    full = fresh_indexer_tensor(name, full_shapes[name], std, held[name].dtype)
                    held[name].copy_(full_tensor_slice(held[name], full))
                    loaded.add(name)
    missing = [n for n in held if n not in loaded and not _runtime_buffer(model, n)]
    if missing:
        raise CheckpointError(f"{plan.path}: {missing[:4]} were not loaded on this rank (internal error: please report)")
    apply_dtype_policy(model, dtype)  # runtime buffers (RoPE, Hadamard) fp32: model/dtypes.py
    model.to(device)
    log.info("rank %d loaded %d tensors (%.1f MB) of %s", state.rank, len(loaded),
             sum(t.numel() * t.element_size() for t in held.values()) / 1e6, plan.path)
    return model


def _runtime_buffer(model: torch.nn.Module, name: str) -> bool:
    module_path, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_path)
    return leaf in module._buffers and leaf in module._non_persistent_buffers_set
