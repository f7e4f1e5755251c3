"""Tensor parallelism with megatron-core's ColumnParallelLinear / RowParallelLinear.

MLA: `q_b_proj` (or `q_proj`) and `kv_b_proj` column-parallel by heads, `o_proj` row-parallel;
each TP rank runs H / TP heads (MLA's forward runs whatever heads it holds; `TensorParallelHeads`
sums the shared latent's gradient over TP and gives the indexer's KL target over every head) (MHA
and absorbed MQA forms alike: W_UK / W_UV are per-head views of its kv_b_proj shard). The low-rank
projections (q_a_proj, kv_a_proj_with_mqa), their norms and the lightning indexer are replicated;
the indexer sees the same detached inputs on every TP rank, its KL target covers all heads (no
gradient): in the sparse stage on the Triton path the local heads' Sigma_h P from the attention's
forward, all-reduced over TP (`sum_heads`); otherwise (the dense KL, the CPU path) every head's
queries and log-sum-exps gathered over TP (`gather`); its gradients are averaged over TP. Dense MLPs and shared experts: gate/up
column-parallel, down row-parallel. Embeddings, norms and LM head are replicated.

MoE layers (sequence-parallel routed experts, `TensorParallelTokens`): the router and the routed
experts are replicated over TP (use expert parallelism to spread them), but each TP rank routes and
runs them on its contiguous share of the layer's N flattened tokens (`comm.row_share`: ceil(N / TP)
rows a rank, the last ranks fewer when TP does not divide N; the all-gather pads each share to
ceil(N / TP) rows and drops the padding). The routed output is all-gathered over TP, so every rank
continues with the same [N, hidden] tensor; the split's backward all-gathers the input gradient,
the gather's takes this rank's share. The router's and routed experts' gradients then come from
different tokens on each TP rank and are summed over TP -- the router's by a hook (`sum_over_group`),
the routed experts' (grouped GEMMs) in one all-reduce per projection of the stacked [E, ...] weight
(`TensorParallelTokens.sum_gradient`; as a loop, a hook per weight) -- after which every TP rank
holds the same full gradient, as before (DeepSpeed reduces them over DP x CP, or the experts
over expert-DP, and its gradient norm counts them on TP rank 0 only). The tokens per expert are
summed over TP in the forward (the bias update and the load metrics see all N tokens, as TP 1). With
expert parallelism each TP rank's EP group dispatches that rank's share.
"""

from __future__ import annotations

import torch
from torch import nn

from dsa_train.model.moe import MLP, MoE
from dsa_train.parallel.comm import all_gather_nograd, all_reduce_nograd, copy_to_group, gather_rows, scatter_rows
from dsa_train.parallel.groups import ParallelState
from dsa_train.sharding import Sharding, set_sharding


def _parallel_config(dtype: torch.dtype, tp: int):
    from megatron.core import ModelParallelConfig

    return ModelParallelConfig(
        tensor_model_parallel_size=tp,
        use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=False,
        params_dtype=dtype,
        gradient_accumulation_fusion=False,
    )


def _init_none(_w):  # weights are copied from the full layer
    return None


def _column_cls():
    from megatron.core.tensor_parallel import ColumnParallelLinear

    class Column(ColumnParallelLinear):
        """ColumnParallelLinear returning only the output (an nn.Linear drop-in)."""

        def forward(self, x):
            out, _ = super().forward(x)
            return out

    return Column


def _row_cls():
    from megatron.core.tensor_parallel import RowParallelLinear

    class Row(RowParallelLinear):
        def forward(self, x):
            out, bias = super().forward(x)
            return out if bias is None else out + bias

    return Row


def _mark_tp(param: torch.Tensor, dim: int) -> None:
    """What megatron's initializers set (skipped here: weights are copied, not initialized); DeepSpeed's
    gradient-norm counts parameters so marked on every TP rank, the others once."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    set_tensor_model_parallel_attributes(param, True, dim, 1)


def _copy_in(shard: torch.Tensor, source: torch.Tensor) -> None:
    """Copy the full layer's slice into the new shard; nothing to copy from a meta-device model
    (meta-device start-up, trainer/startup.py: the shard is loaded from the checkpoint later)."""
    if not source.is_meta:
        shard.copy_(source)


def column_parallel(linear: nn.Linear, state: ParallelState) -> nn.Module:
    tp, r = state.sizes.tensor, state.tp_rank
    out_f, in_f = linear.weight.shape
    layer = _column_cls()(
        in_f, out_f, config=_parallel_config(linear.weight.dtype, tp), init_method=_init_none,
        bias=linear.bias is not None, gather_output=False, tp_group=state.tp_group,
    )
    n = out_f // tp
    with torch.no_grad():
        _copy_in(layer.weight, linear.weight[r * n : (r + 1) * n])
        set_sharding(layer.weight, Sharding(tp_dim=0, tp_range=(r * n, (r + 1) * n)))
        _mark_tp(layer.weight, 0)
        if linear.bias is not None:
            _copy_in(layer.bias, linear.bias[r * n : (r + 1) * n])
            set_sharding(layer.bias, Sharding(tp_dim=0, tp_range=(r * n, (r + 1) * n)))
            _mark_tp(layer.bias, 0)
    return layer.to(linear.weight.device)


def row_parallel(linear: nn.Linear, state: ParallelState) -> nn.Module:
    tp, r = state.sizes.tensor, state.tp_rank
    out_f, in_f = linear.weight.shape
    layer = _row_cls()(
        in_f, out_f, config=_parallel_config(linear.weight.dtype, tp), init_method=_init_none,
        bias=linear.bias is not None, input_is_parallel=True, skip_bias_add=False, tp_group=state.tp_group,
    )
    n = in_f // tp
    with torch.no_grad():
        _copy_in(layer.weight, linear.weight[:, r * n : (r + 1) * n])
        set_sharding(layer.weight, Sharding(tp_dim=1, tp_range=(r * n, (r + 1) * n)))
        _mark_tp(layer.weight, 1)
        if linear.bias is not None:
            _copy_in(layer.bias, linear.bias)
    return layer.to(linear.weight.device)


def shard_mlp(mlp: MLP, state: ParallelState) -> None:
    """gate/up column-parallel, down row-parallel; the MLP then runs its linears' forwards (which
    run the TP collectives), not the row-chunked function of the weights."""
    mlp.gate_proj = column_parallel(mlp.gate_proj, state)
    mlp.up_proj = column_parallel(mlp.up_proj, state)
    mlp.down_proj = row_parallel(mlp.down_proj, state)
    mlp.row_chunked = False


def sum_over_group(param: torch.Tensor, group, divide_by: int = 1, unless=None) -> None:
    """Sum this replicated parameter's gradient contributions over `group` (its ranks ran it on
    different tokens), divided by `divide_by` (`average_over_group`). `unless`: a callable; when it
    returns True at the backward, the gradient is left as it is (summed elsewhere)."""
    import torch.distributed as dist

    def hook(grad):
        if unless is not None and unless():
            return grad
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad / divide_by if divide_by != 1 else grad

    param.register_hook(hook)


def average_over_group(param: torch.Tensor, group, size: int) -> None:
    """Average this replicated parameter's gradient contributions over `group`."""
    sum_over_group(param, group, divide_by=size)


class TensorParallelTokens:
    """The `TokenSplit` of an MoE layer under tensor parallelism (module doc): this TP rank's share
    of the tokens for the router and routed experts, their output gathered over TP."""

    def __init__(self, state: ParallelState):
        self.group = state.tp_group

    def scatter(self, tokens: torch.Tensor) -> torch.Tensor:
        return scatter_rows(tokens, self.group)

    def gather(self, out: torch.Tensor, n_tokens: int) -> torch.Tensor:
        return gather_rows(out, n_tokens, self.group)

    def sum_load(self, load: torch.Tensor) -> torch.Tensor:
        return all_reduce_nograd(load.clone(), self.group)

    def sum_gradient(self, weight: torch.Tensor) -> torch.Tensor:
        return copy_to_group(weight, self.group)


class TensorParallelHeads:
    """Head placement of an MLA layer whose heads are split over the TP group (`MLA.heads`)."""

    def __init__(self, state: ParallelState):
        self.group = state.tp_group

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        """Identity; the gradient is summed over TP (every rank's heads read the latent KV)."""
        return copy_to_group(x, self.group)

    def gather(self, x: torch.Tensor, dim: int = 2) -> torch.Tensor:
        """Every head's values (no gradient): the indexer's KL target sums attention over all heads."""
        return all_gather_nograd(x, dim, self.group)

    def sum_heads(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's sum over heads from this rank's heads' partial sum (no gradient): the sparse
        KL's target Sigma_h P, all-reduced over the TP group (every rank gets the same bits)."""
        return all_reduce_nograd(x, self.group)

    def replicated(self):
        """Around the indexer's top-k, which every TP rank runs on the same inputs: the ranks must
        select the same keys in the same slots (their heads attend over one key set, and `sum_heads`
        adds their targets slot by slot), so its kernels run their default configs, untimed
        (`dsa_kernels.autotune.untimed`): a timed choice can differ between ranks, and the index
        score configs differ in the last bits, which reorders close scores."""
        from dsa_kernels import autotune

        return autotune.untimed()


def shard_tensor_parallel(model: nn.Module, state: ParallelState) -> None:
    tp = state.sizes.tensor
    for layer in model.model.layers:
        attn = layer.self_attn
        if hasattr(attn, "q_b_proj"):
            attn.q_b_proj = column_parallel(attn.q_b_proj, state)
        else:
            attn.q_proj = column_parallel(attn.q_proj, state)
        attn.kv_b_proj = column_parallel(attn.kv_b_proj, state)
        attn.o_proj = row_parallel(attn.o_proj, state)
        attn.heads = TensorParallelHeads(state)
        for p in attn.indexer.parameters():
            average_over_group(p, state.tp_group, tp)
        if isinstance(layer.mlp, MoE):
            if layer.mlp.shared_experts is not None:
                shard_mlp(layer.mlp.shared_experts, state)
            split_moe_tokens(layer.mlp, state)
        else:
            shard_mlp(layer.mlp, state)


def split_moe_tokens(moe: MoE, state: ParallelState) -> None:
    """The layer's router and routed experts on this TP rank's share of its tokens (module doc),
    their gradients summed over TP: the router's by a hook per parameter; the routed experts' as
    grouped GEMMs on each projection's stacked weight in the forward (`MoE.run_experts`: 3
    all-reduces a layer, whatever the number of experts), as a loop by a hook per expert weight."""
    moe.token_split = TensorParallelTokens(state)
    for p in moe.gate.parameters():
        sum_over_group(p, state.tp_group)
    for p in moe.experts.parameters():  # checked at the backward: set_layout may come after this
        sum_over_group(p, state.tp_group, unless=moe.expert_grads_summed_on_stack)
