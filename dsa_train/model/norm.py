"""RMSNorm as in DeepSeek-V3: normalize in fp32, scale by a learned weight.

Under autograd the norm keeps only its input and weight for backward (`recomputed`): the plain
expression would keep an fp32 copy of x (4 bytes per element: at T = 16384 the five norms of
one small_32k layer held about 330 MB). Values and gradients are unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from .recompute import recomputed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return recomputed(lambda x_, w_: rms_norm(x_, w_, self.eps), x, self.weight)
