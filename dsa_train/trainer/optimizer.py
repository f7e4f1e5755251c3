"""AdamW over a stage's trainable parameters; matrices decay, vectors (norms, biases) do not."""

from __future__ import annotations

import torch

from dsa_train.config import OptimConfig


def weight_decay_groups(named_params: list[tuple[str, torch.nn.Parameter]], weight_decay: float) -> list[dict]:
    """AdamW's parameter groups: `decay` (matrices, `weight_decay`) and `no_decay` (vectors: norms,
    biases; 0), empty ones left out. Both engines' optimizers take them (`Engine`, `DeepSpeedEngine`)."""
    groups = [
        {"name": "decay", "params": [p for _, p in named_params if p.ndim >= 2], "weight_decay": weight_decay},
        {"name": "no_decay", "params": [p for _, p in named_params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def build_optimizer(
    named_params: list[tuple[str, torch.nn.Parameter]], optim: OptimConfig, lr: float
) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        weight_decay_groups(named_params, optim.weight_decay),
        lr=lr,
        betas=(optim.betas[0], optim.betas[1]),
        eps=optim.eps,
    )
