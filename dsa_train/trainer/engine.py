"""The seam between the training loop and how parameters are updated.

`TrainingEngine` (a `typing.Protocol`, dsa_train/training_engine.py) is what the loop, the step hooks and the checkpoints use of
an engine: the model, its trainable parameters, optimizer and schedule, forward, backward, step
(clip + update + schedule), zero_grad, close, the gradients it holds and `fragments` (its
optimizer state per parameter, which checkpoints read and write: checkpoint/sharded_state.py).
`Engine` is the single-process one; with N ranks the layout (`dsa_train.parallel.layout`) builds
`dsa_train.trainer.deepspeed_engine.DeepSpeedEngine`. tests/test_seams.py checks that both
satisfy the protocol.

Parameters stored in a low-precision dtype (bfloat16) get an fp32 master copy: AdamW updates the
master and the model parameter is its rounded copy, so small updates are not lost to rounding.
With `optim.grad_accum_dtype: float32` (default) each micro-batch's bf16 gradient is added into the
master's fp32 gradient right after its backward (the parameter's own gradient is then released),
so accumulation over micro-batches rounds in fp32, not bf16.
"""

from __future__ import annotations

import math

import torch

from dsa_train.config import OptimConfig
from dsa_train.stage import Stage
from dsa_train.trainer.optimizer import build_optimizer
from dsa_train.trainer.schedule import build_scheduler
from dsa_train.checkpoint.sharded_state import Fragment
from dsa_train.training_engine import TrainingEngine


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
        the optimizer state checkpoint/sharded_state.py reads and writes for checkpoints."""
        return [Fragment(name, param, 0, param.numel(), self.optimizer, self.masters.get(name, param), 0)
                for name, param in self.trainable]


def make_engine(layout, model: torch.nn.Module, stage: Stage, cfg) -> TrainingEngine:
    """The engine of one stage on `layout`: AdamW + schedule over the stage's trainable parameters,
    in this process (`Engine`, a single-process layout) or through DeepSpeed over the layout's groups
    (`DeepSpeedEngine`, a `DistributedLayout`)."""
    from dsa_train.parallel.layout import DistributedLayout

    if not isinstance(layout, DistributedLayout):
        return Engine(model, stage, cfg.optim)
    from dsa_train.trainer.deepspeed_engine import DeepSpeedEngine

    return DeepSpeedEngine(model, stage, cfg.optim, layout.parallel_state, zero_stage=layout.zero_stage,
                           micro_batch_size=layout.micro_batch_size)
