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
        self._norm: torch.Tensor | None = None  # this step's gradient norm (grad_norm), and on the host
        self._norm_value: float | None = None

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        if self.accumulate_fp32 and self.masters:
            first, adds, masters = [], [], []
            for name, param in self.trainable:
                master = self.masters.get(name)
                if master is not None and param.grad is not None:
                    if master.grad is None:
                        first.append((master, param))
                    else:
                        masters.append(master.grad)
                        adds.append(param.grad)
            for master, param in first:
                master.grad = param.grad.float()
            if adds:  # one fused add over the parameters (multi-tensor kernels on a GPU)
                torch._foreach_add_(masters, adds)
            for name, param in self.trainable:
                if name in self.masters:
                    param.grad = None
        self._norm = self._norm_value = None

    def gradient_tensors(self) -> list[torch.Tensor]:
        """The gradients `step` will apply (fp32 masters' for accumulated bf16 parameters)."""
        grads = [p.grad for _, p in self.trainable if p.grad is not None]
        return grads + [m.grad for m in self.masters.values() if m.grad is not None]

    def _update_gradients(self) -> None:
        """The fp32 masters' gradients from bf16 ones (without fp32 accumulation)."""
        for name, param in self.trainable:
            master = self.masters.get(name)
            if master is not None and not self.accumulate_fp32 and param.grad is not None:
                master.grad = param.grad.float()
                param.grad = None

    def grad_norm(self) -> torch.Tensor:
        """The pre-clip L2 norm of the gradients `step` applies, a 0-dim tensor on their device
        (computed once per step: `torch.nn.utils.get_total_norm`, fused on a GPU), no host read."""
        if self._norm is None:
            self._update_gradients()
            grads = [p.grad for _, p in self.optimized if p.grad is not None]
            self._norm = torch.nn.utils.get_total_norm(grads, 2.0)
        return self._norm

    def grad_norm_value(self) -> float:
        """`grad_norm()` on the host: the step's one read of it (the non-finite check and the
        logged norm share it)."""
        if self._norm_value is None:
            self._norm_value = float(self.grad_norm())
        return self._norm_value

    def step(self) -> float:
        """Clip, update, advance the schedule, clear gradients. Returns the pre-clip grad norm.
        The clipping is `clip_grad_norm_`'s (its norm, then `clip_grads_with_norm_`), in two parts
        so that the norm is read once per step."""
        norm = self.grad_norm()
        value = self.grad_norm_value()
        params = [p for _, p in self.optimized]
        max_norm = self.grad_clip if self.grad_clip > 0 else math.inf
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        self.optimizer.step()
        self.scheduler.step()
        with torch.no_grad():
            pairs = [(param, self.masters[name]) for name, param in self.trainable if name in self.masters]
            if pairs:  # the model's bf16 copies of the fp32 masters, one fused copy
                torch._foreach_copy_([p for p, _ in pairs], [m for _, m in pairs])
        self.zero_grad()
        return value

    def close(self) -> None:
        """End of the stage (nothing to release here; see DeepSpeedEngine.close)."""
        self.zero_grad()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for _, param in self.trainable:
            param.grad = None
        self._norm = self._norm_value = None

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

    # the trainer's NonFiniteGuard checks every step's gradients (fused, one read) before the update,
    # so DeepSpeed's per-parameter bf16 overflow check would only repeat it
    return DeepSpeedEngine(model, stage, cfg.optim, layout.parallel_state, zero_stage=layout.zero_stage,
                           micro_batch_size=layout.micro_batch_size, overflow_check=False)
