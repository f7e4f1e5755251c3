"""Learning-rate schedule of one stage: linear warm-up, then constant, cosine or linear decay."""

from __future__ import annotations

import math

import torch

from dsa_train.config import Decay, StageConfig


def lr_multiplier(step: int, stage: StageConfig) -> float:
    """Factor on `stage.lr` for optimizer step `step` (0-based: the step about to be taken).

    Warm-up ramps linearly to 1 over `warmup_steps` (step 0 gets 1/warmup_steps, never 0);
    the decay then goes from 1 at the end of warm-up to `min_lr_ratio` at the last step.
    """
    if step < stage.warmup_steps:
        return (step + 1) / stage.warmup_steps
    if stage.decay == Decay.constant:
        return 1.0
    decay_steps = stage.steps - stage.warmup_steps
    progress = 1.0 if decay_steps <= 1 else min(1.0, (step - stage.warmup_steps) / (decay_steps - 1))
    if stage.decay == Decay.cosine:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        shape = 1.0 - progress
    return stage.min_lr_ratio + (1.0 - stage.min_lr_ratio) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, stage: StageConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, stage))
