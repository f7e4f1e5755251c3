"""One optimizer step on many ranks, with losses scaled so the update equals the single-process
run over the same global batch.

Per rank (data-parallel rank d, context-parallel rank c), micro-batch i of M:
    loss_i = DP * CP * lm_coef * lm_i * n_i / N  +  CP * idx_coef * idx_i / M
* n_i: valid labels of micro-batch i, N: valid labels of the whole step summed over the DP ranks
  (an all-reduce of counts), so the LM term is a token mean over the global batch;
* with context parallelism lm_i and idx_i are this rank's partial sums (its tokens' losses divided
  by the whole sequence's count: `ContextParallelLM`), which add up over CP to the full values;
* DeepSpeed averages gradients over its data-parallel group (DP x CP). The LM term is a token
  mean over the global batch already, so DP * CP undoes the averaging (a sum over ranks); the
  indexer term is a mean over this rank's M micro-batches, so only CP is undone (sum over CP,
  mean over DP = the mean over the global batch's DP * M micro-batches).
Tensor-parallel ranks see the same tokens and compute the same losses: no scaling.
Every rank runs a backward for every micro-batch (collectives in the backward must match).
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from dsa_train.config import StageConfig
from dsa_train.engine.step import IGNORE_INDEX, forward_kwargs
from dsa_train.parallel.groups import ParallelState


def _all_reduce(values: list[float], group, op=dist.ReduceOp.SUM) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=op, group=group)
    return t.tolist()


def forward_backward(
    engine, micro_batches: list[dict[str, torch.Tensor]], stage: StageConfig, state: ParallelState,
    topk_recall_queries: int = 0,
) -> dict[str, float]:
    kwargs = forward_kwargs(stage)
    uses_lm = stage.lm_loss_coef > 0
    M = len(micro_batches)
    dp, cp = state.sizes.data, state.sizes.context
    scale = dp * cp
    lm_scale, idx_scale = float(dp * cp), float(cp)
    valid = [int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro_batches]
    (total_valid,) = _all_reduce([float(sum(valid))], state.dp_group)
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
        scaled = torch.zeros((), device=mb["input_ids"].device)
        if uses_lm:
            if valid[i] > 0:
                weight = valid[i] / max(total_valid, 1.0)
                term = stage.lm_loss_coef * weight * out.lm_loss
                totals["lm_loss"] += weight * float(out.lm_loss.detach())
            else:  # keep the graph (and its collectives) alive with a zero contribution
                term = 0.0 * out.logits.float().sum()
            loss, scaled = loss + term, scaled + lm_scale * term
        if kwargs["indexer_loss"]:
            term = stage.indexer_loss_coef * out.indexer_loss / M
            totals["indexer_loss"] += float(out.indexer_loss.detach()) / M
            loss, scaled = loss + term, scaled + idx_scale * term
        totals["loss"] += float(loss.detach())
        if scaled.requires_grad:
            engine.backward(scaled)
        for key, value in out.metrics.items():
            model_metrics[key] += value / M
    # Reported values: LM and total losses sum over DP (token-weighted) and CP (partial sums);
    # the indexer loss sums over CP and averages over DP; model metrics average over DP x CP.
    keys = sorted(totals)
    reduced = _all_reduce([totals[k] for k in keys], state.dense_dp_group)
    metrics = {}
    for k, v in zip(keys, reduced):
        metrics[k] = v / dp if k == "indexer_loss" else v
    if "loss" in metrics and "indexer_loss" in metrics:
        lm = metrics.get("lm_loss", 0.0)
        metrics["loss"] = stage.lm_loss_coef * lm + stage.indexer_loss_coef * metrics["indexer_loss"]
    mkeys = sorted(model_metrics)
    if mkeys:
        mvals = _all_reduce([model_metrics[k] for k in mkeys], state.dense_dp_group)
        for k, v in zip(mkeys, mvals):
            metrics[k] = v / scale
    if "indexer_kl" in metrics and metrics.get("indexer_kl_uniform", 0) > 0:
        metrics["indexer_kl_captured"] = 1.0 - metrics["indexer_kl"] / metrics["indexer_kl_uniform"]
    return metrics


def train_step(engine, micro_batches, stage: StageConfig, state: ParallelState, topk_recall_queries: int = 0):
    lr = engine.lr
    metrics = forward_backward(engine, micro_batches, stage, state, topk_recall_queries)
    metrics["grad_norm"] = engine.step()
    metrics["lr"] = lr
    return metrics
