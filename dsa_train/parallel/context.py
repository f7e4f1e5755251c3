"""Context parallelism: each CP rank holds 2 of the sequence's 2*CP chunks, chunk r and chunk
2*CP-1-r, so causal attention work is the same on every rank (load balance).

Every CP rank receives the whole micro-batch (data is sharded by DP rank only) and keeps its
chunks: `DSAForCausalLM.forward` (the one forward) runs embeddings, MLA projections, the indexer,
MoE, the LM head and MTP on local tokens only when `model.context_parallel` is set
(`parallelize_model` sets it to a `ContextParallel`). Attention gets the sequence's
`ContextParallelHandle` in its request: it all-gathers only the 576-dim latent KV and the 128-dim
indexer key, selects top-k over the whole sequence for its local queries (`dsa_kernels.indexer_topk`
with `query_positions`), and runs dense attention as the sparse kernel over every visible key.
The model returns sums over local tokens; `dsa_train.loss` divides them by the step's global
counts, so they add up over CP ranks to the single-process values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsa_train.parallel.comm import all_gather_autograd
from dsa_train.parallel.groups import ParallelState


def local_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions of CP rank `rank`'s tokens: chunks rank and 2*cp-1-rank of 2*cp."""
    if seq_len % (2 * cp):
        raise ValueError(
            f"context parallel {cp} splits a sequence into {2 * cp} equal chunks: data.seq_len={seq_len} "
            f"must be a multiple of {2 * cp}"
        )
    L = seq_len // (2 * cp)
    a = torch.arange(rank * L, (rank + 1) * L, device=device)
    b = torch.arange((2 * cp - 1 - rank) * L, (2 * cp - rank) * L, device=device)
    return torch.cat([a, b])


@dataclass
class ContextParallelHandle:
    """What attention needs of context parallelism for one sequence: this rank's query positions
    and the gather of per-token tensors over the CP group."""

    group: object
    size: int
    rank: int
    positions: torch.Tensor  # [T_loc] global positions of this rank's tokens
    inverse: torch.Tensor  # [T] index into the rank-ordered all-gather, for each global position

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T_loc, ...] on every rank -> [B, T, ...] in sequence order (autograd: the
        gradient of the gathered tensor is summed over the CP ranks and sliced back)."""
        return all_gather_autograd(x, 1, self.group).index_select(1, self.inverse)


class ContextParallel:
    """Context parallelism of a model (`model.context_parallel`): gives the model, per
    sequence length, the handle its attention layers receive."""

    def __init__(self, state: ParallelState):
        self.group, self.size, self.rank = state.cp_group, state.sizes.context, state.cp_rank
        self._cache: dict = {}

    def for_sequence(self, seq_len: int, device) -> ContextParallelHandle:
        key = (seq_len, str(device))
        if key not in self._cache:
            gathered = torch.cat([local_positions(seq_len, self.size, i, device) for i in range(self.size)])
            self._cache[key] = ContextParallelHandle(
                self.group, self.size, self.rank, local_positions(seq_len, self.size, self.rank, device),
                torch.argsort(gathered),
            )
        return self._cache[key]
