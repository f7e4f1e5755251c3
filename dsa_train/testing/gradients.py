"""Gradients of a distributed engine as the optimizer will see them, for comparing a parallel run
with one process (`dsa_train.testing.selftest`).

    capture = capture_gradients(engine)   # before the step's backward passes
    ...forward / backward...
    grads = full_grads(engine, capture)   # before engine.step()

ZeRO-1/2 take gradients into their buckets during backward, so they are recorded on the way in
(tensor hooks) and reduced here the way DeepSpeed reduces them; ZeRO-3 keeps its reduced
partitions, which DeepSpeed's public `safe_get_full_grad` gathers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dsa_train.sharding import sharding_of


@dataclass
class GradientCapture:
    """This rank's gradient contributions per trainable parameter, summed over backward passes."""

    captured: dict[str, torch.Tensor] = field(default_factory=dict)
    hooks: list = field(default_factory=list)

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []


def capture_gradients(engine) -> GradientCapture:
    """Record this rank's gradient contributions from the next backward passes of `engine`
    (a `DeepSpeedEngine`); nothing to record under ZeRO-3."""
    capture = GradientCapture()
    if engine.zero_stage == 3:
        return capture
    for name, p in engine.trainable:
        def hook(grad, name=name):
            prev = capture.captured.get(name)
            capture.captured[name] = grad.detach().float().clone() if prev is None else prev + grad.float()
        capture.hooks.append(p.register_hook(hook))
    return capture


def full_grads(engine, capture: GradientCapture) -> dict[str, torch.Tensor]:
    """name -> fp32 gradient of each trainable parameter (this rank's shard for TP/EP
    parameters) averaged over data parallel, as the optimizer will see it before clipping.
    ZeRO-3: DeepSpeed's reduced gradients; stages 0-2: the contributions recorded by `capture`,
    summed over the group that holds the parameter's replicas (dense: DP x CP, routed experts:
    expert data parallel) and divided by the dense data-parallel size. Call before `step`."""
    from deepspeed.utils import safe_get_full_grad

    if engine.zero_stage == 3:
        return {name: safe_get_full_grad(p).detach().float().clone() for name, p in engine.trainable}
    capture.remove()
    state = engine.state
    out = {}
    for name, p in engine.trainable:
        g = capture.captured.get(name, torch.zeros(p.shape, dtype=torch.float32, device=p.device))
        group = state.expert_dp_group if sharding_of(p).expert else state.dense_dp_group
        dist.all_reduce(g, group=group)
        out[name] = g / state.sizes.dense_dp
    return out
