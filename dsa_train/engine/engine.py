"""The seam between the training loop and how parameters are updated.

`Engine` owns the model, the optimizer and the schedule of one stage, and exposes what the loop
needs: backward, step (clip + update + schedule), zero_grad and checkpointable state. The
distributed work replaces it by a DeepSpeed / Megatron-backed engine with the same methods.
"""

from __future__ import annotations

import math

import torch

from dsa_train.config import OptimConfig, StageConfig
from dsa_train.engine.optimizer import build_optimizer
from dsa_train.engine.schedule import build_scheduler
from dsa_train.engine.trainable import set_trainable


class Engine:
    def __init__(self, model: torch.nn.Module, stage: StageConfig, optim: OptimConfig):
        self.model = model
        self.trainable = set_trainable(model, stage.trainable)
        self.optimizer = build_optimizer(self.trainable, optim, stage.lr)
        self.scheduler = build_scheduler(self.optimizer, stage)
        self.grad_clip = optim.grad_clip

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> float:
        """Clip, update, advance the schedule, clear gradients. Returns the pre-clip grad norm."""
        params = [p for _, p in self.trainable]
        max_norm = self.grad_clip if self.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.zero_grad()
        return float(grad_norm)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
