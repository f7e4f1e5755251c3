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
from .grouped_experts import grouped_experts


class _RowChunkedMLP(torch.autograd.Function):
    """down(silu(x W_gate^T) * x W_up^T) keeping only x (and the weights) for backward.

    Forward and backward walk ROWS tokens at a time; the backward recomputes that block's gate,
    up and SiLU, then forms dx for the block and adds the block's weight gradients to fp32
    accumulators (cast to the weights' dtype at the end). The plain expression keeps gate, up and
    the product (3 x T x intermediate) from forward to backward and, in backward, holds their
    full-size gradients next to them (about 0.8 GB at T = 16384 for small_32k's dense layer)."""

    ROWS = 2048

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down):  # x [..., hidden]; w_gate/w_up [I, hidden]; w_down [hidden, I]
        x2 = x.reshape(-1, x.shape[-1])
        y = x2.new_empty(x2.shape[0], w_down.shape[0])
        for r0 in range(0, x2.shape[0], _RowChunkedMLP.ROWS):
            xr = x2[r0 : r0 + _RowChunkedMLP.ROWS]
            y[r0 : r0 + _RowChunkedMLP.ROWS] = F.linear(F.silu(F.linear(xr, w_gate)) * F.linear(xr, w_up), w_down)
        ctx.save_for_backward(x, w_gate, w_up, w_down)
        return y.view(*x.shape[:-1], w_down.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x, w_gate, w_up, w_down = ctx.saved_tensors
        need_x, need_gate, need_up, need_down = ctx.needs_input_grad
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        dx = torch.empty_like(x2) if need_x else None
        acc = {name: torch.zeros(w.shape, dtype=torch.float32, device=w.device)
               for name, w, need in (("gate", w_gate, need_gate), ("up", w_up, need_up), ("down", w_down, need_down))
               if need}
        for r0 in range(0, x2.shape[0], _RowChunkedMLP.ROWS):
            rows = slice(r0, r0 + _RowChunkedMLP.ROWS)
            xr, dyr = x2[rows], dy2[rows]
            gate, up = F.linear(xr, w_gate), F.linear(xr, w_up)  # [R, I]
            act = F.silu(gate)
            if "down" in acc:
                acc["down"] += (dyr.t() @ (act * up)).float()
            d_prod = dyr @ w_down  # [R, I]
            d_up = d_prod * act
            d_gate = torch.ops.aten.silu_backward(d_prod * up, gate)
            if "gate" in acc:
                acc["gate"] += (d_gate.t() @ xr).float()
            if "up" in acc:
                acc["up"] += (d_up.t() @ xr).float()
            if need_x:
                dx[rows] = d_gate @ w_gate + d_up @ w_up
        grads = [acc[name].to(w.dtype) if name in acc else None
                 for name, w in (("gate", w_gate), ("up", w_up), ("down", w_down))]
        return (dx.view_as(x) if need_x else None), *grads


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). With `row_chunked` (the default) a training forward
    runs as `_RowChunkedMLP` on the three weights; tensor parallelism (`parallel/tensor.py`)
    replaces the linears by ones whose forward runs collectives and clears it."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.row_chunked = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_chunked and torch.is_grad_enabled():
            weights = [self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight]
            if x.requires_grad or any(w.requires_grad for w in weights):
                return _RowChunkedMLP.apply(x, *weights)
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


class LocalDispatcher:
    """Token dispatcher with every routed expert on this process: the (token, expert) slots are
    only sorted by expert. `dsa_train.parallel.expert.AllToAllDispatcher` is the expert-parallel
    one (same methods; tokens travel to their experts' ranks and back)."""

    def __init__(self, n_experts: int):
        self.n_experts = n_experts
        self.local_experts = range(n_experts)  # global ids of the experts this process runs

    def dispatch(self, tokens: torch.Tensor, expert_ids: torch.Tensor):
        """tokens [N, h], expert_ids [N, top_k] -> (x [S, h] sorted by local expert,
        counts [n_local] (list), state for `combine`)."""
        flat = expert_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # slots grouped by expert
        counts = torch.bincount(flat, minlength=self.n_experts).tolist()
        return tokens[order // expert_ids.shape[1]], counts, order

    def combine(self, y: torch.Tensor, state, weights: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Expert outputs y [S, h] (dispatch order) -> [N, h]: weighted and summed per token."""
        order = state
        weight_of_slot = weights.reshape(-1)[order]
        token_of_slot = order // weights.shape[1]
        return torch.zeros_like(tokens).index_add(0, token_of_slot, y * weight_of_slot[:, None].to(tokens.dtype))


class MoE(nn.Module):
    """route -> dispatch -> experts -> combine (+ shared experts), as Megatron's MoELayer. One
    process: every expert local (`LocalDispatcher`), a loop over experts, loads not summed. A
    parallel layout changes that through one method, `set_layout` (dsa_train.parallel.expert)."""

    def __init__(self, config: DSAConfig):
        super().__init__()
        self.gate = Router(config)
        self.n_experts = config.n_routed_experts
        # keyed by global expert id: an expert-parallel rank keeps only its own (same names)
        self.experts = nn.ModuleDict(
            {str(e): MLP(config.hidden_size, config.moe_intermediate_size) for e in range(self.n_experts)}
        )
        self.shared_experts = (
            MLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)
            if config.n_shared_experts
            else None
        )
        self.dispatcher = LocalDispatcher(self.n_experts)
        self.grouped_gemm = False
        # tokens routed to each expert: by the last forward (metrics), and summed over the
        # training-mode forwards since the last bias update (all micro-batches of a step)
        self.register_buffer("last_expert_load", torch.zeros(config.n_routed_experts), persistent=False)
        self.register_buffer("load_since_update", torch.zeros(config.n_routed_experts), persistent=False)
        # sums the loads over the router's replicas before a bias update; None: one process
        self.sum_loads = None

    def set_layout(self, grouped_gemm: bool, sum_loads=None, dispatcher=None) -> None:
        """How this layer runs under a parallel layout (`dsa_train.parallel.expert.shard_experts`):
        `grouped_gemm` runs the local experts as grouped GEMMs instead of a loop; `sum_loads`
        sums a load tensor over the router's replicas in place (before a bias update); a
        `dispatcher` (the interface of `LocalDispatcher`) moves tokens to the experts it names
        local (`dispatcher.local_experts`), and the layer keeps only those."""
        self.grouped_gemm = grouped_gemm
        self.sum_loads = sum_loads
        if dispatcher is not None:
            self.dispatcher = dispatcher
            for e in list(self.experts.keys()):
                if int(e) not in dispatcher.local_experts:
                    del self.experts[e]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])  # [N, hidden]
        expert_ids, weights = self.gate(tokens)
        load = torch.bincount(expert_ids.reshape(-1), minlength=self.n_experts)
        self.last_expert_load = load.detach().float()
        if self.training:
            self.load_since_update += self.last_expert_load
        x_sorted, counts, state = self.dispatcher.dispatch(tokens, expert_ids)
        y_sorted = self.run_experts(x_sorted, counts)
        out = self.dispatcher.combine(y_sorted, state, weights, tokens)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        return out.view(shape)

    def run_experts(self, x_sorted: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The local experts on their tokens (sorted by expert; counts per local expert). Every
        local expert runs, on zero tokens if none came: the same modules (and, under ZeRO-3, the
        same parameter gathers) on every rank."""
        experts = [self.experts[str(e)] for e in self.dispatcher.local_experts]
        if self.grouped_gemm:
            return grouped_experts(experts, x_sorted, counts)
        outs, start = [], 0
        for expert, n in zip(experts, counts):
            outs.append(expert(x_sorted[start : start + n]))
            start += n
        return torch.cat(outs) if outs else x_sorted

    @torch.no_grad()
    def update_bias(self, rate: float) -> None:
        """Aux-loss-free step from the loads of every training forward since the last update
        (summed over the router's replicas, so every replica takes the same step)."""
        if self.sum_loads is not None:
            self.sum_loads(self.load_since_update)
            self.sum_loads(self.last_expert_load)
        load = self.load_since_update
        if load.sum() == 0:
            load = self.last_expert_load
        if load.sum() == 0:
            return
        self.gate.e_score_correction_bias += rate * torch.sign(load.mean() - load)
        self.load_since_update.zero_()
