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

Metrics: the model reports (numerator, denominator) sums (`DSAOutput.stats`), left on the
device; `MetricSums` adds them over micro-batches in float64 on the device, sums them over ranks
in one all-reduce and reads them back once per step, then divides; derived metrics
(`indexer_kl_captured`) are computed once from the reduced values (`metric_values`). The
arithmetic is that of Python floats (fp32 values widened to float64, added in micro-batch order),
so the numbers are those of reading each value back as it came.
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


class _CrossEntropySum(torch.autograd.Function):
    """sum over valid rows of -log_softmax(logits)[label], computed in fp32 one row chunk at a time.
    Saves the logits (held by the caller anyway) and the per-row log-sum-exp [N]; the backward
    writes softmax - onehot chunk by chunk into one gradient of the logits' dtype. No fp32 copy
    of the whole [N, V] logits and no fp32 log-softmax is kept (F.cross_entropy(logits.float())
    keeps both: 2 x 4 bytes per logit)."""

    @staticmethod
    def forward(ctx, logits, labels, chunk):  # logits [N, V], labels [N] (IGNORE_INDEX = no target)
        N = logits.shape[0]
        valid = labels != IGNORE_INDEX
        target = labels.clamp(min=0).long()[:, None]
        lse = torch.empty(N, dtype=torch.float32, device=logits.device)
        total = torch.zeros((), dtype=torch.float64, device=logits.device)
        for r0 in range(0, N, chunk):
            x = logits[r0 : r0 + chunk].float()
            lse[r0 : r0 + chunk] = torch.logsumexp(x, dim=-1)
            nll = lse[r0 : r0 + chunk] - x.gather(1, target[r0 : r0 + chunk]).squeeze(1)
            total += torch.where(valid[r0 : r0 + chunk], nll, torch.zeros_like(nll)).sum()
        ctx.save_for_backward(logits, labels, lse)
        ctx.chunk = chunk
        return total.float()

    @staticmethod
    def backward(ctx, grad_total):
        logits, labels, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        valid = (labels != IGNORE_INDEX)[:, None]
        target = labels.clamp(min=0).long()[:, None]
        for r0 in range(0, logits.shape[0], ctx.chunk):
            # a copy in every dtype (`.float()` of fp32 logits is the logits themselves, which
            # the in-place ops below would overwrite)
            probs = logits[r0 : r0 + ctx.chunk].to(torch.float32, copy=True)
            probs = torch.exp_(probs.sub_(lse[r0 : r0 + ctx.chunk, None]))
            probs.scatter_add_(1, target[r0 : r0 + ctx.chunk], torch.full_like(probs[:, :1], -1.0))
            probs.mul_(valid[r0 : r0 + ctx.chunk] * grad_total)
            grad[r0 : r0 + ctx.chunk] = probs
        return grad, None, None


def cross_entropy_sum(
    logits: torch.Tensor, labels: torch.Tensor, chunk_elems: int = 1 << 22
) -> tuple[torch.Tensor, torch.Tensor]:
    """(CE summed over the valid labels, their number as a 0-dim int64 tensor on the labels'
    device): logits [..., V], labels [...] with IGNORE_INDEX. The value and gradient of
    F.cross_entropy(logits.float(), reduction="sum"), with fp32 blocks of at most chunk_elems
    logits at a time."""
    V = logits.shape[-1]
    flat_labels = labels.reshape(-1)
    ce = _CrossEntropySum.apply(logits.reshape(-1, V), flat_labels, max(1, chunk_elems // V))
    return ce, (flat_labels != IGNORE_INDEX).sum()


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
    """Counted on the device ([micro-batches, 3] float64, summed over micro-batches and ranks),
    read back once."""
    device = micro_batches[0]["input_ids"].device
    per_micro_batch = torch.stack([
        torch.stack([
            (mb["labels"] != IGNORE_INDEX).sum().double(),
            (mtp_targets(mb["labels"]) != IGNORE_INDEX).sum().double(),
            torch.full((), float(mb["input_ids"].numel()), dtype=torch.float64, device=device),
        ])
        for mb in micro_batches
    ]).to(device)
    lm, mtp, queries = _sum(per_micro_batch.sum(0), reduction.sum_over_data).tolist()
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


def metric_values(sums: dict[str, tuple[float, float]]) -> dict[str, float]:
    """{name: [numerator, denominator]} -> {name: value}, plus the derived metrics (once)."""
    values = {key: num / den for key, (num, den) in sums.items() if den > 0}
    if "indexer_kl" in values and values.get("indexer_kl_uniform", 0) > 0:
        values["indexer_kl_captured"] = 1.0 - values["indexer_kl"] / values["indexer_kl_uniform"]
    return values


def _widened(x: torch.Tensor | float) -> torch.Tensor | float:
    """A stat as float64: a device tensor stays on its device (no read-back), a float stays one."""
    return x.detach().double() if isinstance(x, torch.Tensor) else float(x)


class MetricSums:
    """Numerator / denominator sums of the model's stats over micro-batches, reduced over ranks.
    A sum is a 0-dim float64 device tensor while any of its terms is one (Python float otherwise);
    `values` reads them all back in one transfer per step."""

    def __init__(self):
        self.sums: dict[str, list[torch.Tensor | float]] = {}

    def add(self, stats: dict[str, tuple[torch.Tensor | float, torch.Tensor | float]]) -> None:
        for key, (num, den) in stats.items():
            acc = self.sums.setdefault(key, [0.0, 0.0])
            acc[0] = acc[0] + _widened(num)
            acc[1] = acc[1] + _widened(den)

    def values(self, reduction: Reduction, device=None) -> dict[str, float]:
        """The metrics of the step. Every rank must hold the same keys (the same stages and
        requests give the same stats on every rank)."""
        keys = sorted(self.sums)
        cells = [x for k in keys for x in self.sums[k]]
        on_device = [x for x in cells if isinstance(x, torch.Tensor)]
        if keys and (on_device or reduction.sum_over_replicas is not None):
            device = device if device is not None or not on_device else on_device[0].device
            flat = torch.stack([
                x.to(device) if isinstance(x, torch.Tensor) else torch.full((), x, dtype=torch.float64, device=device)
                for x in cells
            ]).view(len(keys), 2)  # [metrics, (numerator, denominator)]
            if reduction.sum_over_replicas is not None:
                reduction.sum_over_replicas(flat)
            self.sums = {k: v for k, v in zip(keys, flat.tolist())}
        return metric_values(self.sums)
