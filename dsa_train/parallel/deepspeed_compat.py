"""The one module that touches DeepSpeed's private names (written for deepspeed >=0.19.8,<0.20).

dsa_train drives DeepSpeed from outside its usual path (megatron-core's process groups, experts
sharded by `parallel/expert.py`, caller-driven accumulation, checkpoints per ZeRO fragment), so it
reads and writes a few names DeepSpeed does not publish:

* MoE: DeepSpeed's expert-group registry (`deepspeed.utils.groups._EXPERT_*` dicts), its MoE
  parameter marks (`param.allreduce = False`, `param.group_name`, written here from the
  parameters' `Sharding` records and nowhere else) and a parameter-free `deepspeed.moe.layer.MoE`
  whose `__init__` is skipped (DeepSpeed configures expert parameter groups when the model
  contains one);
* the engine's `enable_backward_allreduce` switch (ZeRO-0 fp32: the reduction is done by
  `DeepSpeedEngine.reduce_gradients`);
* the ZeRO optimizers' layouts: which optimizer DeepSpeed built (ZeRO-3, ZeRO-1/2 or BF16, or the
  plain torch optimizer), each parameter's fragment of the flat fp32 partitions
  (`_hp_mapping`, `grad_position`, ...) for checkpoints, and the buffers that hold gradients
  between backward and step (the non-finite check).

A private name missing under a DeepSpeed outside `WRITTEN_FOR` raises `DeepSpeedVersionError`
(one line: the version, the name, the range to install); inside the range it is a bug and keeps
its AttributeError.
"""

from __future__ import annotations

import contextlib
from importlib.metadata import PackageNotFoundError, version

import torch
import torch.distributed as dist
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from dsa_train.checkpoint.sharded_state import Fragment
from dsa_train.errors import DSATrainError
from dsa_train.sharding import sharding_of

WRITTEN_FOR = ">=0.19.8,<0.20"  # the DeepSpeed versions this module was written and checked for


class DeepSpeedVersionError(DSATrainError, RuntimeError):
    """The installed DeepSpeed lacks a private name the adapter relies on."""


def installed_version() -> Version | None:
    try:
        return Version(version("deepspeed"))
    except PackageNotFoundError:
        return None


def private(obj, name: str, *default):
    """`getattr(obj, name[, default])` for a DeepSpeed private name. Missing (and no default)
    under a DeepSpeed outside `WRITTEN_FOR`: DeepSpeedVersionError."""
    try:
        return getattr(obj, name, *default)
    except AttributeError:
        found = installed_version()
        if found is not None and found not in SpecifierSet(WRITTEN_FOR):
            raise DeepSpeedVersionError(
                f"DeepSpeed {found}: {type(obj).__name__}.{name} is missing (dsa_train's DeepSpeed adapter, "
                f"parallel/deepspeed_compat.py, is written for deepspeed{WRITTEN_FOR})",
                fix=f"install a DeepSpeed in that range: pip install 'deepspeed{WRITTEN_FOR}'",
            ) from None
        raise


# ------------------------------------------------------------------------------ MoE groups
def register_expert_groups(state, group_name: str) -> None:
    """Make megatron-core's expert groups (`state`: ParallelState) DeepSpeed's expert groups named
    `group_name`."""
    from deepspeed.utils import groups as dsg

    private(dsg, "_EXPERT_PARALLEL_GROUP")[group_name] = state.ep_group
    private(dsg, "_EXPERT_PARALLEL_GROUP_RANKS")[group_name] = dist.get_process_group_ranks(state.ep_group)
    private(dsg, "_EXPERT_DATA_PARALLEL_GROUP")[group_name] = state.expert_dp_group
    private(dsg, "_EXPERT_DATA_PARALLEL_GROUP_RANKS")[group_name] = dist.get_process_group_ranks(state.expert_dp_group)


def mark_expert_parameters(params) -> set[str]:
    """DeepSpeed's MoE marks on every routed-expert parameter of `params` (`allreduce=False`,
    `group_name`), from its Sharding record. Returns the expert group names."""
    names = set()
    for p in params:
        group = sharding_of(p).expert_group
        if group is not None:
            p.allreduce = False
            p.group_name = group
            names.add(group)
    return names


def moe_param_groups(groups: list[dict]) -> list[dict]:
    """The optimizer's parameter groups with routed-expert parameters in DeepSpeed's MoE groups
    (their gradients reduced over the expert-data-parallel group)."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    return split_params_into_different_moe_groups_for_optimizer(groups)


def _moe_marker(num_experts: int, state, group_name: str) -> torch.nn.Module:
    """DeepSpeed configures expert parameter groups (ZeRO's expert-data-parallel reduction) when
    the model it initializes contains a `deepspeed.moe.layer.MoE`, and asks each such module for
    its groups through `set_deepspeed_parallelism` (its MoE API). This parameter-free module is
    such a layer (DeepSpeed's __init__ not run: it builds its own experts); it answers with
    megatron-core's expert groups."""
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    class ExpertGroups(DeepSpeedMoE):
        def __init__(self):
            torch.nn.Module.__init__(self)
            self.num_experts = num_experts

        def set_deepspeed_parallelism(self, *args, **kwargs) -> None:
            register_expert_groups(state, group_name)

    return ExpertGroups()


@contextlib.contextmanager
def expert_groups_visible(model: torch.nn.Module, state, trainable: list):
    """For the duration of `deepspeed.initialize`: DeepSpeed sees expert parallelism when expert
    parameters train (in a stage whose experts are frozen, e.g. the dense warm-up, it must see
    none: it then requires MoE parameter groups). The groups are registered whenever the model
    has expert parameters (marked by `mark_expert_parameters` before the optimizer's groups are
    made): DeepSpeed broadcasts every marked parameter over its group."""
    for name in sorted({sharding_of(p).expert_group for p in model.parameters()} - {None}):
        register_expert_groups(state, name)
    trained = {sharding_of(p).expert_group for _, p in trainable if sharding_of(p).expert}
    if not trained:
        yield
        return
    (group_name,) = trained
    model.add_module("_deepspeed_expert_groups", _moe_marker(model.config.n_routed_experts, state, group_name))
    try:
        yield
    finally:
        del model._deepspeed_expert_groups


def disable_backward_allreduce(ds_engine) -> None:
    """Switch off DeepSpeed's gradient reduction in backward (the caller reduces)."""
    private(ds_engine, "enable_backward_allreduce")
    ds_engine.enable_backward_allreduce = False


# ------------------------------------------------------------------------------ ZeRO layouts
def optimizer_kind(opt) -> str:
    """Which optimizer DeepSpeed built: "zero3" (each parameter partitioned on its own), "torch"
    (no ZeRO wrapper: fp32 stage 0, the torch optimizer steps the parameters themselves) or
    "flat" (ZeRO-1/2 or the BF16 optimizer: one flat fp32 partition per parameter group)."""
    if hasattr(opt, "fp32_partitioned_groups_flat"):
        return "zero3"
    if isinstance(opt, torch.optim.Optimizer) and not hasattr(opt, "bit16_groups"):
        return "torch"
    return "flat"


def zero_fragments(opt, trainable: list[tuple[str, torch.nn.Parameter]]) -> list[Fragment]:
    """This rank's fragments of the trainable parameters in DeepSpeed's optimizer `opt`."""
    kind = optimizer_kind(opt)
    if kind == "zero3":
        out = []
        flats = private(opt, "fp32_partitioned_groups_flat")
        positions = private(opt, "grad_position")
        for name, p in trainable:
            group, dest, partition = positions[opt.get_param_id(p)]
            start = private(opt, "_get_param_partition_rank")(p) * partition  # this rank's range of the flat parameter
            numel = min(partition, p.ds_numel - start)  # the last partition is padded
            if numel > 0:
                out.append(Fragment(name, p, start, numel, opt.optimizer, flats[group], dest, shape=tuple(p.ds_shape)))
        return out
    if kind == "torch":
        return [Fragment(name, p, 0, p.numel(), opt, p, 0) for name, p in trainable]
    flats = private(opt, "single_partition_of_fp32_groups", None) or private(opt, "fp32_groups_flat_partition")
    out = []
    for name, p in trainable:
        mapping = private(p, "_hp_mapping", None)
        if mapping is None:
            continue
        out.append(Fragment(name, p, mapping.lp_fragment_address.start, mapping.lp_fragment_address.numel,
                            opt.optimizer, flats[mapping.param_group_index], mapping.hp_fragment_address.start))
    return out


def gradient_buffers(opt) -> list[torch.Tensor]:
    """Where DeepSpeed keeps gradients between backward and step besides `p.grad`: ZeRO-2 reduces
    each bucket during backward and accumulates this rank's partition over the step's backwards
    (`all_grad_tensors`, caller-driven accumulation; `grads_in_partition` / `averaged_gradients`
    at the boundary), ZeRO-3 into its flat partition buffer, bf16 ZeRO-1 with fp32 accumulation
    (the BF16 optimizer) into fp32 flat buffers."""
    grads = []
    for name in ("grads_in_partition", "grad_partitions_flat_buffer"):
        buffer = getattr(opt, name, None)
        if isinstance(buffer, torch.Tensor):
            grads.append(buffer)
    grads.extend(g for g in getattr(opt, "fp32_groups_gradients_flat", None) or [] if isinstance(g, torch.Tensor))
    for name in ("all_grad_tensors", "averaged_gradients"):  # {param group: [tensor]}
        for group in (getattr(opt, name, None) or {}).values():
            grads.extend(g for g in (group or []) if isinstance(g, torch.Tensor))
    return grads


def fuse_grad_norm(opt) -> bool:
    """ZeRO-1/2 (`DeepSpeedZeroOptimizer`): its L2 gradient norm with one fused norm over the
    partition's gradients (`torch._foreach_norm`: a few multi-tensor kernels on a GPU) instead of a
    `vector_norm` per parameter; the same selection (padding, pipeline replicas and model-parallel
    duplicates left out), the same sums over the data- and model-parallel groups and the same -1
    for a non-finite norm as DeepSpeed's `get_grad_norm_direct`, which it replaces on this
    optimizer instance. Other optimizers and norms are left as they are. True when installed."""
    original = getattr(opt, "get_grad_norm_direct", None)
    if original is None or type(opt).__name__ != "DeepSpeedZeroOptimizer":
        return False
    from deepspeed.runtime.constants import PIPE_REPLICATED
    from deepspeed.runtime.utils import is_model_parallel_parameter, mask_nan_or_inf_with_val_inplace
    from deepspeed.runtime.zero.utils import get_norm_dtype

    def get_grad_norm_direct(gradients, params, norm_type=2):
        if float(norm_type) != 2.0:
            return original(gradients, params, norm_type)
        dtype = get_norm_dtype()
        picked = []
        for g, p in zip((g for g in gradients if not getattr(g, "_zero_padding", False)), params):
            if hasattr(p, PIPE_REPLICATED) and p.ds_pipe_replicated:
                continue
            if is_model_parallel_parameter(p) or opt.model_parallel_rank == 0:
                picked.append(g.data.detach())
        if picked:  # accumulated in DeepSpeed's norm dtype (fp64) without a converted copy of each gradient
            total = torch.stack(torch._foreach_norm(picked, 2.0, dtype=dtype)).to(opt.device).pow(2.0).sum().float()
        else:
            total = torch.tensor(0.0, dtype=torch.float32).to(opt.device)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=opt.dp_process_group)
        opt._model_parallel_all_reduce(tensor=total, op=dist.ReduceOp.SUM)
        total = total.pow(0.5)
        mask_nan_or_inf_with_val_inplace(total, device=opt.device)
        return total

    opt.get_grad_norm_direct = get_grad_norm_direct
    return True


def drop_accumulated_gradients(opt) -> None:
    """ZeRO-1/2 (`DeepSpeedZeroOptimizer`): forget the gradients accumulated into this rank's
    partition (`averaged_gradients` / `all_grad_tensors`, and the flat buffers behind them), as its
    own step does when it skips an overflowing update. Its `zero_grad` clears only `p.grad`: after
    a step the trainer skips (NonFiniteGuard), the skipped gradients -- a NaN or inf included --
    would otherwise be added into the next step's. Nothing to drop after an update (its step
    released them); other optimizers are left as they are."""
    if type(opt).__name__ != "DeepSpeedZeroOptimizer" or getattr(opt, "cpu_offload", False):
        return
    averaged = private(opt, "averaged_gradients")
    if not any(v is not None for v in averaged.values()) and not any(
            v is not None for v in (private(opt, "all_grad_tensors", None) or {}).values()):
        return
    private(opt, "_release_preflattened_grad_buffers")()
    for k in list(averaged.keys()):
        averaged[k] = None
    all_grads = private(opt, "all_grad_tensors", None) or {}
    for k in list(all_grads.keys()):
        all_grads[k] = None
