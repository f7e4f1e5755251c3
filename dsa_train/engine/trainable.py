"""Which parameters a stage trains. Frozen parameters get requires_grad=False, so they receive
no gradient and never enter the optimizer (no optimizer state)."""

from __future__ import annotations

import torch

from dsa_train.config import Trainable


def is_indexer_parameter(name: str) -> bool:
    return ".indexer." in name


def set_trainable(model: torch.nn.Module, trainable: Trainable) -> list[tuple[str, torch.nn.Parameter]]:
    """Freeze / unfreeze in place; returns the trainable (name, parameter) pairs."""
    selected = []
    for name, param in model.named_parameters():
        train = trainable == Trainable.all or is_indexer_parameter(name)
        param.requires_grad_(train)
        param.grad = None
        if train:
            selected.append((name, param))
    if not selected:
        raise ValueError(f"trainable={trainable.value}: the model has no such parameters")
    return selected
