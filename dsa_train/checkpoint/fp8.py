"""FP8 e4m3 weights with one scale per 128x128 block, as in DeepSeek-V3 / V3.1 / V3.2 checkpoints.

A weight [out, in] is stored as `float8_e4m3fn` with `weight_scale_inv` [ceil(out/128),
ceil(in/128)]: dequantized = fp8 * scale_inv of its block. Edge blocks are partial when a dim is
not a multiple of 128 (kv_a_proj_with_mqa [576, 7168] has scales [5, 56]). With
`scale_fmt: ue8m0` (V3.1 and later) every scale is a power of two.

Which tensors are FP8 follows the reference checkpoints: the big Linear weights of attention,
the indexer's wq_b / wk, the dense MLPs and the experts. Never: embeddings, lm_head, norms,
the router, the MTP eh_proj / shared_head, and the indexer's weights_proj (bf16) and k_norm (fp32).
"""

from __future__ import annotations

import math
import re

import torch

from .errors import CheckpointError

E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
SCALE_SUFFIX = "_scale_inv"

_QUANTIZED = re.compile(
    r"\.(self_attn\.(q_a_proj|q_b_proj|q_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|indexer\.wq_b|indexer\.wk)"
    r"|mlp\.(gate_proj|up_proj|down_proj)"
    r"|mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)"
    r"|mlp\.shared_experts\.(gate_proj|up_proj|down_proj))\.weight$"
)


def is_quantized_in_reference(name: str) -> bool:
    """True for the weights that V3.1-Terminus / V3.2-Exp store in FP8 with block scales."""
    return bool(_QUANTIZED.search(name))


def scale_shape(shape: tuple[int, ...], block: int = 128) -> tuple[int, int]:
    out_dim, in_dim = shape
    return math.ceil(out_dim / block), math.ceil(in_dim / block)


def _expand(scale: torch.Tensor, shape: tuple[int, int], block: int) -> torch.Tensor:
    return scale.repeat_interleave(block, 0)[: shape[0]].repeat_interleave(block, 1)[:, : shape[1]]


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: int = 128, name: str = "weight") -> torch.Tensor:
    """FP8 weight [out, in] with block scales [ceil(out/b), ceil(in/b)] -> fp32 (edge blocks allowed)."""
    if weight.dim() != 2:
        raise CheckpointError(f"FP8 tensor {name} has shape {list(weight.shape)}; block-scaled FP8 weights must be 2-D")
    expect = scale_shape(tuple(weight.shape), block)
    if tuple(scale_inv.shape) != expect:
        raise CheckpointError(
            f"{name}{SCALE_SUFFIX} has shape {list(scale_inv.shape)} but a {list(weight.shape)} weight with "
            f"{block}x{block} blocks needs {list(expect)}"
        )
    out = weight.float()
    out.mul_(_expand(scale_inv.float(), tuple(weight.shape), block))
    return out


def quantize_fp8_blocks(weight: torch.Tensor, block: int = 128, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (float8_e4m3fn weight, fp32 scale_inv [ceil(out/b), ceil(in/b)]).

    Each block's scale maps its max |w| to 448. With `ue8m0` the scale is rounded up to a power of
    two (so nothing saturates), as the V3.1 / V3.2 checkpoints and kernels expect.
    """
    w = weight.detach().float()
    out_dim, in_dim = w.shape
    rows, cols = scale_shape((out_dim, in_dim), block)
    if (rows * block, cols * block) != (out_dim, in_dim):
        padded = torch.zeros(rows * block, cols * block, dtype=torch.float32)
        padded[:out_dim, :in_dim] = w
    else:
        padded = w
    # max over the contiguous last dim first: far faster than one reduction over dims (1, 3)
    amax = padded.abs().view(rows, block, cols, block).amax(dim=3).amax(dim=1)
    scale = amax.clamp(min=1e-12) / E4M3_MAX
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (w / _expand(scale, (out_dim, in_dim), block)).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale
