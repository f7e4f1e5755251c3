"""Expert parallelism: the routed experts of every MoE layer sharded over the expert-parallel
group, tokens moved to their experts' ranks by a dropless all-to-all and back.

The MoE forward is the model's (`dsa_train.model.moe.MoE`: route -> dispatch -> experts ->
combine); expert parallelism gives each layer, through its one seam `MoE.set_layout`, the token
dispatcher (`AllToAllDispatcher`), which also says which experts the rank keeps. Per MoE layer on
EP rank r (E experts, EP ranks, L = E/EP local experts [r*L, (r+1)*L)):
  1. route this rank's tokens (the model's `Router`, unchanged); tokens per expert on the device;
  2. dispatch: the (token, destination rank) pairs, each token once per rank that holds any of
     its experts; ONE counts all-to-all (per destination: pairs, and tokens per expert), whose
     result is copied to the host without blocking and waited for at one point; then the token
     rows and their routing weights for the destination's experts (all_to_all_single with
     autograd: the backward is the reverse all-to-all on the same split sizes, no host read);
     no capacity limit, nothing dropped;
  3. the receiving rank expands the rows to (row, local expert) slots sorted by expert (one sort,
     `ExpertSlots`) and runs its experts: three grouped GEMMs (`dsa_train.model.grouped_experts`)
     when `parallel.grouped_experts`, else a loop;
  4. combine: each row's expert outputs are weighted and summed on the expert rank, one row per
     pair goes back by the reverse all-to-all and is added per token.
The shared experts run locally (on CUDA on a side stream, beside the all-to-all). Expert
parameters keep their global names (`mlp.experts.{e}.gate_proj.weight`) and carry a `Sharding`
record naming their expert group: DeepSpeed reduces their gradients over the expert-data-parallel
group (`dsa_train.parallel.deepspeed_compat` tells DeepSpeed). Expert loads are summed over the
router's replicas (DP x CP) at the aux-loss-free bias update (`MoE.sum_loads`), so every replica's
bias takes the single-process step. Under tensor parallelism each TP rank routes and dispatches its
share of the tokens (`dsa_train.parallel.tensor.TensorParallelTokens`, which sums the loads over TP
in the forward), within its own EP group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_to_all_single

from dsa_train.model.moe import ExpertSlots, HostCopy, MoE, routing_table
from dsa_train.parallel.groups import ParallelState
from dsa_train.sharding import Sharding, set_sharding


def destination_pairs(dest: torch.Tensor, ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """dest [N, k] (the EP rank of each routed slot) -> the (token, rank) pairs, each once (the
    first of a token's slots on that rank): (slot ids [N*k] sorted by (rank, token) with the
    repeated slots last, pairs per rank [ranks]). Both on the device, no host read."""
    n_tokens = dest.shape[0]
    earlier_same = (dest[:, :, None] == dest[:, None, :]).tril(diagonal=-1).any(-1)  # [N, k]
    token = torch.arange(n_tokens, device=dest.device)[:, None]
    key = torch.where(earlier_same, ranks * n_tokens, dest * n_tokens + token).reshape(-1)
    bucket = torch.where(earlier_same, ranks, dest).reshape(-1)
    pairs_per_rank = torch.zeros(ranks + 1, dtype=torch.long, device=dest.device).index_add_(0, bucket, torch.ones_like(bucket))
    return torch.argsort(key), pairs_per_rank[:ranks]


class AllToAllDispatcher:
    """The expert-parallel `TokenDispatcher` (dsa_train/model/moe.py; the other is `LocalDispatcher`).

    Each token goes once to each EP rank holding at least one of its experts (de-duplicated per
    rank), with its routing weights for that rank's experts; the rank runs its experts, weights
    their outputs and sums them per token, and sends one row back. Per forward: one counts
    all-to-all ([EP, 1 + local experts] int64) and ONE host wait for the split sizes; per direction
    two payload all-to-alls (token rows [pairs, h], routing weights [pairs, local experts] fp32) and
    one back (summed outputs [pairs, h]). The backward reads nothing from the host (the splits are
    kept from the forward)."""

    def __init__(self, n_experts: int, group):
        self.n_experts = n_experts
        self.group = group
        self.ep_size = dist.get_world_size(group)
        self.per_rank = n_experts // self.ep_size
        self.first = dist.get_rank(group) * self.per_rank
        self.local_experts = range(self.first, self.first + self.per_rank)
        self.last_send_splits: list[int] = []  # rows sent to each EP rank by the last forward

    def dispatch(self, tokens: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor):
        n_tokens, top_k = expert_ids.shape
        ranks, per_rank = self.ep_size, self.per_rank
        dest = expert_ids // per_rank  # [N, k]
        pair_slot, pairs_per_rank = destination_pairs(dest, ranks)
        # one counts exchange: per destination [pairs, tokens for each of its experts]
        send_counts = torch.cat([pairs_per_rank[:, None], counts.view(ranks, per_rank)], dim=1)  # [EP, 1 + L]
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        # traced plan (fake tensors, no values): balanced routing, every slot its own row
        slots_per_rank = max(expert_ids.numel() // ranks, 1)
        balanced = [slots_per_rank] * (2 * ranks) + [ranks * max(expert_ids.numel() // self.n_experts, 1)] * per_rank
        sizes = HostCopy(torch.cat([pairs_per_rank, recv_counts[:, 0], recv_counts[:, 1:].sum(0)]), balanced)
        # while the sizes travel to the host: each token's routing weights for every expert
        table = routing_table(expert_ids, weights, self.n_experts)  # [N, E]
        values = sizes.values()  # the forward's one host wait
        send_splits, recv_splits, local_counts = values[:ranks], values[ranks : 2 * ranks], values[2 * ranks :]
        self.last_send_splits = send_splits
        pair_slot = pair_slot[: sum(send_splits)]
        token_of_pair, rank_of_pair = pair_slot // top_k, dest.reshape(-1)[pair_slot]  # [P]
        w_send = table.view(n_tokens, ranks, per_rank)[token_of_pair, rank_of_pair]  # [P, L]
        n_recv = sum(recv_splits)
        x_recv = all_to_all_single(tokens.new_empty((n_recv, tokens.shape[-1])), tokens[token_of_pair],
                                   recv_splits, send_splits, group=self.group)
        w_recv = all_to_all_single(w_send.new_empty((n_recv, per_rank)), w_send, recv_splits, send_splits,
                                   group=self.group)
        slots = ExpertSlots(w_recv, sum(local_counts))  # received rows come by source rank, then token
        return slots.gather(x_recv), local_counts, (slots, token_of_pair, send_splits, recv_splits, n_tokens)

    def combine(self, y: torch.Tensor, state) -> torch.Tensor:
        slots, token_of_pair, send_splits, recv_splits, n_tokens = state
        z_recv = slots.weighted_sum(y)  # [R, h]: one row per received token
        z_back = all_to_all_single(z_recv.new_empty((sum(send_splits), y.shape[-1])), z_recv, send_splits,
                                   recv_splits, group=self.group)
        return z_back.new_zeros(n_tokens, y.shape[-1]).index_add(0, token_of_pair, z_back)


def shard_experts(model: torch.nn.Module, state: ParallelState, grouped: bool = True) -> None:
    """Expert parallelism applied to every MoE layer (in place, through `MoE.set_layout`): grouped
    GEMMs or a loop, the router loads summed over the router's replicas, and with EP > 1 the
    all-to-all dispatcher (the layer keeps only this rank's experts, whose parameters get their
    expert-group record). Also with expert_parallel=1 the local dispatcher runs every expert every
    step (on zero tokens if none were routed to it), as in one process."""
    ep = state.sizes.expert
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        sum_loads = None
        if state.sizes.dense_dp > 1:
            group = state.dense_dp_group
            sum_loads = lambda t, group=group: dist.all_reduce(t, group=group)  # noqa: E731
        dispatcher = AllToAllDispatcher(module.n_experts, state.ep_group) if ep > 1 else None
        module.set_layout(grouped_gemm=grouped, sum_loads=sum_loads, dispatcher=dispatcher)
        if dispatcher is not None:
            for p in module.experts.parameters():
                set_sharding(p, Sharding(expert_group=expert_group_name(state)))


def expert_group_name(state: ParallelState) -> str:
    return f"ep_size_{state.sizes.expert}"


def use_grouped_experts(model: torch.nn.Module, grouped: bool) -> None:
    """One process (`parallel.grouped_experts`, default on): every MoE layer's experts as grouped
    GEMMs (`dsa_train.model.grouped_experts`: one `torch._grouped_mm` per projection, its sizes on
    the device) instead of a loop of row-chunked MLPs per expert; the weights packed into one
    storage per projection. N ranks get it from `shard_experts`."""
    for module in model.modules():
        if isinstance(module, MoE):
            module.set_layout(grouped_gemm=grouped)
