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


def distinct_gradients(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """`grads` without the tensors that lie inside another listed contiguous tensor of the same
    storage and dtype (DeepSpeed's per-parameter gradients are views of its flat partition buffer,
    which is listed too), and without repeats: each gradient element is checked once, and a flat
    buffer in one operation. One sort per storage (thousands of parameters: no quadratic scan)."""
    spans: dict[tuple, list[tuple[int, int, int, torch.Tensor]]] = {}
    for i, g in enumerate(grads):
        if not g.numel():
            continue
        try:
            key = (g.untyped_storage().data_ptr(), g.dtype)
        except (RuntimeError, NotImplementedError):  # no storage (fake / meta): its own
            key = (id(g), g.dtype)
        start = g.storage_offset()
        end = start + sum((n - 1) * st for n, st in zip(g.shape, g.stride())) + 1
        spans.setdefault(key, []).append((start, -end, i, g))
    kept = []
    for items in spans.values():
        cover_end = None  # the end of the contiguous tensor that covers the sweep so far
        for start, neg_end, _, g in sorted(items, key=lambda item: item[:3]):
            end = -neg_end
            if cover_end is not None and end <= cover_end:
                continue  # inside a kept contiguous tensor (sorted by start: its start is <= ours)
            kept.append(g)
            if g.is_contiguous():
                cover_end = end
    return kept


def gradients_finite_flag(grads: list[torch.Tensor]) -> torch.Tensor | None:
    """A 0-dim bool tensor on the gradients' device, True when every element of `grads` is finite
    (no host read). One fused norm per (device, dtype) group (`torch._foreach_norm`: a few
    multi-tensor kernels on a GPU, whatever the number of tensors), a NaN or infinity anywhere
    makes it non-finite; so does a finite gradient whose norm overflows (|g| beyond ~1e19 in fp32),
    which no update survives either. None without gradients."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        if g.numel():
            groups.setdefault((g.device, g.dtype), []).append(g)
    if not groups:
        return None
    device = next(iter(groups))[0]
    norms = [torch.stack(torch._foreach_norm(ts)).float().to(device).sum() for ts in groups.values()]
    return torch.isfinite(torch.stack(norms).sum())


def grads_are_finite(engine: TrainingEngine) -> bool:
    """True when every gradient this rank holds is finite, with one host read. An engine that
    computes the step's gradient norm before its update (`Engine.grad_norm_value`) answers from
    it (the same read gives the logged norm); else `engine.gradient_tensors()` (DeepSpeed ZeRO-2/3
    keep them in their gradient partitions, not `p.grad`) checked by `gradients_finite_flag`. Under
    ZeRO each rank holds only its partition: the trainer combines the ranks' answers (`any_rank`)."""
    flag = gradient_flag(engine)
    return flag if isinstance(flag, bool) else bool(flag)


def gradient_flag(engine: TrainingEngine) -> bool | torch.Tensor:
    """`grads_are_finite` without its host read where it would be one: a Python bool (an engine
    whose norm was read already), or a 0-dim device tensor (for `any_rank` to combine, then read)."""
    norm_value = getattr(engine, "grad_norm_value", None)
    if norm_value is not None:
        return math.isfinite(norm_value())
    flag = gradients_finite_flag(distinct_gradients(engine.gradient_tensors()))
    return True if flag is None else flag


def nonfinite_losses(metrics: dict[str, float]) -> list[str]:
    """Names of the step's non-finite loss terms (Python floats: no host read)."""
    return [k for k in ("loss", "lm_loss", "indexer_loss", "mtp_loss") if k in metrics and not math.isfinite(metrics[k])]


def check_step(metrics: dict[str, float], engine: TrainingEngine) -> list[str]:
    """Names of the non-finite quantities of a step (empty when all are finite)."""
    bad = nonfinite_losses(metrics)
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
