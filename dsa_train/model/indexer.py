"""The lightning indexer (report eq. 1), as in DeepSeek-V3.2-Exp's reference implementation.

    q_I = wq_b(qr)                 qr = q_a_layernorm(q_a_proj(x)), MLA's normalized q latent
    k_I = k_norm(wk(x))            LayerNorm with weight and bias, one key head for all heads
    RoPE on the FIRST qk_rope_head_dim dims of q_I and k_I, non-interleaved (half split)
    optional Hadamard rotation of q_I and k_I (orthonormal: q.k unchanged; it exists for FP8)
    w = weights_proj(x) in fp32, times H_I^-1/2 * d_I^-1/2
    I[t, s] = sum_j w[t, j] * ReLU(q_I[t, j] . k_I[s])        (kernels.indexer_topk)

FP8 scoring (a sparse stage's `index_scores: fp8 | fp8_ue8m0`, issue 31 item 5): the top-k is
selected on scores of e4m3 q_I / k_I with per-token scales (one per (token, head) for q_I, one per
key token for k_I, per 128 channels), as DeepSeek-V3.2's FP8 inference scores them
(`dsa_kernels.ops.indexer_topk.fp8`), so training attends over the keys inference will pick.
Only the selection is quantized, as inference quantizes only the scoring: the indexer's KL
(eq. 4 over the selected keys) is computed on the bf16/fp32 q_I / k_I this module returns, and
its gradient flows through those (quantization has no useful gradient; a straight-through
estimator would give the same one). The module's outputs do not change with the setting.

When the model has no q-LoRA (q_lora_rank null, DeepSeek-V2-Lite), `wq_b` reads the layer's
normalized hidden state x instead of qr.

Initialization of a fresh indexer (a dense V3 checkpoint has none): wq_b, wk and weights_proj
normal(0, initializer_range); k_norm weight 1, bias 0. See docs/model.md.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from .config import DSAConfig
from .rope import apply_rope_half


class _LinearInFp32(torch.autograd.Function):
    """F.linear(x.float(), weight.float()) that keeps x in its own dtype for the backward.

    The head weights are computed in fp32 (DeepSeek-V3.2's `weights_proj(x.float())`); autograd on
    the plain expression keeps the fp32 copy of x [B, T, hidden] for the weight gradient (4 bytes
    per hidden unit and token per layer, twice x's bf16, which wk's input already keeps). Here x is
    kept as it is and made fp32 again in the backward; the same operations run in both directions,
    so the outputs and gradients are bitwise the plain expression's."""

    @staticmethod
    def forward(ctx, x, weight):  # x [..., hidden]; weight [H_I, hidden] -> [..., H_I] fp32
        ctx.save_for_backward(x, weight)
        return F.linear(x.float(), weight.float())

    @staticmethod
    def backward(ctx, grad):  # grad [..., H_I] fp32
        x, weight = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad @ weight.float()).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = (grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1]).float()).to(weight.dtype)
        return grad_x, grad_w


def hadamard_matrix(dim: int) -> torch.Tensor:
    """Orthonormal Sylvester-Hadamard matrix [dim, dim] (dim a power of two), scale dim^-1/2."""
    h = torch.ones(1, 1)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(dim)


class LightningIndexer(nn.Module):
    def __init__(self, config: DSAConfig):
        super().__init__()
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        q_in = config.q_lora_rank or config.hidden_size
        self.wq_b = nn.Linear(q_in, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)  # kept in fp32
        self.weights_scale = self.n_heads ** -0.5 * self.head_dim ** -0.5
        if config.index_hadamard:
            self.register_buffer("hadamard", hadamard_matrix(self.head_dim), persistent=False)
        else:
            self.hadamard = None

    def forward(
        self, x: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, hidden], q_latent [B, T, q_lora_rank] (both detached by the caller)
        -> q_I [B, T, H_I, d_I], k_I [B, T, d_I], w [B, T, H_I] fp32."""
        B, T, _ = x.shape
        q = self.wq_b(q_latent).view(B, T, self.n_heads, self.head_dim)
        k = self.k_norm(self.wk(x))  # [B, T, d_I]
        q = torch.cat([apply_rope_half(q[..., : self.rope_dim], cos, sin), q[..., self.rope_dim :]], dim=-1)
        k = torch.cat([apply_rope_half(k[..., : self.rope_dim], cos, sin), k[..., self.rope_dim :]], dim=-1)
        if self.hadamard is not None:
            rot = self.hadamard.to(q.dtype)
            q, k = q @ rot, k @ rot
        w = _LinearInFp32.apply(x, self.weights_proj.weight) * self.weights_scale  # fp32, x kept in its dtype
        return q, k, w

    @torch.no_grad()
    def reset_parameters(self, std: float) -> None:
        for lin in (self.wq_b, self.wk, self.weights_proj):
            lin.weight.normal_(0.0, std)
        self.k_norm.reset_parameters()
