"""FP8 index scores (issue 31 item 5): what DeepSeek-V3.2's FP8 inference scores, as a reference.

DeepSeek-V3.2-Exp's inference indexer (after the Hadamard rotation, which the model applies)
quantizes q_I and k_I with `act_quant` (block 128; `scale_fmt: ue8m0` in its 671B config) and
scores with `fp8_index` (DeepGEMM's `fp8_mqa_logits` computes the same):

    q8, qs = e4m3(q_I), one scale per (token, head) per 128 channels
    k8, ks = e4m3(k_I), one scale per key token per 128 channels
    I[t, s] = ks[s] * sum_j (w[t, j] * qs[t, j]) * ReLU(q8[t, j] . k8[s])     (fp32 accumulation)

(with one 128-channel group, as at d_I = 128; the scales are positive, so qs moves out of the
ReLU and ks out of the head sum). Scoring modes (`SCORINGS`, a recipe's `index_scores`):
  "bf16"       q_I / k_I as the model computed them, fp32 products: the reference (default)
  "fp8"        e4m3 with fp32 scales amax / 448 (DeepGEMM's and vLLM's FP8 key cache)
  "fp8_ue8m0"  e4m3 with power-of-two scales (V3.2-Exp's own inference code, scale_fmt ue8m0)

Two PyTorch forms: `index_scores_fp8_block` in the inference's order (the specification the
Triton kernel's FP8 path is tested against), and `fp8_emulated` (quantize, then dequantize to
fp32 exactly): the plain scores of the emulated q / k are the same numbers up to fp32 rounding
(bit-identical with ue8m0 scales, whose products are exact), so the chunked reference top-k and
the context-parallel op run on them unchanged (`indexer_topk(..., scoring=...)` off the GPU).
"""

from __future__ import annotations

import torch

from ...masking import chunk_key_range, chunk_valid_mask
from .reference import FP8_GROUP, quantize_fp8_groups

SCORINGS = ("bf16", "fp8", "fp8_ue8m0")


def scoring_mode(scoring: str) -> tuple[bool, bool]:
    """A scoring name -> (fp8, ue8m0); anything else: one ValueError naming the choices."""
    if scoring not in SCORINGS:
        raise ValueError(f"index scoring must be one of {', '.join(SCORINGS)}; got {scoring!r} "
                         "(bf16: the reference; fp8 / fp8_ue8m0: e4m3 q_I / k_I as FP8 inference scores)")
    return scoring != "bf16", scoring == "fp8_ue8m0"


def dequantize_fp8_groups(x8: torch.Tensor, scale: torch.Tensor, group: int = FP8_GROUP) -> torch.Tensor:
    """e4m3 [..., D] and scales [..., ceil(D / group)] -> fp32 [..., D] = fp8 * scale."""
    D = x8.shape[-1]
    s = scale.float().repeat_interleave(group, dim=-1)[..., :D]
    return x8.float() * s


def fp8_emulated(x: torch.Tensor, ue8m0: bool = False) -> torch.Tensor:
    """x [..., D] through e4m3 with one scale per 128 channels, back to fp32 (exact dequantization)."""
    return dequantize_fp8_groups(*quantize_fp8_groups(x, FP8_GROUP, ue8m0))


QUANT_CHUNK_ELEMS = 1 << 26  # elements of x quantized at once (its fp32 temporaries: 256 MB each)


def quantize_rows(x: torch.Tensor, ue8m0: bool = False, chunk_elems: int = QUANT_CHUNK_ELEMS):
    """`quantize_fp8_groups` of x [B, T, ...] a slice of tokens (dim 1) at a time, so the fp32
    temporaries stay within `chunk_elems` elements (q_I at T = 128K: 1 G elements) -> (x8, scales)."""
    B, T = x.shape[:2]
    per_token = max(1, x[:, :1].numel())
    step = max(1, chunk_elems // per_token)
    if step >= T:
        return quantize_fp8_groups(x, FP8_GROUP, ue8m0)
    G = -(-x.shape[-1] // FP8_GROUP)
    x8 = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((*x.shape[:-1], G), dtype=torch.float32, device=x.device)
    for t0 in range(0, T, step):
        x8[:, t0 : t0 + step], scale[:, t0 : t0 + step] = quantize_fp8_groups(x[:, t0 : t0 + step], FP8_GROUP, ue8m0)
    return x8, scale


def quantize_index_inputs(q: torch.Tensor, k: torch.Tensor, ue8m0: bool = False, chunk_elems: int = QUANT_CHUNK_ELEMS):
    """q_I [B, T, H, D], k_I [B, T, D] -> (q8, qs [B, T, H, G], k8, ks [B, T, G]), G = ceil(D / 128);
    a slice of tokens at a time (`quantize_rows`)."""
    q8, qs = quantize_rows(q, ue8m0, chunk_elems)
    k8, ks = quantize_rows(k, ue8m0, chunk_elems)
    return q8, qs, k8, ks


def index_scores_fp8_block(q8: torch.Tensor, qs: torch.Tensor, k8: torch.Tensor, ks: torch.Tensor,
                           w: torch.Tensor) -> torch.Tensor:
    """FP8 scores in the inference's order: q8 [B, C, H, D] e4m3, qs [B, C, H, G], k8 [B, S, D],
    ks [B, S, G], w [B, C, H] -> [B, C, S] fp32 (no masking). One group (D <= 128): fp32 dots of
    the e4m3 values, ReLU, times w * qs, summed over heads, times ks. Several groups: each
    group's dot times both its scales, summed over groups, then ReLU and w (the kernel's order)."""
    B, C, H, D = q8.shape
    S, G = k8.shape[1], ks.shape[-1]
    qf, kf = q8.float(), k8.float()
    if G == 1:
        logits = torch.matmul(qf.reshape(B, C * H, D), kf.transpose(1, 2))  # [B, C*H, S]
        relu = torch.relu(logits).view(B * C, H, S)
        wq = (w.float() * qs[..., 0].float()).reshape(B * C, 1, H)
        return torch.bmm(wq, relu).view(B, C, S) * ks[..., 0].float()[:, None, :]
    logits = q8.new_zeros((B, C, H, S), dtype=torch.float32)
    for g in range(G):
        d = slice(g * FP8_GROUP, min(D, (g + 1) * FP8_GROUP))
        part = torch.einsum("bchd,bsd->bchs", qf[..., d], kf[..., d])
        logits += part * qs[..., g].float()[..., None] * ks[..., g].float()[:, None, None, :]
    return torch.einsum("bchs,bch->bcs", torch.relu(logits), w.float())


def index_scores_fp8_ref(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, doc_start: torch.Tensor, q0: int, q1: int,
                         ue8m0: bool = False) -> tuple[torch.Tensor, int]:
    """Masked FP8 scores of queries [q0, q1) against their key window -> ([B, C, S] with -inf,
    k0): `index_scores_ref` with q / k quantized as inference does (`index_scores_fp8_block`)."""
    k0, k1 = chunk_key_range(doc_start, q0, q1)
    q8, qs = quantize_fp8_groups(q[:, q0:q1], FP8_GROUP, ue8m0)
    k8, ks = quantize_fp8_groups(k[:, k0:k1], FP8_GROUP, ue8m0)
    scores = index_scores_fp8_block(q8, qs, k8, ks, w[:, q0:q1])
    valid = chunk_valid_mask(doc_start, q0, q1, k0, k1)
    return scores.masked_fill(~valid, float("-inf")), k0
