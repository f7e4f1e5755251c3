"""One optimizer step of a stage, for one process or N ranks: forward/backward over the
micro-batches (`forward_backward`), the caller's hooks (`StepHooks`), then the update
(`train_step`).

Each micro-batch's loss is its share of the step's loss formed from global token counts
(`dsa_train.loss`): LM and MTP cross-entropy sums over the valid labels of the whole step, the
indexer KL (eq. 3 / eq. 4) summed over the step's query tokens, so the accumulated gradient
equals that of one batch holding every micro-batch of every data-parallel rank. Metrics are
(numerator, denominator) sums reduced once at the end of the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from dsa_train.loss import IGNORE_INDEX, MetricSums, Reduction, micro_batch_loss, step_counts
from dsa_train.stage import Stage

if TYPE_CHECKING:
    from dsa_train.training_engine import TrainingEngine

__all__ = ["IGNORE_INDEX", "StepHooks", "forward_backward", "train_step"]


def forward_backward(
    engine: TrainingEngine,
    micro_batches: list[dict[str, torch.Tensor]],
    stage: Stage,
    topk_recall_queries: int = 0,
    reduction: Reduction | None = None,
) -> dict[str, float]:
    """Accumulates the gradients of one step; returns its metrics (loss terms of the step, model
    metrics over its micro-batches), reduced over ranks by `reduction` (None: one process).

    The micro-batches' position_ids must be below the model's max_position_embeddings: the forward
    takes them unchecked (`positions_checked=True`, no host read per micro-batch). The trainer's
    are: rows of data.seq_len tokens, positions restarting at 0 at every document
    (`dsa_train.data.packing`), and seq_len <= max_position_embeddings checked at start-up
    (`dsa_train.config.validate.check_sequence_fits`)."""
    reduction = reduction or Reduction()
    coefs = stage.loss_coefficients
    counts = step_counts(micro_batches, reduction)
    sums = MetricSums()
    for i, mb in enumerate(micro_batches):
        out = engine.forward(
            mb["input_ids"],
            labels=mb["labels"] if stage.uses_lm else None,
            position_ids=mb["position_ids"],
            positions_checked=True,  # the caller's rows: see the docstring (no host read per micro-batch)
            **stage.forward_kwargs(topk_recall_queries if i == 0 else 0),  # recall: first micro-batch only
        )
        loss = micro_batch_loss(out, coefs, counts, reduction)
        if loss is None and stage.uses_lm:
            # no valid label here: a zero term keeps the backward (and, on many ranks, the
            # collectives inside it) in step with the micro-batches that have some
            loss = 0.0 * out.logits.float().sum()
        stats = out.stats
        # the outputs are not held through the backward: the logits ([T, vocab], ~1 GiB a rank at
        # 671B) then live only until the LM head's backward has read them (the loss saved them)
        del out
        if loss is not None and loss.requires_grad:
            engine.backward(loss)
        sums.add(stats)
    return stage.add_step_loss(sums.values(reduction, device=micro_batches[0]["input_ids"].device))


class StepHooks:
    """Named points of a training step where a caller's policies act (trainer/hooks.py holds the
    trainer's); each is a no-op here, so a hook overrides only the points it uses.

        before_step()                            the step's start, before its data is read (the
                                                 caller of `train_step` calls it: the trainer)
        after_backward(engine, metrics)          gradients accumulated, before the update
        skip_update(engine, metrics) -> bool     True: drop this step's update (grad_norm NaN)
        after_update(engine, metrics, skipped)   after the update (or its skip); metrics hold
                                                 grad_norm and lr
    """

    def before_step(self) -> None:
        pass

    def after_backward(self, engine: TrainingEngine, metrics: dict) -> None:
        pass

    def skip_update(self, engine: TrainingEngine, metrics: dict) -> bool:
        return False

    def after_update(self, engine: TrainingEngine, metrics: dict, skipped: bool) -> None:
        pass


def train_step(
    engine: TrainingEngine,
    micro_batches: list[dict[str, torch.Tensor]],
    stage: Stage,
    topk_recall_queries: int = 0,
    reduction: Reduction | None = None,
    *,
    hooks: Sequence[StepHooks] = (),
) -> dict[str, float]:
    """One optimizer step: forward/backward over `micro_batches`, the hooks, then the update.
    Returns the step's metrics plus the pre-clip grad norm (NaN when a hook skipped the update)
    and the lr it used."""
    lr = engine.lr
    metrics = forward_backward(engine, micro_batches, stage, topk_recall_queries, reduction)
    for hook in hooks:
        hook.after_backward(engine, metrics)
    skipped = any([hook.skip_update(engine, metrics) for hook in hooks])  # every hook asked
    metrics["grad_norm"] = float("nan") if skipped else engine.step()
    metrics["lr"] = lr
    for hook in hooks:
        hook.after_update(engine, metrics, skipped)
    return metrics
