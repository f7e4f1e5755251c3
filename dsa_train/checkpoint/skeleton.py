"""A model whose parameters are on the meta device (no memory), filled in one tensor at a time.

`empty_model(config)` builds DSAForCausalLM with every parameter on the meta device and every
buffer real (RoPE frequencies, the Hadamard matrix and router biases are small and computed from
the config). `assign` then replaces a parameter by a real tensor without ever allocating the
full model twice.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from ..model.config import DSAConfig
from ..model.dtypes import FP32_CHECKPOINT_TENSORS
from ..model.transformer import DSAForCausalLM

FP32_SUFFIXES = FP32_CHECKPOINT_TENSORS  # the dtype policy: dsa_train/model/dtypes.py


@contextmanager
def parameters_on_meta():
    """While active, every nn.Parameter registered on a module is moved to the meta device, and
    `torch.nn.init.normal_` skips meta tensors (nn.Embedding calls it; on a meta tensor it pulls
    in torch's Python decompositions, ~180 MB of resident memory for nothing)."""
    original_register = nn.Module.register_parameter
    original_normal = nn.init.normal_

    def register(module: nn.Module, name: str, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original_register(module, name, param)

    def normal_(tensor, *args, **kwargs):
        return tensor if tensor.is_meta else original_normal(tensor, *args, **kwargs)

    nn.Module.register_parameter = register
    nn.init.normal_ = normal_
    try:
        yield
    finally:
        nn.Module.register_parameter = original_register
        nn.init.normal_ = original_normal


def empty_model(config: DSAConfig) -> DSAForCausalLM:
    """No init: every parameter is on the meta device and gets loaded. (Random init ops on meta
    tensors would also pull in torch's Python decompositions, ~180 MB.)"""
    with parameters_on_meta():
        return DSAForCausalLM(config, init_weights=False)


def target_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a loaded tensor gets: fp32 for the indexer's weights_proj / k_norm and the router
    bias (as DSAForCausalLM.cast keeps them), `dtype` for everything else."""
    return torch.float32 if name.endswith(FP32_SUFFIXES) else dtype


def assign(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Put `tensor` in place of parameter or buffer `name` (shape may differ: a rank's slice)."""
    module_path, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_path)
    if leaf in module._parameters:
        old = module._parameters[leaf]
        module._parameters[leaf] = nn.Parameter(tensor, requires_grad=old.requires_grad if old is not None else True)
    elif leaf in module._buffers:
        module._buffers[leaf] = tensor
    else:
        raise KeyError(f"{name} is neither a parameter nor a buffer of the model")


def meta_tensor_names(model: nn.Module) -> list[str]:
    return [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
