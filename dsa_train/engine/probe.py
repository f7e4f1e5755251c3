"""Fixed probe batches measured at every stage's start and end, for the run summary.

They come from a second loader over the same sources with a different seed (data.seed + 1),
so they are fixed for the run but not a held-out split. Measured in the stage's attention mode
with both losses and the LM head on, under no_grad.
"""

from __future__ import annotations

import dataclasses

import torch

from dsa_train.config import Attention, DataSection, StageConfig

PROBE_SEED_OFFSET = 1


def probe_batches(data: DataSection, count: int) -> list[dict[str, torch.Tensor]]:
    from dsa_train.data import DataConfig, build_dataloader

    if count == 0:
        return []
    probe_cfg = DataConfig(**{**dataclasses.asdict(data), "seed": data.seed + PROBE_SEED_OFFSET})
    loader = build_dataloader(probe_cfg, dp_rank=0, dp_size=1)
    return [next(loader) for _ in range(count)]


@torch.no_grad()
def measure(
    model: torch.nn.Module, batches: list[dict[str, torch.Tensor]], stage: StageConfig, device: torch.device
) -> dict[str, float]:
    """Mean over the probe batches of lm_loss, indexer_kl, indexer_kl_captured (from the mean
    KLs) and, in sparse stages with recall sampling on, topk_recall."""
    if not batches:
        return {}
    recall_queries = stage.topk_recall_queries if stage.attention == Attention.sparse else 0
    totals = {"lm_loss": 0.0, "indexer_kl": 0.0, "indexer_kl_uniform": 0.0}
    if recall_queries:
        totals["topk_recall"] = 0.0
    was_training = model.training
    model.eval()
    for batch in batches:
        batch = {k: v.to(device) for k, v in batch.items()}
        out = model(
            batch["input_ids"],
            attention=stage.attention.value,
            labels=batch["labels"],
            indexer_loss=True,
            position_ids=batch["position_ids"],
            compute_logits=True,
            topk=stage.topk,
            measure_topk_recall=recall_queries,
        )
        totals["lm_loss"] += float(out.lm_loss)
        for key in totals.keys() - {"lm_loss"}:
            totals[key] += out.metrics[key]
    model.train(was_training)
    result = {key: value / len(batches) for key, value in totals.items()}
    result["indexer_kl_captured"] = 1.0 - result["indexer_kl"] / result["indexer_kl_uniform"]
    return result
