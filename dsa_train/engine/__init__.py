"""Training engine: the pieces a trainer is built from — the optimizer and schedule (`Engine`, a
`TrainingEngine`), one optimizer step (`train_step` and its `StepHooks`), training checkpoints.

The trainer composing them with the layout (`dsa_train.parallel.layout`) is
`dsa_train.engine.trainer` (`Trainer`, `train`); it is not imported here, since the layout itself
builds on these pieces."""

from dsa_train.engine.engine import Engine, TrainingEngine
from dsa_train.engine.schedule import lr_multiplier
from dsa_train.engine.step import StepHooks, forward_backward, train_step

__all__ = [
    "Engine", "StepHooks", "TrainingEngine", "forward_backward", "lr_multiplier", "train_step",
]
