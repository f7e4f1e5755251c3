"""Shared by the checkpoint tests: reference readers that do not use dsa_train's loader."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open

# FP8 dims all multiples of 128: transformers 5.23 dequantizes FP8 on the CPU only when the weight
# is divisible by its scale grid (it derives the block size from the grid), so partial edge
# blocks, which every real DeepSeek-V3 has in kv_a_proj_with_mqa (576 rows), fail there.
BLOCK_ALIGNED = dict(
    hidden_size=256, q_lora_rank=128, num_attention_heads=2, qk_nope_head_dim=64, qk_rope_head_dim=128,
    v_head_dim=64, kv_lora_rank=128, intermediate_size=256, moe_intermediate_size=128, index_head_dim=128,
)


def raw_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every stored tensor of a Hugging Face directory, read with the safetensors library."""
    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():
                out[name] = h.get_tensor(name)
    return out


def reference_dequantize(w8: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    out = torch.empty(w8.shape, dtype=torch.float32)
    for i in range(math.ceil(w8.shape[0] / block)):
        for j in range(math.ceil(w8.shape[1] / block)):
            rows, cols = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
            out[rows, cols] = w8[rows, cols].float() * float(scale[i, j])
    return out


def reference_weights(path: Path) -> dict[str, torch.Tensor]:
    """Parameter name -> fp32 value, FP8 dequantized block by block."""
    raw = raw_tensors(path)
    out = {}
    for name, t in raw.items():
        if name.endswith("_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            out[name] = reference_dequantize(t, raw[name + "_scale_inv"])
        else:
            out[name] = t.float()
    return out


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def assert_close_logits(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-4) -> None:
    err = (ours - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= rel * scale, f"max |diff| {err:.3e} > {rel} x max |logit| {scale:.3e}"
