"""DeepSeekMoE: sigmoid router with group-limited top-k, shared experts, aux-loss-free balancing.

Routing (DeepSeek-V3, `topk_method: noaux_tc`):
    s = sigmoid(x @ W_gate^T)                          affinity per expert, fp32
    choice = s + e_score_correction_bias               bias used for SELECTION only
    group score = sum of the top-2 `choice` in each of n_group groups; keep topk_group groups
    experts = top-k of `choice` within the kept groups
    weights = s[experts] (normalized to sum 1 if norm_topk_prob) * routed_scaling_factor
The bias is updated outside the gradient (aux-loss-free balancing): after a step,
    bias += rate * sign(mean_load - load_e).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .config import DSAConfig


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    def __init__(self, config: DSAConfig):
        super().__init__()
        self.n_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(self.n_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.n_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> (expert ids [N, top_k], weights [N, top_k] fp32)."""
        scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))  # [N, E]
        choice = scores + self.e_score_correction_bias.float()
        N = x.shape[0]
        if self.n_group > 1:
            grouped = choice.view(N, self.n_group, self.n_experts // self.n_group)
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # [N, G]
            keep_groups = group_scores.topk(self.topk_group, dim=-1).indices
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep_groups, True)
            expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(N, self.n_experts)
            choice = choice.masked_fill(~expert_mask, float("-inf"))
        expert_ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, expert_ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return expert_ids, weights * self.routed_scaling_factor


class MoE(nn.Module):
    def __init__(self, config: DSAConfig):
        super().__init__()
        self.gate = Router(config)
        self.experts = nn.ModuleList(
            [MLP(config.hidden_size, config.moe_intermediate_size) for _ in range(config.n_routed_experts)]
        )
        self.shared_experts = (
            MLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)
            if config.n_shared_experts
            else None
        )
        # tokens routed to each expert: by the last forward (metrics), and summed over the
        # training-mode forwards since the last bias update (all micro-batches of a step)
        self.register_buffer("last_expert_load", torch.zeros(config.n_routed_experts), persistent=False)
        self.register_buffer("load_since_update", torch.zeros(config.n_routed_experts), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])  # [N, hidden]
        expert_ids, weights = self.gate(tokens)
        out = torch.zeros_like(tokens)
        flat_ids = expert_ids.reshape(-1)
        load = torch.bincount(flat_ids, minlength=len(self.experts))
        self.last_expert_load = load.detach().float()
        if self.training:
            self.load_since_update += self.last_expert_load
        order = torch.argsort(flat_ids, stable=True)  # slots grouped by expert
        token_of_slot = order // expert_ids.shape[1]
        weight_of_slot = weights.reshape(-1)[order]
        offsets = torch.cumsum(load, 0).tolist()
        start = 0
        for e, end in enumerate(offsets):
            if end > start:
                idx = token_of_slot[start:end]
                y = self.experts[e](tokens[idx]) * weight_of_slot[start:end, None].to(tokens.dtype)
                out.index_add_(0, idx, y)
            start = end
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        return out.view(shape)

    @torch.no_grad()
    def update_bias(self, rate: float) -> None:
        """Aux-loss-free step from the loads of every training forward since the last update."""
        load = self.load_since_update
        if load.sum() == 0:
            load = self.last_expert_load
        if load.sum() == 0:
            return
        self.gate.e_score_correction_bias += rate * torch.sign(load.mean() - load)
        self.load_since_update.zero_()
