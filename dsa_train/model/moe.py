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

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.nn import functional as F

from .config import DSAConfig
from .grouped_experts import grouped_experts, grouped_mm_available, pack_expert_weights, per_expert
from .recompute import recomputing


class _RowChunkedMLP(torch.autograd.Function):
    """down(silu(x W_gate^T) * x W_up^T) keeping only x (and the weights) for backward.

    Forward and backward walk ROWS tokens at a time; the backward recomputes that block's gate,
    up and SiLU, then forms dx for the block and adds the block's weight gradients to fp32
    accumulators (cast to the weights' dtype at the end; each block's product is added in place,
    without an fp32 copy). The backward takes all rows as one block while that block's extra
    [rows, I] temporaries cost less than the three fp32 weight-sized accumulators
    (`backward_rows_per_block`; at 671B's dense layer, 4K rows per rank: one block, no 1.6 GB of
    accumulators); its weight gradients are then the GEMMs themselves (fp32 accumulation inside,
    rounded once). `dsa_train.plan.estimate` counts this working set. The plain expression keeps gate, up and
    the product (3 x T x intermediate) from forward to backward and, in backward, holds their
    full-size gradients next to them (about 0.8 GB at T = 16384 for small_32k's dense layer)."""

    ROWS = 2048
    BLOCK_TEMPORARIES = 9  # [rows, I] tensors a backward block holds at its peak (gate, up, act, d_prod, ...)

    @staticmethod
    def backward_rows_per_block(rows: int, hidden: int, elem_bytes: int) -> int:
        """Rows per backward block: all of them while the block's temporaries beyond ROWS rows'
        (BLOCK_TEMPORARIES x extra rows x I x elem_bytes) stay under the accumulators' 3 x 4 x I x
        hidden bytes, else ROWS (I cancels)."""
        extra_rows_allowed = 12 * hidden // (_RowChunkedMLP.BLOCK_TEMPORARIES * elem_bytes)
        return max(rows, 1) if rows <= _RowChunkedMLP.ROWS + extra_rows_allowed else _RowChunkedMLP.ROWS

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
        needed = [name for name, need in (("gate", need_gate), ("up", need_up), ("down", need_down)) if need]
        block = _RowChunkedMLP.backward_rows_per_block(x2.shape[0], x2.shape[1], x2.element_size())
        one_block = block >= x2.shape[0]
        weights = {"gate": w_gate, "up": w_up, "down": w_down}
        # fp32 accumulators over blocks; one block: the block's gradient is the result (0 + g rounds to g)
        acc = {} if one_block else {name: torch.zeros(weights[name].shape, dtype=torch.float32, device=weights[name].device)
                                    for name in needed}
        grad = {}

        def add(name, g):  # g: one block's weight gradient in the weights' dtype
            if one_block:
                grad[name] = g.to(weights[name].dtype)
            else:
                acc[name].add_(g)  # promoted in place: no fp32 copy of g

        for r0 in range(0, x2.shape[0], block):
            rows = slice(r0, r0 + block)
            xr, dyr = x2[rows], dy2[rows]
            gate, up = F.linear(xr, w_gate), F.linear(xr, w_up)  # [R, I]
            act = F.silu(gate)
            if "down" in needed:
                add("down", dyr.t() @ (act * up))
            d_prod = dyr @ w_down  # [R, I]
            d_up = d_prod * act
            d_gate = torch.ops.aten.silu_backward(d_prod * up, gate)
            if "gate" in needed:
                add("gate", d_gate.t() @ xr)
            if "up" in needed:
                add("up", d_up.t() @ xr)
            if need_x:
                dx[rows] = d_gate @ w_gate + d_up @ w_up
        if one_block and not x2.shape[0]:  # no rows (an empty shard): zero gradients, as the sums of nothing
            grad = {name: torch.zeros_like(weights[name]) for name in needed}
        grads = [(grad[name] if one_block else acc[name].to(weights[name].dtype)) if name in needed else None
                 for name in ("gate", "up", "down")]
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


NOT_ROUTED = -1.0  # routing-table entry of a (token, expert) pair the router did not pick (weights are >= 0)


def routing_table(expert_ids: torch.Tensor, weights: torch.Tensor, n_experts: int) -> torch.Tensor:
    """expert_ids [N, top_k], weights [N, top_k] -> [N, n_experts]: the routing weight of each
    (token, expert), NOT_ROUTED where the router did not pick the expert. Differentiable in the
    weights (the backward gathers the picked entries)."""
    table = torch.full((expert_ids.shape[0], n_experts), NOT_ROUTED, dtype=weights.dtype, device=weights.device)
    return table.scatter(1, expert_ids, weights)


def tokens_per_expert(expert_ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """expert_ids [N, top_k] -> [n_experts] int64 counts, on the device (a bincount without its
    host read of the largest id)."""
    flat = expert_ids.reshape(-1)
    return torch.zeros(n_experts, dtype=torch.long, device=flat.device).index_add_(0, flat, torch.ones_like(flat))


def uses_cuda_streams(t: torch.Tensor) -> bool:
    """Whether work on `t` takes the CUDA stream paths of `HostCopy` and `SideStream`: a real CUDA
    tensor (fake tensors, `dsa-train plan --trace`, have no values and no streams). One predicate,
    so that tests run those paths on the CPU (tests/test_cuda_branches.py)."""
    return t.is_cuda and not is_fake(t)


def pinned_empty(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """Page-locked host memory: the target of a non-blocking device -> host copy."""
    return torch.empty(shape, dtype=dtype, pin_memory=True)


class HostCopy:
    """A device tensor's integer values on the host: the copy starts now without blocking (CUDA:
    into pinned memory, ordered after the work queued so far) and `values()` waits for it -- the
    one point where the host waits for the device. On the CPU `values()` is a plain read. Fake
    tensors (`dsa-train plan --trace`) have no values: `values()` gives `balanced`, the sizes of
    balanced routing."""

    def __init__(self, t: torch.Tensor, balanced: list[int]):
        self.event, self.host, self.balanced = None, t, balanced
        if is_fake(t):
            self.host = None
        elif uses_cuda_streams(t):
            self.host = pinned_empty(t.shape, t.dtype)
            self.host.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(t.device))  # t's device's stream, where the copy runs

    def values(self) -> list[int]:
        if self.host is None:
            return list(self.balanced)
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class ExpertSlots:
    """The (row, local expert) slots of rows that carry their routing weights for the local experts,
    sorted by expert (then row): one stable sort of the [experts, rows] routed mask, no host read
    (the number of slots comes from counts already on the host).

    `gather` gives the experts' input rows; `weighted_sum` weights the expert outputs and adds them
    per row (in expert order), so a row routed to several local experts comes back as one row."""

    def __init__(self, weight_rows: torch.Tensor, n_slots: int):
        # weight_rows [R, L] (fp32, NOT_ROUTED where the row does not go to that expert)
        n_rows = weight_rows.shape[0]
        skipped = (weight_rows.detach() < 0).t().reshape(-1).to(torch.uint8)  # [L * R], expert-major
        slot = torch.argsort(skipped, stable=True)[:n_slots]  # routed first, by (expert, row)
        self.row, expert = slot % n_rows, slot // n_rows  # [S]
        self.weight = weight_rows[self.row, expert]  # [S]
        self.n_rows = n_rows

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [R, h] -> the experts' inputs [S, h], sorted by expert."""
        return rows[self.row]

    def weighted_sum(self, y: torch.Tensor) -> torch.Tensor:
        """Expert outputs y [S, h] -> [R, h]: weighted, summed per row."""
        weighted = y * self.weight[:, None].to(y.dtype)
        return y.new_zeros(self.n_rows, y.shape[-1]).index_add(0, self.row, weighted)


@runtime_checkable
class TokenDispatcher(Protocol):
    """How an MoE layer moves its tokens to the experts it runs and back: `LocalDispatcher` (every
    expert on this process) or `dsa_train.parallel.expert.AllToAllDispatcher` (expert parallel).
    tests/test_seams.py checks that both satisfy it."""

    local_experts: Sequence[int]  # global ids of the experts this process runs, ascending

    def dispatch(self, tokens: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor
                 ) -> tuple[torch.Tensor, list[int], object]:
        """tokens [N, h], expert_ids / weights [N, top_k], counts [n_experts] (tokens per expert, on
        the device) -> (x [S, h] sorted by local expert, counts per local expert (host list), state
        for `combine`)."""
        ...

    def combine(self, y: torch.Tensor, state) -> torch.Tensor:
        """Expert outputs y [S, h] (dispatch order) -> [N, h]: weighted and summed per token."""
        ...


class LocalDispatcher:
    """The `TokenDispatcher` with every routed expert on this process: the (token, expert) slots
    are only sorted by expert. `dsa_train.parallel.expert.AllToAllDispatcher` is the
    expert-parallel one (tokens travel to their experts' ranks and back). One host read per
    forward for the loop over experts (the per-expert counts, which size its GEMMs), none for
    grouped GEMMs (`dispatch_on_device`, which `MoE` uses with them), none in the backward."""

    def __init__(self, n_experts: int):
        self.n_experts = n_experts
        self.local_experts = range(n_experts)  # global ids of the experts this process runs

    def dispatch(self, tokens: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor):
        """tokens [N, h], expert_ids / weights [N, top_k], counts [n_experts] (tokens per expert, on
        the device) -> (x [S, h] sorted by local expert, counts per local expert (host list), state
        for `combine`)."""
        balanced = [max(expert_ids.numel() // self.n_experts, 1)] * self.n_experts  # for fake tensors
        counts_host = HostCopy(counts, balanced).values()  # the forward's one host read
        slots = ExpertSlots(routing_table(expert_ids, weights, self.n_experts), sum(counts_host))
        return slots.gather(tokens), counts_host, slots

    def dispatch_on_device(self, tokens: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                           counts: torch.Tensor):
        """`dispatch` without its host read: the counts stay the device tensor `counts` (grouped
        GEMMs take their offsets on the device). Every token has top_k distinct experts, so the
        number of slots, N x top_k, is known without them."""
        slots = ExpertSlots(routing_table(expert_ids, weights, self.n_experts), expert_ids.numel())
        return slots.gather(tokens), counts, slots

    def combine(self, y: torch.Tensor, state) -> torch.Tensor:
        """Expert outputs y [S, h] (dispatch order) -> [N, h]: weighted and summed per token."""
        return state.weighted_sum(y)


@runtime_checkable
class TokenSplit(Protocol):
    """How an MoE layer splits its tokens over a group of ranks that all hold them (tensor
    parallelism: `dsa_train.parallel.tensor.TensorParallelTokens`): the router and the routed
    experts run on this rank's share only."""

    def scatter(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [N, h] (the same on every rank) -> this rank's share [N_r, h]."""
        ...

    def gather(self, out: torch.Tensor, n_tokens: int) -> torch.Tensor:
        """This rank's share's routed output [N_r, h] -> all N tokens' [N, h], the same on every rank."""
        ...

    def sum_load(self, load: torch.Tensor) -> torch.Tensor:
        """Tokens per expert of this rank's share [E] -> of all N tokens (a new tensor)."""
        ...

    def sum_gradient(self, weight: torch.Tensor) -> torch.Tensor:
        """Identity; the gradient is summed over the split's ranks (each ran its share's tokens
        through `weight`): applied to the routed experts' stacked weights (`grouped_experts`)."""
        ...


class SideStream:
    """`module(x)` on a CUDA side stream, started now and joined by `result()`: the shared experts
    overlap the dispatch all-to-all (their backward runs on the same side stream, overlapping the
    combine's all-to-all backward). Without CUDA it runs at `result()`, sequentially."""

    def __init__(self, module: nn.Module, x: torch.Tensor):
        self.module, self.x, self.out, self.stream = module, x, None, None

    @classmethod
    def start(cls, module: nn.Module, x: torch.Tensor) -> "SideStream":
        run = cls(module, x)
        if uses_cuda_streams(x):
            run.stream = torch.cuda.Stream(device=x.device)
            run.stream.wait_stream(torch.cuda.current_stream(x.device))
            with torch.cuda.stream(run.stream):
                run.out = module(x)
            x.record_stream(run.stream)
        return run

    def result(self) -> torch.Tensor:
        if self.stream is None:
            return self.module(self.x)
        torch.cuda.current_stream(self.x.device).wait_stream(self.stream)
        self.out.record_stream(torch.cuda.current_stream(self.x.device))
        return self.out


class MoE(nn.Module):
    """route -> dispatch -> experts -> combine (+ shared experts), as Megatron's MoELayer. One
    process: every expert local (`LocalDispatcher`), a loop over experts, loads not summed. A
    parallel layout changes that through one method, `set_layout` (dsa_train.parallel.expert),
    and under tensor parallelism `token_split` (dsa_train.parallel.tensor: router and routed
    experts on this TP rank's share of the tokens, their output gathered)."""

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
        self.dispatcher: TokenDispatcher = LocalDispatcher(self.n_experts)
        self.grouped_gemm = False
        # tokens routed to each expert: by the last forward (metrics), and summed over the
        # training-mode forwards since the last bias update (all micro-batches of a step)
        self.register_buffer("last_expert_load", torch.zeros(config.n_routed_experts), persistent=False)
        self.register_buffer("load_since_update", torch.zeros(config.n_routed_experts), persistent=False)
        # sums the loads over the router's replicas before a bias update; None: one process
        self.sum_loads = None
        # under tensor parallelism (`dsa_train.parallel.tensor.TensorParallelTokens`): the router
        # and routed experts run on this TP rank's share of the tokens; None: on all of them
        self.token_split: TokenSplit | None = None

    def set_layout(self, grouped_gemm: bool, sum_loads=None, dispatcher: TokenDispatcher | None = None) -> None:
        """How this layer runs under a parallel layout (`dsa_train.parallel.expert.shard_experts`):
        `grouped_gemm` runs the local experts as grouped GEMMs instead of a loop; `sum_loads`
        sums a load tensor over the router's replicas in place (before a bias update); a
        `dispatcher` (a `TokenDispatcher`) moves tokens to the experts it names
        local (`dispatcher.local_experts`), and the layer keeps only those."""
        self.grouped_gemm = grouped_gemm
        self.sum_loads = sum_loads
        if dispatcher is not None:
            self.dispatcher = dispatcher
            for e in list(self.experts.keys()):
                if int(e) not in dispatcher.local_experts:
                    del self.experts[e]
        if grouped_gemm:  # one [E, ...] storage per projection: the GEMMs take views, no per-forward copy
            pack_expert_weights(list(self.experts.values()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])  # [N, hidden]
        split = self.token_split
        routed = tokens if split is None else split.scatter(tokens)  # this TP rank's share of the tokens
        expert_ids, weights = self.gate(routed)
        load = tokens_per_expert(expert_ids, self.n_experts)  # [E] on the device (of `routed`)
        if not recomputing():  # a recompute in the backward routes the same tokens again: counted once
            # the layer's loads over all N tokens (metrics, the bias update): summed over the TP shares
            self.last_expert_load = (load if split is None else split.sum_load(load)).detach().float()
            if self.training:
                self.load_since_update += self.last_expert_load
        # on CUDA the shared experts run on a side stream beside the dispatch all-to-all; on the
        # CPU after the combine (the same math; the order keeps gradient sums as they were)
        shared = SideStream.start(self.shared_experts, tokens) if self.shared_experts is not None else None
        if self.grouped_gemm and isinstance(self.dispatcher, LocalDispatcher):
            # grouped GEMMs on one process's experts: sizes stay on the device, no host read
            x_sorted, counts, state = self.dispatcher.dispatch_on_device(routed, expert_ids, weights, load)
        else:
            x_sorted, counts, state = self.dispatcher.dispatch(routed, expert_ids, weights, load)
        y_sorted = self.run_experts(x_sorted, counts)
        out = self.dispatcher.combine(y_sorted, state)
        if split is not None:  # every TP rank continues with all N tokens' routed output
            out = split.gather(out, tokens.shape[0])
        if shared is not None:
            out = out + shared.result()
        return out.view(shape)

    def run_experts(self, x_sorted: torch.Tensor, counts: list[int] | torch.Tensor) -> torch.Tensor:
        """The local experts on their tokens (sorted by expert; counts per local expert, on the host
        or, for grouped GEMMs, on the device). Every
        local expert runs, on zero tokens if none came: the same modules (and, under ZeRO-3, the
        same parameter gathers) on every rank."""
        experts = [self.experts[str(e)] for e in self.dispatcher.local_experts]
        if self.grouped_gemm:
            # under a token split the experts' gradients are summed over its ranks on the stacked
            # weights: one collective per projection (else per expert weight, `expert_grads_summed_on_stack`)
            weight_grad = self.token_split.sum_gradient if self.expert_grads_summed_on_stack() else None
            return grouped_experts(experts, x_sorted, counts, weight_grad=weight_grad)
        return per_expert(experts, x_sorted, counts)

    def expert_grads_summed_on_stack(self) -> bool:
        """Whether the forward sums the routed experts' gradients over the token split's ranks itself,
        on each projection's stacked weight (grouped GEMMs under a `token_split`); otherwise the
        split's owner sums each expert weight's gradient (`dsa_train.parallel.tensor.split_moe_tokens`)."""
        return self.token_split is not None and self.grouped_gemm and grouped_mm_available()

    @torch.no_grad()
    def update_bias(self, rate: float) -> None:
        """Aux-loss-free step from the loads of every training forward since the last update
        (summed over the router's replicas, so every replica takes the same step)."""
        if self.sum_loads is not None:
            self.sum_loads(self.load_since_update)
            self.sum_loads(self.last_expert_load)
        # no host read: the loads since the update, or the last forward's when there were none;
        # with no load at all sign(mean - load) is 0 everywhere and the bias stays as it is
        since = self.load_since_update
        load = torch.where(since.sum() == 0, self.last_expert_load, since)
        self.gate.e_score_correction_bias += rate * torch.sign(load.mean() - load)
        self.load_since_update.zero_()
