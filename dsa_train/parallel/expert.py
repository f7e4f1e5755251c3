"""Expert parallelism: the routed experts of every MoE layer sharded over the expert-parallel
group, tokens moved to their experts' ranks by a dropless all-to-all and back.

The MoE forward is the model's (`dsa_train.model.moe.MoE`: route -> dispatch -> experts ->
combine); expert parallelism replaces only its token dispatcher (`AllToAllDispatcher`, the seam)
and keeps each rank's share of the experts. Per MoE layer on EP rank r (E experts, EP ranks,
E/EP local experts [r*E/EP, (r+1)*E/EP)):
  1. route this rank's tokens (the model's `Router`, unchanged);
  2. dispatch: sort the (token, expert) slots by expert -- hence by destination rank --, exchange
     the per-rank slot counts, then the token vectors (all_to_all_single with autograd: its
     backward is the reverse all-to-all), no capacity limit, nothing dropped;
  3. the local experts on the received tokens, sorted by expert: three grouped GEMMs
     (`torch._grouped_mm`, CPU and CUDA) when `parallel.grouped_experts`, else a loop;
  4. combine: the outputs go back by the reverse all-to-all, weighted and added per token.
The shared experts run locally. Expert parameters keep their global names
(`mlp.experts.{e}.gate_proj.weight`) and are marked as DeepSpeed marks MoE parameters
(`allreduce=False`, `group_name`): DeepSpeed reduces their gradients over the expert-data-parallel
group (see `dsa_train.parallel.deepspeed_engine` for how DeepSpeed learns the groups). Expert
loads are summed over the router's replicas (DP x CP) at the aux-loss-free bias update
(`MoE.sum_loads`), so every replica's bias takes the single-process step.
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


def _grouped_mm_available() -> bool:
    return hasattr(torch, "_grouped_mm")


def _contiguous_grad(t: torch.Tensor) -> torch.Tensor:
    # grouped_mm's backward needs a materialized gradient (an expanded one, e.g. from .sum(), fails)
    if t.requires_grad:
        t.register_hook(lambda g: g.contiguous())
    return t


# CUDA's grouped GEMM (`torch._grouped_mm`, CUTLASS on sm90) takes bf16 operands only, with every
# row stride a multiple of 16 bytes (8 bf16 elements); the CPU kernel takes any float dtype and size.
CUDA_GROUPED_MM_DTYPES = (torch.bfloat16,)
GROUPED_MM_ALIGN_BYTES = 16


def expert_gemm_path(dtype: torch.dtype, device_type: str, hidden: int, inter: int) -> str:
    """How `grouped_expert_mlp` runs the experts on a device:
    "grouped"        one grouped GEMM per projection, as is;
    "grouped_padded" the same after zero-padding hidden and intermediate sizes to 16 bytes (CUDA);
    "loop"           one GEMM per expert (no grouped GEMM for this dtype there: fp32 on CUDA)."""
    if not hasattr(torch, "_grouped_mm"):
        return "loop"
    if device_type != "cuda":
        return "grouped"
    if dtype not in CUDA_GROUPED_MM_DTYPES:
        return "loop"
    per = GROUPED_MM_ALIGN_BYTES // torch.tensor([], dtype=dtype).element_size()
    return "grouped" if hidden % per == 0 and inter % per == 0 else "grouped_padded"


def _pad_last(t: torch.Tensor, size: int) -> torch.Tensor:
    return t if t.shape[-1] == size else torch.nn.functional.pad(t, (0, size - t.shape[-1]))


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def grouped_expert_mlp(x: torch.Tensor, offs: torch.Tensor, w_gate, w_up, w_down, path: str | None = None) -> torch.Tensor:
    """SwiGLU experts over tokens sorted by expert: x [N, h], offs [E] int32 (cumulative token
    counts), w_gate/w_up [E, I, h], w_down [E, h, I] (nn.Linear layout). `path` (default: chosen
    by `expert_gemm_path` for x's dtype and device) picks grouped GEMMs, padded grouped GEMMs or
    a per-expert loop; all three compute the same function."""
    h, inter = x.shape[-1], w_gate.shape[1]
    path = path or expert_gemm_path(x.dtype, x.device.type, h, inter)
    if path == "loop":
        outs, start = [], 0
        for e, end in enumerate(offs.tolist()):
            xe = x[start:end]
            act = torch.nn.functional.silu(xe @ w_gate[e].t()) * (xe @ w_up[e].t())
            outs.append(act @ w_down[e].t())
            start = end
        return torch.cat(outs) if outs else x.new_zeros(0, h)
    if path == "grouped_padded":
        # zero rows/columns: the padded gate/up columns are 0, silu(0) * 0 = 0, so the padded
        # down-projection inputs add nothing; the padded output columns are dropped
        per = GROUPED_MM_ALIGN_BYTES // x.element_size()
        hp, ip = _round_up(h, per), _round_up(inter, per)
        x = _pad_last(x, hp)
        w_gate = _pad_last(_pad_last(w_gate, hp).transpose(1, 2), ip).transpose(1, 2)
        w_up = _pad_last(_pad_last(w_up, hp).transpose(1, 2), ip).transpose(1, 2)
        w_down = _pad_last(_pad_last(w_down, ip).transpose(1, 2), hp).transpose(1, 2)
        # [E, ip, hp] / [E, hp, ip], contiguous after padding
        w_gate, w_up, w_down = w_gate.contiguous(), w_up.contiguous(), w_down.contiguous()
    elif path != "grouped":
        raise ValueError(f"grouped_expert_mlp: path={path!r}; one of grouped, grouped_padded, loop")
    gate = _contiguous_grad(torch._grouped_mm(x, w_gate.transpose(1, 2), offs=offs))
    up = _contiguous_grad(torch._grouped_mm(x, w_up.transpose(1, 2), offs=offs))
    act = torch.nn.functional.silu(gate) * up
    out = _contiguous_grad(torch._grouped_mm(act, w_down.transpose(1, 2), offs=offs))
    return out[:, :h] if out.shape[-1] != h else out


def grouped_experts(experts: list, x_sorted: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The local experts on their tokens (sorted by expert) with grouped GEMMs instead of a loop.
    The expert weights keep their per-expert (Hugging Face) parameters; they are stacked per call."""
    if not _grouped_mm_available():
        outs, start = [], 0
        for expert, n in zip(experts, counts):
            outs.append(expert(x_sorted[start : start + n]))
            start += n
        return torch.cat(outs)
    offs = torch.tensor(counts, device=x_sorted.device).cumsum(0).to(torch.int32)
    stack = lambda name: torch.stack([getattr(e, name).weight for e in experts])  # noqa: E731
    return grouped_expert_mlp(x_sorted, offs, stack("gate_proj"), stack("up_proj"), stack("down_proj"))


def shard_experts(model: torch.nn.Module, state: ParallelState, grouped: bool = True) -> None:
    """Expert parallelism applied to every MoE layer (in place): keep this rank's experts, install
    the all-to-all dispatcher (EP > 1), mark expert parameters for DeepSpeed, and sum the router
    loads over the router's replicas. Also with expert_parallel=1 the local dispatcher runs every
    expert every step (on zero tokens if none were routed to it), as in one process."""
    ep = state.sizes.expert
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        module.grouped_gemm = grouped
        if state.sizes.dense_dp > 1:
            group = state.dense_dp_group
            module.sum_loads = lambda t, group=group: dist.all_reduce(t, group=group)
        if ep == 1:
            continue
        module.dispatcher = AllToAllDispatcher(module.n_experts, state)
        for e in list(module.experts.keys()):
            if int(e) not in module.dispatcher.local_experts:
                del module.experts[e]
        for p in module.experts.parameters():
            set_sharding(p, Sharding(expert_group=expert_group_name(state)))


def expert_group_name(state: ParallelState) -> str:
    return f"ep_size_{state.sizes.expert}"
