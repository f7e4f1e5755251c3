"""Fixed probe batches measured at every stage's start and end, for the run summary.

They come from a second loader over the same sources with a different seed (data.seed + 1),
so they are fixed for the run but not a held-out split. Measured in the stage's attention mode
with both losses and the LM head on, under no_grad.
"""

from __future__ import annotations

import dataclasses

import torch

from dsa_train.config import DataConfig
from dsa_train.data import build_dataloader
from dsa_train.loss import MetricSums, Reduction
from dsa_train.stage import Stage

PROBE_SEED_OFFSET = 1


def probe_batches(data: DataConfig, count: int) -> list[dict[str, torch.Tensor]]:
    if count == 0:
        return []
    probe_cfg = dataclasses.replace(data, seed=data.seed + PROBE_SEED_OFFSET)
    loader = build_dataloader(probe_cfg, dp_rank=0, dp_size=1)
    return [next(loader) for _ in range(count)]


@torch.no_grad()
def measure(
    model: torch.nn.Module, batches: list[dict[str, torch.Tensor]], stage: Stage, device: torch.device,
    reduction: Reduction | None = None,
) -> dict[str, float]:
    """lm_loss, indexer_kl, indexer_kl_uniform, indexer_kl_captured and, in sparse stages with
    recall sampling on, topk_recall, over all probe batches (the model's metric sums, reduced
    like a training step's: `dsa_train.loss.MetricSums`)."""
    if not batches:
        return {}
    keys = ["lm_loss", "indexer_kl", "indexer_kl_uniform", "indexer_kl_captured"] + (["topk_recall"] if stage.recall_queries else [])
    was_training = model.training
    model.eval()
    sums = MetricSums()
    for batch in batches:
        batch = {k: v.to(device) for k, v in batch.items()}
        out = model(batch["input_ids"], labels=batch["labels"], position_ids=batch["position_ids"],
                    positions_checked=True, **stage.probe_forward_kwargs())  # loader rows of data.seq_len
        sums.add(out.stats)
    model.train(was_training)
    values = sums.values(reduction or Reduction(), device=device)
    return {key: values[key] for key in keys}
