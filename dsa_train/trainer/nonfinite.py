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

from dsa_train.training_engine import TrainingEngine
from dsa_train.errors import DSATrainError


class NonFiniteError(DSATrainError, RuntimeError):
    """Non-finite values under the `stop` policy (one line, exit 2: a restart would hit the same step)."""


def grads_are_finite(engine: TrainingEngine) -> bool:
    """True when every gradient this rank holds is finite (`engine.gradient_tensors()`: DeepSpeed
    ZeRO-2/3 keep them in their gradient partitions, not `p.grad`). Under ZeRO each rank holds only
    its partition: the trainer combines the ranks' answers (`any_rank`)."""
    flags = [torch.isfinite(g).all() for g in engine.gradient_tensors() if g.numel()]
    return bool(torch.stack(flags).all()) if flags else True


def check_step(metrics: dict[str, float], engine: TrainingEngine) -> list[str]:
    """Names of the non-finite quantities of a step (empty when all are finite)."""
    bad = [k for k in ("loss", "lm_loss", "indexer_loss", "mtp_loss") if k in metrics and not math.isfinite(metrics[k])]
    if not grads_are_finite(engine):
        bad.append("gradients")
    return bad


def poison(metrics: dict[str, float], engine: TrainingEngine) -> None:
    """The `kind=nan` fault: make the step's loss and one gradient NaN."""
    metrics["loss"] = math.nan
    poison_gradient(engine, math.nan)


def poison_gradient(engine: TrainingEngine, value: float = math.inf) -> None:
    """The `kind=inf_grad` fault: one element of one gradient this rank holds (wherever the
    engine keeps it) becomes `value`; the loss stays finite, so only the gradient check sees it."""
    with torch.no_grad():
        for g in engine.gradient_tensors():
            if g.numel():
                g.view(-1)[0] = value
                return
