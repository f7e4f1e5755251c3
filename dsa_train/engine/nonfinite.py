"""Non-finite loss or gradients: never a silent NaN run.

After forward/backward and before the optimizer update the trainer checks the step's loss and
every trainable gradient. When one is NaN or infinite, `fault_tolerance.nonfinite` decides:

* `skip` (default): the update is dropped (parameters, optimizer moments and the LR schedule do
  not move; gradients are cleared), the step still counts (its data is consumed), the trainer
  logs a warning and `train/nonfinite_skipped` (total) in the metrics. After
  `fault_tolerance.max_consecutive_nonfinite` skipped steps in a row it stops as below.
* `stop`: a checkpoint is written at the state *before* the bad step (resuming reproduces it)
  and `NonFiniteError` is raised naming the step and what was not finite.
"""

from __future__ import annotations

import math

import torch

from dsa_train.errors import DSATrainError


class NonFiniteError(DSATrainError, RuntimeError):
    """Non-finite values under the `stop` policy (one line, exit 2: a restart would hit the same step)."""


def grads_are_finite(engine) -> bool:
    """True when every gradient the engine will apply is finite. An engine that keeps gradients
    elsewhere (DeepSpeed ZeRO partitions) provides `grads_are_finite()` itself."""
    own = getattr(engine, "grads_are_finite", None)
    if callable(own):
        return bool(own())
    flags = [torch.isfinite(p.grad).all() for _, p in engine.trainable if p.grad is not None]
    return bool(torch.stack(flags).all()) if flags else True


def check_step(metrics: dict[str, float], engine) -> list[str]:
    """Names of the non-finite quantities of a step (empty when all are finite)."""
    bad = [k for k in ("loss", "lm_loss", "indexer_loss", "mtp_loss") if k in metrics and not math.isfinite(metrics[k])]
    if not grads_are_finite(engine):
        bad.append("gradients")
    return bad


def poison(metrics: dict[str, float], engine) -> None:
    """The `kind=nan` fault: make the step's loss and one gradient NaN."""
    metrics["loss"] = math.nan
    for _, p in engine.trainable:
        if p.grad is not None:
            p.grad.fill_(math.nan)
            break
