"""How a step's numbers combine over the ranks of a parallel layout (`dsa_train.loss.Reduction`).
The step itself is `dsa_train.trainer.step` for one process and for N ranks.

* token counts are summed over data-parallel ranks (every context-parallel rank holds the whole
  micro-batch, so its counts are not added again);
* metric sums over DP x CP: each rank's sums cover the tokens it holds (CP) of its sequences (DP);
* the engine (DeepSpeed) averages gradients over DP x CP, the ranks holding replicas of a dense
  parameter; the loss is multiplied by their number so that the average is the sum.
Tensor-parallel ranks see the same tokens and compute the same losses: nothing to combine (the
MoE's router and routed experts run on each TP rank's share of them; their gradients are summed
over TP by hooks, `dsa_train.parallel.tensor.sum_over_group`, before the engine sees them).
"""

from __future__ import annotations

import torch.distributed as dist

from dsa_train.loss import Reduction
from dsa_train.parallel.groups import ParallelState


def parallel_reduction(state: ParallelState) -> Reduction:
    def over(group, size):
        if size == 1:
            return None
        return lambda t: dist.all_reduce(t, group=group)

    return Reduction(
        sum_over_data=over(state.dp_group, state.sizes.data),
        sum_over_replicas=over(state.dense_dp_group, state.sizes.dense_dp),
        gradient_replicas=state.sizes.dense_dp,
    )
