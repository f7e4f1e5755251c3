"""The seam between the training loop and how parameters are updated.

`TrainingEngine` (a `typing.Protocol`) is what the loop, the step hooks and the checkpoints use of
an engine: the model, its trainable parameters, optimizer and schedule, forward, backward, step
(clip + update + schedule), zero_grad, close, the gradients it holds and `fragments` (its
optimizer state per parameter, which checkpoints read and write: engine/sharded_state.py).
`Engine` is the single-process one; with N ranks the layout (`dsa_train.parallel.layout`) builds
`dsa_train.parallel.deepspeed_engine.DeepSpeedEngine`. tests/test_seams.py checks that both
satisfy the protocol.

Parameters stored in a low-precision dtype (bfloat16) get an fp32 master copy: AdamW updates the
master and the model parameter is its rounded copy, so small updates are not lost to rounding.
With `optim.grad_accum_dtype: float32` (default) each micro-batch's bf16 gradient is added into the
master's fp32 gradient right after its backward (the parameter's own gradient is then released),
so accumulation over micro-batches rounds in fp32, not bf16.
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

import torch

from dsa_train.config import OptimConfig
from dsa_train.stage import Stage
from dsa_train.engine.optimizer import build_optimizer
from dsa_train.engine.schedule import build_scheduler
from dsa_train.engine.sharded_state import Fragment


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
        """This rank's optimizer state per trainable parameter (engine/sharded_state.py)."""
        ...


class Engine:
    """The single-process `TrainingEngine`: AdamW + schedule over the stage's trainable parameters,
    with fp32 masters of low-precision ones (module docstring)."""

    def __init__(self, model: torch.nn.Module, stage: Stage, optim: OptimConfig):
        self.model = model
        self.trainable = stage.select_trainable(model)
        # name -> fp32 master of a low-precision trainable parameter
        self.masters = {
            name: torch.nn.Parameter(p.detach().float().clone())
            for name, p in self.trainable
            if p.dtype != torch.float32
        }
        self.optimized = [(name, self.masters.get(name, p)) for name, p in self.trainable]
        self.optimizer = build_optimizer(self.optimized, optim, stage.config.lr)
        self.scheduler = build_scheduler(self.optimizer, stage.config)
        self.grad_clip = optim.grad_clip
        self.accumulate_fp32 = getattr(optim.grad_accum_dtype, "value", optim.grad_accum_dtype) == "float32"

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        if self.accumulate_fp32 and self.masters:
            for name, param in self.trainable:
                master = self.masters.get(name)
                if master is not None and param.grad is not None:
                    if master.grad is None:
                        master.grad = param.grad.float()
                    else:
                        master.grad.add_(param.grad)
                    param.grad = None

    def gradient_tensors(self) -> list[torch.Tensor]:
        """The gradients `step` will apply (fp32 masters' for accumulated bf16 parameters)."""
        grads = [p.grad for _, p in self.trainable if p.grad is not None]
        return grads + [m.grad for m in self.masters.values() if m.grad is not None]

    def step(self) -> float:
        """Clip, update, advance the schedule, clear gradients. Returns the pre-clip grad norm."""
        for name, param in self.trainable:
            master = self.masters.get(name)
            if master is not None and not self.accumulate_fp32:
                master.grad = None if param.grad is None else param.grad.float()
        params = [p for _, p in self.optimized]
        max_norm = self.grad_clip if self.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        self.optimizer.step()
        self.scheduler.step()
        with torch.no_grad():
            for name, param in self.trainable:
                if name in self.masters:
                    param.copy_(self.masters[name])
        self.zero_grad()
        return float(grad_norm)

    def close(self) -> None:
        """End of the stage (nothing to release here; see DeepSpeedEngine.close)."""
        self.zero_grad()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for _, param in self.trainable:
            param.grad = None

    def fragments(self) -> list[Fragment]:
        """Whole trainable parameters, stepped as their fp32 masters (bf16 ones) or themselves:
        the optimizer state engine/sharded_state.py reads and writes for checkpoints."""
        return [Fragment(name, param, 0, param.numel(), self.optimizer, self.masters.get(name, param), 0)
                for name, param in self.trainable]
