"""The loss of a training step and its metrics, formed from global token counts: one module for
one process and for N ranks (the model returns sums over the tokens it holds; this module
divides them by the counts of the whole step).

For a step of micro-batches over every data-parallel rank (report eqs. 3/4 for the indexer):
    loss = lm_coef  * sum(CE over valid labels)      / N_lm
         + mtp_coef * sum(CE over valid MTP targets) / N_mtp
         + idx_coef * mean_layers(sum(KL over queries)) / N_queries
N_* are counted over the whole step (every micro-batch, every data-parallel rank; context-parallel
ranks hold parts of the same sequences, so their counts are not added again). Each rank's
micro-batch contributes its own sums over these global counts; the engine averages gradients
over the ranks holding replicas of a parameter (DP x CP), so each micro-batch's loss is
multiplied by that number (`Reduction.gradient_replicas`) to make the average a sum. The
accumulated gradient then equals that of one process holding the whole step (torchtitan's
`global_valid_tokens` rescaling, `components/loss.py`).

Metrics: the model reports (numerator, denominator) sums (`DSAOutput.stats`); `MetricSums` adds
them over micro-batches and, in one all-reduce, over ranks, then divides; derived metrics
(`indexer_kl_captured`) are computed once from the reduced values (`metric_values`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

IGNORE_INDEX = -100


def mtp_targets(labels: torch.Tensor) -> torch.Tensor:
    """labels [B, T] -> MTP targets [B, T]: position t (seeing h_t and token t+1) predicts
    labels[t+1] (= token t+2). A document end (labels[t] == -100) would leak across documents,
    and the last position has no t+1: both ignored."""
    target = torch.full_like(labels, IGNORE_INDEX)
    target[:, :-1] = labels[:, 1:].masked_fill(labels[:, :-1] == IGNORE_INDEX, IGNORE_INDEX)
    return target


def _sum(t: torch.Tensor, all_reduce: Callable[[torch.Tensor], None] | None) -> torch.Tensor:
    if all_reduce is not None:
        all_reduce(t)
    return t


@dataclass
class Reduction:
    """How a step's numbers combine over ranks (one process: nothing to combine).
    sum_over_data: all-reduce SUM over data-parallel ranks (token counts: every context-parallel
    rank holds the whole micro-batch); sum_over_replicas: over DP x CP (metric sums, each rank's
    over the tokens it holds); gradient_replicas: the ranks the engine averages gradients over."""

    sum_over_data: Callable[[torch.Tensor], None] | None = None
    sum_over_replicas: Callable[[torch.Tensor], None] | None = None
    gradient_replicas: int = 1


@dataclass
class StepCounts:
    """Token counts of a whole step over every data-parallel rank."""

    lm_tokens: float
    mtp_tokens: float
    queries: float  # query tokens seen by the indexer loss (every position of every sequence)


def step_counts(micro_batches: list[dict[str, torch.Tensor]], reduction: Reduction) -> StepCounts:
    local = torch.tensor(
        [[float((mb["labels"] != IGNORE_INDEX).sum()), float((mtp_targets(mb["labels"]) != IGNORE_INDEX).sum()),
          float(mb["input_ids"].numel())] for mb in micro_batches],
        dtype=torch.float64, device=micro_batches[0]["input_ids"].device,
    ).sum(0)
    lm, mtp, queries = _sum(local, reduction.sum_over_data).tolist()
    return StepCounts(lm, mtp, queries)


def micro_batch_loss(out, coefs: dict[str, float], counts: StepCounts, reduction: Reduction) -> torch.Tensor | None:
    """This micro-batch's share of the step loss (None: no term needs a gradient here).
    coefs: lm / mtp / indexer loss coefficients of the stage."""
    terms = []
    if coefs["lm"] > 0 and out.lm_loss_sum is not None:
        terms.append(coefs["lm"] * out.lm_loss_sum / max(counts.lm_tokens, 1.0))
    if coefs["mtp"] > 0 and out.mtp_loss_sum is not None:
        terms.append(coefs["mtp"] * out.mtp_loss_sum / max(counts.mtp_tokens, 1.0))
    if coefs["indexer"] > 0 and out.indexer_kl_sum is not None:
        terms.append(coefs["indexer"] * out.indexer_kl_sum / max(counts.queries, 1.0))
    if not terms:
        return None
    return sum(terms) * reduction.gradient_replicas


def metric_values(sums: dict[str, list[float]]) -> dict[str, float]:
    """{name: [numerator, denominator]} -> {name: value}, plus the derived metrics (once)."""
    values = {key: num / den for key, (num, den) in sums.items() if den > 0}
    if "indexer_kl" in values and values.get("indexer_kl_uniform", 0) > 0:
        values["indexer_kl_captured"] = 1.0 - values["indexer_kl"] / values["indexer_kl_uniform"]
    return values


class MetricSums:
    """Numerator / denominator sums of the model's stats over micro-batches, reduced over ranks."""

    def __init__(self):
        self.sums: dict[str, list[float]] = {}

    def add(self, stats: dict[str, tuple[float, float]]) -> None:
        for key, (num, den) in stats.items():
            acc = self.sums.setdefault(key, [0.0, 0.0])
            acc[0] += float(num)
            acc[1] += float(den)

    def values(self, reduction: Reduction, device=None) -> dict[str, float]:
        """The metrics of the step. Every rank must hold the same keys (the same stages and
        requests give the same stats on every rank)."""
        keys = sorted(self.sums)
        if reduction.sum_over_replicas is not None and keys:
            flat = torch.tensor([self.sums[k] for k in keys], dtype=torch.float64, device=device)
            reduction.sum_over_replicas(flat)
            self.sums = {k: v for k, v in zip(keys, flat.tolist())}
        return metric_values(self.sums)
