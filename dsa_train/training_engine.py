"""`TrainingEngine`: what the training loop, the step hooks, the layout and the checkpoints use of an
engine (one stage's parameter updates). `dsa_train.trainer.engine.Engine` (one process) and
`dsa_train.trainer.deepspeed_engine.DeepSpeedEngine` (N ranks) implement it; tests/test_seams.py
checks both. It sits below the layout (dsa_train.parallel), which annotates with it, and above the
checkpoints, whose optimizer-state fragments it returns."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from dsa_train.checkpoint.sharded_state import Fragment


@runtime_checkable
class TrainingEngine(Protocol):
    """One stage's parameter updates, as the training loop sees them."""

    model: torch.nn.Module  # the model as built (DeepSpeedEngine keeps DeepSpeed's wrapper as `.ds`)
    trainable: list[tuple[str, torch.nn.Parameter]]  # (name, parameter) the stage trains
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR

    @property
    def lr(self) -> float:
        """The learning rate the next `step` applies."""
        ...

    def forward(self, *args, **kwargs):
        """The model's forward as training runs it (DeepSpeed: through its engine, which gathers
        ZeRO-3 partitions in its hooks); returns the model's output (`DSAOutput`)."""
        ...

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradients of one micro-batch's loss."""
        ...

    def gradient_tensors(self) -> list[torch.Tensor]:
        """The gradients this rank holds between backward and step (wherever the engine keeps them)."""
        ...

    def step(self) -> float:
        """Clip, update, advance the schedule, clear gradients. Returns the pre-clip grad norm."""
        ...

    def zero_grad(self) -> None:
        ...

    def close(self) -> None:
        """End of the stage: release what the engine attached to the model."""
        ...

    def fragments(self) -> list[Fragment]:
        """This rank's optimizer state per trainable parameter (checkpoint/sharded_state.py)."""
        ...
