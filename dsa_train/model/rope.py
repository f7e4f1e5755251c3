"""Rotary position embeddings with YaRN frequency scaling.

MLA ropes the last `qk_rope_head_dim` dims of q and k with *interleaved* pairs
(x0,x1),(x2,x3),...; the lightning indexer ropes the *first* `qk_rope_head_dim` dims of q_I and
k_I with *non-interleaved* (half-split) pairs (x[i], x[i + d/2]). Both use the same frequencies.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import DSAConfig


def yarn_inv_freq(dim: int, base: float, rope_scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [dim/2] (plain RoPE, or YaRN's ramp between interpolation and extrapolation)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    inv_freq = 1.0 / (base ** exponents)
    rtype = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if rtype != "yarn":
        return inv_freq
    factor = float(rope_scaling["factor"])
    original = rope_scaling["original_max_position_embeddings"]
    beta_fast = rope_scaling.get("beta_fast") or 32
    beta_slow = rope_scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    return (inv_freq / factor) * (1 - extrapolation_weight) + inv_freq * extrapolation_weight


def yarn_attention_factor(rope_scaling: dict | None) -> float:
    """YaRN's cos/sin magnitude factor; 1.0 for DeepSeek (mscale == mscale_all_dim)."""
    rtype = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if rtype != "yarn":
        return 1.0
    if rope_scaling.get("attention_factor") is not None:
        return float(rope_scaling["attention_factor"])
    factor = float(rope_scaling["factor"])

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    mscale, mscale_all_dim = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
    return get_mscale(factor)


class RotaryEmbedding(nn.Module):
    """Produces (cos, sin) of shape [B, T, rope_dim/2] in fp32 for the given position ids."""

    def __init__(self, config: DSAConfig):
        super().__init__()
        inv_freq = yarn_inv_freq(config.qk_rope_head_dim, config.rope_theta, config.rope_scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_factor = yarn_attention_factor(config.rope_scaling)

    @torch.no_grad()
    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = position_ids[..., None].float() * self.inv_freq.to(position_ids.device)  # [B,T,d/2]
        return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """MLA RoPE on pairs (x[2i], x[2i+1]). x: [B, T, ..., d]; cos/sin: [B, T, d/2].

    The output is laid out as [rotated evens | rotated odds] (as in transformers); q and k get the
    same permutation, so every q.k is that of the interleaved rotation.
    """
    cos, sin = _broadcast(cos, x), _broadcast(sin, x)
    x_even, x_odd = x[..., 0::2].float(), x[..., 1::2].float()
    out = torch.cat([x_even * cos - x_odd * sin, x_odd * cos + x_even * sin], dim=-1)
    return out.to(x.dtype)


def apply_rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Indexer RoPE, non-interleaved: pairs (x[i], x[i + d/2]). x: [B, T, ..., d]."""
    cos, sin = _broadcast(cos, x), _broadcast(sin, x)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)


def _broadcast(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    # cos/sin [B, T, d/2] -> [B, T, 1, ..., d/2] to match like's head dims
    while t.dim() < like.dim():
        t = t.unsqueeze(-2)
    return t
