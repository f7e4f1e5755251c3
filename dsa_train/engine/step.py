"""One optimizer step of a stage: forward/backward over the micro-batches, then update.

Loss per micro-batch i of a step with M micro-batches:
    (lm_loss_coef * lm_loss_i + mtp_loss_coef * mtp_loss_i) * n_i / N  +  indexer_loss_coef * indexer_loss_i / M
where lm_loss_i is the mean cross-entropy over the n_i valid labels of micro-batch i and N the
valid labels of the whole step, so the accumulated gradient equals that of one batch holding all
micro-batches (the LM loss is a mean over tokens, the indexer loss a mean over queries of
fixed-shape micro-batches).
"""

from __future__ import annotations

from collections import defaultdict

import torch

from dsa_train.config import StageConfig
from dsa_train.engine.engine import Engine

IGNORE_INDEX = -100


def forward_kwargs(stage: StageConfig) -> dict:
    uses_lm = stage.lm_loss_coef > 0
    return {
        "attention": stage.attention.value,
        "indexer_loss": stage.indexer_loss_coef > 0,
        "compute_logits": uses_lm,
        "topk": stage.topk,
        "mtp": uses_lm and stage.mtp_loss_coef > 0,
    }


def forward_backward(
    engine: Engine,
    micro_batches: list[dict[str, torch.Tensor]],
    stage: StageConfig,
    topk_recall_queries: int = 0,
) -> dict[str, float]:
    """Accumulates the gradients of one step; returns loss terms summed to step values and
    model metrics averaged over micro-batches."""
    kwargs = forward_kwargs(stage)
    uses_lm = stage.lm_loss_coef > 0
    num_micro = len(micro_batches)
    valid_labels = [int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro_batches]
    total_valid = sum(valid_labels)

    totals: dict[str, float] = defaultdict(float)
    model_metrics: dict[str, float] = defaultdict(float)
    for i, mb in enumerate(micro_batches):
        out = engine.model(
            mb["input_ids"],
            labels=mb["labels"] if uses_lm else None,
            position_ids=mb["position_ids"],
            measure_topk_recall=topk_recall_queries if i == 0 else 0,
            **kwargs,
        )
        loss = torch.zeros((), device=mb["input_ids"].device)
        if uses_lm and valid_labels[i] > 0:
            weight = valid_labels[i] / total_valid
            loss = loss + stage.lm_loss_coef * weight * out.lm_loss
            totals["lm_loss"] += weight * float(out.lm_loss.detach())
            if out.mtp_loss is not None:
                loss = loss + stage.mtp_loss_coef * weight * out.mtp_loss
                totals["mtp_loss"] += weight * float(out.mtp_loss.detach())
        elif uses_lm:
            # no valid label in this micro-batch: a zero term keeps the backward (and, on many
            # ranks, the collectives inside it) in step with the micro-batches that have some
            loss = loss + 0.0 * out.logits.float().sum()
        if kwargs["indexer_loss"]:
            loss = loss + stage.indexer_loss_coef * out.indexer_loss / num_micro
            totals["indexer_loss"] += float(out.indexer_loss.detach()) / num_micro
        if loss.requires_grad:
            engine.backward(loss)
        totals["loss"] += float(loss.detach())
        for key, value in out.metrics.items():
            model_metrics[key] += value
    # topk_recall is measured on the first micro-batch only; everything else on all of them.
    metrics = {key: value / (1 if key == "topk_recall" else num_micro) for key, value in model_metrics.items()}
    if "indexer_kl" in metrics and metrics.get("indexer_kl_uniform", 0) > 0:
        metrics["indexer_kl_captured"] = 1.0 - metrics["indexer_kl"] / metrics["indexer_kl_uniform"]
    metrics.update(totals)
    return metrics


def train_step(
    engine: Engine,
    micro_batches: list[dict[str, torch.Tensor]],
    stage: StageConfig,
    topk_recall_queries: int = 0,
) -> dict[str, float]:
    """One optimizer step; its metrics plus the pre-clip grad norm and the lr it used."""
    lr = engine.lr
    metrics = forward_backward(engine, micro_batches, stage, topk_recall_queries)
    metrics["grad_norm"] = engine.step()
    metrics["lr"] = lr
    return metrics
