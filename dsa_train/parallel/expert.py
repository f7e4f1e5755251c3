"""Expert parallelism: the routed experts of every MoE layer sharded over the expert-parallel
group, tokens moved to their experts' ranks by a dropless all-to-all and back.

Per MoE layer on EP rank r (E experts, EP ranks, E/EP local experts [r*E/EP, (r+1)*E/EP)):
  1. route this rank's tokens (DeepSeek routing: sigmoid scores + correction bias, group-limited
     top-k, `Router` unchanged);
  2. sort the (token, expert) slots by expert -- hence by destination rank -- and exchange the
     per-rank slot counts, then the token vectors (all_to_all_single with autograd: its backward
     is the reverse all-to-all), no capacity limit, nothing dropped;
  3. run the local experts on the received tokens (sorted by expert): three grouped GEMMs
     (`torch._grouped_mm`, CPU and CUDA) when `parallel.grouped_experts`, else a loop;
  4. send the outputs back by the reverse all-to-all, weight them and add them per token.
With one EP rank the all-to-alls are skipped.
The shared experts run locally. Expert parameters keep their global names
(`mlp.experts.{e}.gate_proj.weight`) and are marked for DeepSpeed's MoE parameter groups
(`allreduce=False`, `group_name`): their gradients are reduced over the expert-data-parallel
group only. Expert loads are counted per rank and summed over the router's replicas (DP x CP)
at the aux-loss-free bias update, so every replica's bias takes the single-process step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.nn.functional import all_to_all_single

from dsa_train.model.moe import MoE
from dsa_train.parallel.groups import ParallelState


def _counts_all_to_all(send_counts: torch.Tensor, group) -> torch.Tensor:
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts, group=group)
    return recv


def _deepspeed_moe_base() -> type:
    """DeepSpeed detects MoE layers by class (it then configures expert-data-parallel groups in
    ZeRO); subclassing its MoE (without running its __init__) makes ours count."""
    try:
        from deepspeed.moe.layer import MoE as DeepSpeedMoE
    except ImportError:  # pragma: no cover
        return nn.Module
    return DeepSpeedMoE


class ExpertDispatchMoE(MoE):
    """A drop-in `MoE` (the model's isinstance checks, metrics and bias updates keep working)."""

    def __init__(self, moe: MoE, state: ParallelState, grouped: bool = True):
        nn.Module.__init__(self)
        ep = state.sizes.expert
        self.ep_size, self.ep_rank, self.group = ep, state.ep_rank, state.ep_group
        self.n_experts = len(moe.experts)
        self.num_experts = self.n_experts
        self.per_rank = self.n_experts // ep
        self.first = self.ep_rank * self.per_rank
        self.gate = moe.gate
        self.group_name = f"ep_size_{ep}"
        self.experts = nn.ModuleDict(
            {str(e): moe.experts[e] for e in range(self.first, self.first + self.per_rank)}
        )
        if ep > 1:
            for p in self.experts.parameters():
                p.allreduce = False
                p.group_name = self.group_name
        self.shared_experts = moe.shared_experts
        self.register_buffer("last_expert_load", torch.zeros(self.n_experts), persistent=False)
        self.register_buffer("load_since_update", torch.zeros(self.n_experts), persistent=False)
        self._state = state
        self.grouped = grouped

    @torch.no_grad()
    def update_bias(self, rate: float) -> None:
        """The aux-loss-free bias step on the loads of the whole global batch: summed over the
        ranks holding replicas of this router (DP x CP), so every replica takes the same step."""
        if self._state.sizes.dense_dp > 1:
            dist.all_reduce(self.load_since_update, group=self._state.dense_dp_group)
            dist.all_reduce(self.last_expert_load, group=self._state.dense_dp_group)
        super().update_bias(rate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        expert_ids, weights = self.gate(tokens)
        top_k = expert_ids.shape[1]
        flat = expert_ids.reshape(-1)
        load = torch.bincount(flat, minlength=self.n_experts)
        self.last_expert_load = load.detach().float()
        if self.training:
            self.load_since_update += self.last_expert_load

        order = torch.argsort(flat, stable=True)
        token_of_slot = order // top_k
        expert_of_slot = flat[order]
        send_counts = torch.bincount(expert_of_slot // self.per_rank, minlength=self.ep_size)
        x_send = tokens[token_of_slot]
        if self.ep_size > 1:
            recv_counts = _counts_all_to_all(send_counts, self.group)
            send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
            x_recv = all_to_all_single(
                x_send.new_empty((sum(recv_splits), shape[-1])), x_send, recv_splits, send_splits, group=self.group
            )
            e_recv = torch.empty(sum(recv_splits), dtype=expert_of_slot.dtype, device=x.device)
            dist.all_to_all_single(e_recv, expert_of_slot.contiguous(), recv_splits, send_splits, group=self.group)
        else:
            x_recv, e_recv = x_send, expert_of_slot

        # local experts over the received tokens, grouped by expert
        local = e_recv - self.first
        local_order = torch.argsort(local, stable=True)
        counts = torch.bincount(local, minlength=self.per_rank).tolist()
        # Every local expert runs, on zero tokens if none came: the same modules (and, under ZeRO-3,
        # the same parameter gathers) on every rank, and a (zero) gradient for each expert.
        if self.grouped and _grouped_mm_available():
            y_sorted = [self._grouped_experts(x_recv[local_order], counts)]
        else:
            y_sorted = []
            start = 0
            for i, n in enumerate(counts):
                idx = local_order[start : start + n]
                y_sorted.append(self.experts[str(self.first + i)](x_recv[idx]))
                start += n
        y_recv = torch.zeros_like(x_recv).index_copy(0, local_order, torch.cat(y_sorted))
        if self.ep_size > 1:
            y_back = all_to_all_single(
                y_recv.new_empty((sum(send_splits), shape[-1])), y_recv, send_splits, recv_splits, group=self.group
            )
        else:
            y_back = y_recv
        weight_of_slot = weights.reshape(-1)[order]
        out = torch.zeros_like(tokens).index_add(0, token_of_slot, y_back * weight_of_slot[:, None].to(tokens.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        return out.view(shape)


def _grouped_mm_available() -> bool:
    return hasattr(torch, "_grouped_mm")


def _contiguous_grad(t: torch.Tensor) -> torch.Tensor:
    # grouped_mm's backward needs a materialized gradient (an expanded one, e.g. from .sum(), fails)
    if t.requires_grad:
        t.register_hook(lambda g: g.contiguous())
    return t


def grouped_expert_mlp(x: torch.Tensor, offs: torch.Tensor, w_gate, w_up, w_down) -> torch.Tensor:
    """SwiGLU experts as three grouped GEMMs over tokens sorted by expert: x [N, h], offs [E] int32
    (cumulative token counts), w_gate/w_up [E, I, h], w_down [E, h, I] (nn.Linear layout)."""
    gate = _contiguous_grad(torch._grouped_mm(x, w_gate.transpose(1, 2), offs=offs))
    up = _contiguous_grad(torch._grouped_mm(x, w_up.transpose(1, 2), offs=offs))
    act = torch.nn.functional.silu(gate) * up
    return _contiguous_grad(torch._grouped_mm(act, w_down.transpose(1, 2), offs=offs))


def _grouped_experts(self, x_sorted: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The local experts on their tokens (sorted by expert) with grouped GEMMs instead of a loop.
    The expert weights keep their per-expert (Hugging Face) parameters; they are stacked per call."""
    experts = [self.experts[str(self.first + i)] for i in range(self.per_rank)]
    offs = torch.tensor(counts, device=x_sorted.device).cumsum(0).to(torch.int32)
    stack = lambda name: torch.stack([getattr(e, name).weight for e in experts])  # noqa: E731
    return grouped_expert_mlp(x_sorted, offs, stack("gate_proj"), stack("up_proj"), stack("down_proj"))


ExpertDispatchMoE._grouped_experts = _grouped_experts


class ExpertParallelMoE(ExpertDispatchMoE, _deepspeed_moe_base()):
    """With EP > 1: also a DeepSpeed MoE by class, so ZeRO reduces expert gradients over the
    expert-data-parallel group."""

    def set_deepspeed_parallelism(self, *args, **kwargs) -> None:
        """Called by DeepSpeed at initialize: use megatron-core's expert groups."""
        from dsa_train.parallel.deepspeed_engine import register_expert_groups

        register_expert_groups(self._state, self.group_name)


def shard_experts(model: torch.nn.Module, state: ParallelState, grouped: bool = True) -> None:
    """Replace every MoE layer by its expert-parallel version (in place). Also used with
    expert_parallel=1 (no collectives): every expert runs every step (on zero tokens if none
    were routed to it), which DeepSpeed's ZeRO-2 bucketed reduction and ZeRO-3 parameter gathers
    need (the same parameters on every rank). Unlike the single-process engine,
    where an expert that got no token has no gradient and AdamW skips it, its Adam moments keep
    decaying and its weight decay applies."""
    for layer in model.model.layers:
        if isinstance(layer.mlp, MoE):
            cls = ExpertParallelMoE if state.sizes.expert > 1 else ExpertDispatchMoE
            layer.mlp = cls(layer.mlp, state, grouped=grouped)
