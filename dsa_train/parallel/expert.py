"""Expert parallelism: the routed experts of every MoE layer sharded over the expert-parallel
group, tokens moved to their experts' ranks by a dropless all-to-all and back.

The MoE forward is the model's (`dsa_train.model.moe.MoE`: route -> dispatch -> experts ->
combine); expert parallelism gives each layer, through its one seam `MoE.set_layout`, the token
dispatcher (`AllToAllDispatcher`), which also says which experts the rank keeps. Per MoE layer on
EP rank r (E experts, EP ranks, E/EP local experts [r*E/EP, (r+1)*E/EP)):
  1. route this rank's tokens (the model's `Router`, unchanged);
  2. dispatch: sort the (token, expert) slots by expert -- hence by destination rank --, exchange
     the per-rank slot counts, then the token vectors (all_to_all_single with autograd: its
     backward is the reverse all-to-all), no capacity limit, nothing dropped;
  3. the local experts on the received tokens, sorted by expert: three grouped GEMMs
     (`dsa_train.model.grouped_experts`) when `parallel.grouped_experts`, else a loop;
  4. combine: the outputs go back by the reverse all-to-all, weighted and added per token.
The shared experts run locally. Expert parameters keep their global names
(`mlp.experts.{e}.gate_proj.weight`) and carry a `Sharding` record naming their expert group:
DeepSpeed reduces their gradients over the expert-data-parallel group
(`dsa_train.parallel.deepspeed_compat` tells DeepSpeed). Expert loads are summed over the
router's replicas (DP x CP) at the aux-loss-free bias update (`MoE.sum_loads`), so every replica's
bias takes the single-process step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_to_all_single

from dsa_train.model.moe import MoE
from dsa_train.parallel.groups import ParallelState
from dsa_train.parallel.sharding import Sharding, set_sharding


def _counts_all_to_all(send_counts: torch.Tensor, group) -> torch.Tensor:
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts, group=group)
    return recv


class AllToAllDispatcher:
    """The expert-parallel token dispatcher (the interface of `dsa_train.model.moe.LocalDispatcher`)."""

    def __init__(self, n_experts: int, state: ParallelState):
        self.n_experts = n_experts
        self.ep_size, self.group = state.sizes.expert, state.ep_group
        self.per_rank = n_experts // self.ep_size
        self.first = state.ep_rank * self.per_rank
        self.local_experts = range(self.first, self.first + self.per_rank)

    def dispatch(self, tokens: torch.Tensor, expert_ids: torch.Tensor):
        top_k = expert_ids.shape[1]
        flat = expert_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # slots grouped by expert, hence by rank
        expert_of_slot = flat[order]
        send_counts = torch.bincount(expert_of_slot // self.per_rank, minlength=self.ep_size)
        x_send = tokens[order // top_k]
        recv_counts = _counts_all_to_all(send_counts, self.group)
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
        x_recv = all_to_all_single(
            x_send.new_empty((sum(recv_splits), tokens.shape[-1])), x_send, recv_splits, send_splits, group=self.group
        )
        e_recv = torch.empty(sum(recv_splits), dtype=expert_of_slot.dtype, device=tokens.device)
        dist.all_to_all_single(e_recv, expert_of_slot.contiguous(), recv_splits, send_splits, group=self.group)
        # received tokens come grouped by source rank: sort them by local expert
        local = e_recv - self.first
        local_order = torch.argsort(local, stable=True)
        counts = torch.bincount(local, minlength=self.per_rank).tolist()
        return x_recv[local_order], counts, (order, local_order, send_splits, recv_splits)

    def combine(self, y: torch.Tensor, state, weights: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        order, local_order, send_splits, recv_splits = state
        y_recv = torch.zeros_like(y).index_copy(0, local_order, y)  # back to the received order
        y_back = all_to_all_single(
            y_recv.new_empty((sum(send_splits), y.shape[-1])), y_recv, send_splits, recv_splits, group=self.group
        )
        weight_of_slot = weights.reshape(-1)[order]
        token_of_slot = order // weights.shape[1]
        return torch.zeros_like(tokens).index_add(0, token_of_slot, y_back * weight_of_slot[:, None].to(tokens.dtype))


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
        dispatcher = AllToAllDispatcher(module.n_experts, state) if ep > 1 else None
        module.set_layout(grouped_gemm=grouped, sum_loads=sum_loads, dispatcher=dispatcher)
        if dispatcher is not None:
            for p in module.experts.parameters():
                set_sharding(p, Sharding(expert_group=expert_group_name(state)))


def expert_group_name(state: ParallelState) -> str:
    return f"ep_size_{state.sizes.expert}"
