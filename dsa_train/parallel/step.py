"""One optimizer step on many ranks, with losses scaled so the update equals the single-process
run over the same global batch. The step itself is the single-process
`dsa_train.engine.step.forward_backward`; this module only scales the model's losses before it
weighs them and reduces the reported metrics after.

Per rank (data-parallel rank d, context-parallel rank c), micro-batch i of M, the single-process
step computes  (lm_coef * lm_i + mtp_coef * mtp_i) * n_i / N_rank  +  idx_coef * idx_i / M;
`LossScale` multiplies the model's losses first:
    lm_i, mtp_i  *=  DP * CP * N_rank / N          idx_i  *=  CP
* n_i: valid labels of micro-batch i, N_rank: of this rank's step, N: of the whole step summed
  over the DP ranks (an all-reduce of counts), so the LM term is a token mean over the global batch;
* with context parallelism lm_i and idx_i are this rank's partial sums (its tokens' losses divided
  by the whole sequence's count: `ContextParallelLM`), which add up over CP to the full values;
* DeepSpeed averages gradients over its data-parallel group (DP x CP). The LM term is a token
  mean over the global batch already, so DP * CP undoes the averaging (a sum over ranks); the
  indexer term is a mean over this rank's M micro-batches, so only CP is undone (sum over CP,
  mean over DP = the mean over the global batch's DP * M micro-batches).
Tensor-parallel ranks see the same tokens and compute the same losses: no scaling.
`reduce_metrics` turns the ranks' (scaled) values back into the single-process ones.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dsa_train.config import StageConfig
from dsa_train.engine.step import IGNORE_INDEX
from dsa_train.engine.step import forward_backward as local_forward_backward
from dsa_train.parallel.groups import ParallelState

NOT_REDUCED = ("lr", "grad_norm", "nonfinite_skipped")


class LossScale:
    """Wraps `model.forward` so that its LM, MTP and indexer losses come out multiplied by this
    rank's factors; `set_for` computes them for the micro-batches of the next step."""

    def __init__(self, model: torch.nn.Module):
        self.lm: float | None = None
        self.indexer: float | None = None
        forward = model.forward

        def scaled_forward(*args, **kwargs):
            out = forward(*args, **kwargs)
            if self.lm is not None:
                if out.lm_loss is not None:
                    out.lm_loss = out.lm_loss * self.lm
                if out.mtp_loss is not None:
                    out.mtp_loss = out.mtp_loss * self.lm
                if out.indexer_loss is not None:
                    out.indexer_loss = out.indexer_loss * self.indexer
            return out

        model.forward = scaled_forward

    def set_for(self, micro_batches: list[dict[str, torch.Tensor]], state: ParallelState) -> None:
        sizes = state.sizes
        local = float(sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro_batches))
        total = torch.tensor([local], dtype=torch.float64)
        dist.all_reduce(total, group=state.dp_group)
        self.lm = sizes.data * sizes.context * local / max(float(total.item()), 1.0)
        self.indexer = float(sizes.context)


def reduce_metrics(step: dict[str, float], state: ParallelState) -> dict[str, float]:
    """The single-process values of a step's metrics from every rank's: losses are scaled partial
    sums, model metrics averages, so both are summed over DP x CP and divided by DP x CP (one
    all-reduce). lr, grad_norm and the skip count are the same on every rank already."""
    scale = state.sizes.data * state.sizes.context
    keys = sorted(k for k, v in step.items() if k not in NOT_REDUCED and isinstance(v, (int, float)))
    values = torch.tensor([float(step[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(values, group=state.dense_dp_group)
    reduced = dict(step)
    for k, v in zip(keys, values.tolist()):
        reduced[k] = v / scale
    if "indexer_kl" in reduced and reduced.get("indexer_kl_uniform", 0) > 0:
        reduced["indexer_kl_captured"] = 1.0 - reduced["indexer_kl"] / reduced["indexer_kl_uniform"]
    return reduced


def forward_backward(
    engine, micro_batches: list[dict[str, torch.Tensor]], stage: StageConfig, state: ParallelState,
    topk_recall_queries: int = 0,
) -> dict[str, float]:
    """The distributed trainer's step without the trainer: scale, accumulate, reduce. The model
    behind `engine` must carry a `LossScale` (installed here on first use)."""
    loss_scale = getattr(engine.module, "_dsa_loss_scale", None)
    if loss_scale is None:
        loss_scale = engine.module._dsa_loss_scale = LossScale(engine.module)
    loss_scale.set_for(micro_batches, state)
    return reduce_metrics(local_forward_backward(engine, micro_batches, stage, topk_recall_queries), state)


def train_step(engine, micro_batches, stage: StageConfig, state: ParallelState, topk_recall_queries: int = 0):
    lr = engine.lr
    metrics = forward_backward(engine, micro_batches, stage, state, topk_recall_queries)
    metrics["grad_norm"] = engine.step()
    metrics["lr"] = lr
    return metrics
