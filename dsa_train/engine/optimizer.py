"""AdamW over a stage's trainable parameters; matrices decay, vectors (norms, biases) do not."""

from __future__ import annotations

import torch

from dsa_train.config import OptimConfig


def build_optimizer(
    named_params: list[tuple[str, torch.nn.Parameter]], optim: OptimConfig, lr: float
) -> torch.optim.AdamW:
    decay = [p for _, p in named_params if p.ndim >= 2]
    no_decay = [p for _, p in named_params if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": optim.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=lr,
        betas=(optim.betas[0], optim.betas[1]),
        eps=optim.eps,
    )
