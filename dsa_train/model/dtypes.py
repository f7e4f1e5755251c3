"""The one dtype policy: which tensors stay fp32 whatever the model's dtype.

Every path that makes or fills a model goes through `apply` or `tensor_dtype` (a new model from a
config: `DSAForCausalLM.cast`, which the trainer calls; a pretrained load: checkpoint/loader.py and
the meta-device start-up; the plan's trace; resume, whose checkpoint holds the same dtypes; the
export: `stored_fp32`). tests/test_dtype_policy.py builds the model on each path in bf16 and checks
every parameter and buffer.

fp32, as DeepSeek's V3.2 checkpoints and inference code keep them:
- parameters: the indexer's `weights_proj` (computed in fp32, never quantized; V3.2-Exp stores it
  bf16, and so does the export) and `k_norm`'s weight and bias;
- the router's `e_score_correction_bias` (a buffer stored fp32 in the checkpoints, `STORED_FP32`: in bf16,
  0.5 + 1e-3 rounds back to 0.5 and the load-balancing update stalls);
- every other floating buffer: the MoE token-load accumulators (counts above 256 are not integers
  in bf16), RoPE's `inv_freq` (bf16 frequencies put the angle of position 32K off by radians) and
  the indexer's Hadamard matrix (cast to the activations' dtype where it is used).
Everything else: the model dtype.
"""

from __future__ import annotations

import torch
from torch import nn

# parameters kept in fp32
FP32_PARAMETERS = ("indexer.weights_proj.weight", "indexer.k_norm.weight", "indexer.k_norm.bias")
# checkpoint tensors held in fp32 in the model (parameters and persistent buffers), whatever a checkpoint stores
FP32_CHECKPOINT_TENSORS = FP32_PARAMETERS + ("mlp.gate.e_score_correction_bias",)
# what the V3.2-Exp layout stores in fp32 (the export writes these so): weights_proj is stored bf16 there
STORED_FP32 = ("indexer.k_norm.weight", "indexer.k_norm.bias", "mlp.gate.e_score_correction_bias")


def tensor_dtype(name: str, dtype: torch.dtype, buffer: bool = False) -> torch.dtype:
    """The dtype the floating tensor `name` (a parameter, or a buffer with buffer=True) has in a model of `dtype`."""
    if buffer or name.endswith(FP32_CHECKPOINT_TENSORS):
        return torch.float32
    return dtype


def apply(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast `model` in place to `dtype` under the policy (parameters and buffers)."""
    for name, p in model.named_parameters():
        target = tensor_dtype(name, dtype)
        if p.is_floating_point() and p.dtype != target:
            p.data = p.data.to(target)
    for module in model.modules():
        for key, buf in module._buffers.items():
            if buf is not None and buf.is_floating_point() and buf.dtype != torch.float32:
                module._buffers[key] = buf.to(torch.float32)
    return model


def violations(model: nn.Module, dtype: torch.dtype) -> list[str]:
    """`name: has X, policy Y` for each floating parameter or buffer of `model` off the policy."""
    found = []
    for name, p in model.named_parameters():
        if p.is_floating_point() and p.dtype != tensor_dtype(name, dtype):
            found.append(f"{name}: has {p.dtype}, policy {tensor_dtype(name, dtype)}")
    for name, b in model.named_buffers():
        if b.is_floating_point() and b.dtype != torch.float32:
            found.append(f"{name}: has {b.dtype}, policy torch.float32")
    return found
