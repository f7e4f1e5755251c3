"""One optimizer step of a stage, for one process or N ranks: forward/backward over the
micro-batches, then update.

Each micro-batch's loss is its share of the step's loss formed from global token counts
(`dsa_train.loss`): LM and MTP cross-entropy sums over the valid labels of the whole step, the
indexer KL (eq. 3 / eq. 4) summed over the step's query tokens, so the accumulated gradient
equals that of one batch holding every micro-batch of every data-parallel rank. Metrics are
(numerator, denominator) sums reduced once at the end of the step.
"""

from __future__ import annotations

import torch

from dsa_train.config import StageConfig
from dsa_train.loss import IGNORE_INDEX, MetricSums, Reduction, micro_batch_loss, step_counts

__all__ = ["IGNORE_INDEX", "forward_backward", "forward_kwargs", "train_step"]


def forward_kwargs(stage: StageConfig) -> dict:
    uses_lm = stage.lm_loss_coef > 0
    return {
        "attention": stage.attention.value,
        "indexer_loss": stage.indexer_loss_coef > 0,
        "compute_logits": uses_lm,
        "topk": stage.topk,
        "mtp": uses_lm and stage.mtp_loss_coef > 0,
    }


def loss_coefficients(stage: StageConfig) -> dict[str, float]:
    return {"lm": stage.lm_loss_coef, "mtp": stage.mtp_loss_coef if stage.lm_loss_coef > 0 else 0.0,
            "indexer": stage.indexer_loss_coef}


def forward_backward(
    engine,
    micro_batches: list[dict[str, torch.Tensor]],
    stage: StageConfig,
    topk_recall_queries: int = 0,
    reduction: Reduction | None = None,
) -> dict[str, float]:
    """Accumulates the gradients of one step; returns its metrics (loss terms of the step, model
    metrics over its micro-batches), reduced over ranks by `reduction` (None: one process)."""
    reduction = reduction or Reduction()
    kwargs = forward_kwargs(stage)
    uses_lm = stage.lm_loss_coef > 0
    coefs = loss_coefficients(stage)
    counts = step_counts(micro_batches, reduction)
    sums = MetricSums()
    for i, mb in enumerate(micro_batches):
        out = engine.model(
            mb["input_ids"],
            labels=mb["labels"] if uses_lm else None,
            position_ids=mb["position_ids"],
            measure_topk_recall=topk_recall_queries if i == 0 else 0,  # recall: first micro-batch only
            **kwargs,
        )
        loss = micro_batch_loss(out, coefs, counts, reduction)
        if loss is None and uses_lm:
            # no valid label here: a zero term keeps the backward (and, on many ranks, the
            # collectives inside it) in step with the micro-batches that have some
            loss = 0.0 * out.logits.float().sum()
        if loss is not None and loss.requires_grad:
            engine.backward(loss)
        sums.add(out.stats)
    metrics = sums.values(reduction, device=micro_batches[0]["input_ids"].device)
    if kwargs["indexer_loss"] and "indexer_kl" in metrics:
        metrics["indexer_loss"] = metrics["indexer_kl"]
    metrics["loss"] = sum(coefs[key] * metrics.get(name, 0.0)
                          for key, name in (("lm", "lm_loss"), ("mtp", "mtp_loss"), ("indexer", "indexer_loss")))
    return metrics


def train_step(
    engine,
    micro_batches: list[dict[str, torch.Tensor]],
    stage: StageConfig,
    topk_recall_queries: int = 0,
    reduction: Reduction | None = None,
) -> dict[str, float]:
    """One optimizer step; its metrics plus the pre-clip grad norm and the lr it used."""
    lr = engine.lr
    metrics = forward_backward(engine, micro_batches, stage, topk_recall_queries, reduction)
    metrics["grad_norm"] = engine.step()
    metrics["lr"] = lr
    return metrics
