"""`dsa-train plan --trace`: every collective of the traced step (op, group, phase, payload), and
the plan's communication compared with that record.

`CollectiveRecorder` is a TorchDispatchMode stacked on the trace's: c10d ops (what
torch.distributed's functions dispatch to, on the fake backend too) and functional collectives
are recorded with the role of their group in the layout (tp, cp, ep, dp, dense_dp, expert_dp,
world), the group's size and how many of its ranks share this rank's node, the payload of the
call (`plan_comm`'s convention) and the phase: `step` while the traced optimizer step runs,
`backward` inside autograd's backward, `recompute` there when torch.utils.checkpoint re-runs a
forward, else `forward`; the step's token counts and metric sums (`dsa_train.loss`, reduced once
per step) are `step`. The traced step runs one micro-batch: per-micro-batch phases count
`micro_batches` times in a step.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from dsa_train.plan.comm import collective_seconds, span_of

# dispatcher op name -> (op, index of the argument whose tensors are the payload, x group size)
_C10D = {
    "alltoall_base_": ("all_to_all", 1, False), "alltoall_": ("all_to_all", 1, False),
    "allgather_": ("all_gather", 0, False), "_allgather_base_": ("all_gather", 0, False),
    "allgather_into_tensor_coalesced_": ("all_gather", 0, False), "allgather_coalesced_": ("all_gather", 0, False),
    "allreduce_": ("all_reduce", 0, False), "allreduce_coalesced_": ("all_reduce", 0, False),
    "reduce_": ("reduce", 0, False), "broadcast_": ("broadcast", 0, False),
    "reduce_scatter_": ("reduce_scatter", 1, False), "_reduce_scatter_base_": ("reduce_scatter", 1, False),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, False),
}
_FUNCTIONAL = {
    "all_reduce": ("all_reduce", 0, False), "all_reduce_coalesced": ("all_reduce", 0, False),
    "all_gather_into_tensor": ("all_gather", 0, True), "all_to_all_single": ("all_to_all", 0, False),
    "reduce_scatter_tensor": ("reduce_scatter", 0, False), "broadcast": ("broadcast", 0, False),
}


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    return 0


class CollectiveRecorder(TorchDispatchMode):
    """Records every collective dispatched while active (see module doc)."""

    def __init__(self, state, ranks_per_node: int):
        super().__init__()
        roles = {"tp": state.tp_group, "cp": state.cp_group, "ep": state.ep_group, "dp": state.dp_group,
                 "dense_dp": state.dense_dp_group, "expert_dp": state.expert_dp_group, "world": dist.group.WORLD}
        self.roles: dict[int, str] = {}  # id of the process group -> its role (groups live all trace)
        for role, group in roles.items():  # a process group serving two roles keeps the first
            if group is not None:
                self.roles.setdefault(id(group), role)
        self.rank, self.ranks_per_node = dist.get_rank(), ranks_per_node
        self.calls: list[dict] = []
        self._phase: str | None = None
        self._spans: dict = {}

    @contextmanager
    def phase(self, name: str):
        """Collectives issued inside are of phase `name` (the traced optimizer step, ZeRO's
        end-of-backward flush)."""
        before, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = before

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace == "c10d" and func._opname in _C10D:
            self._record(_C10D[func._opname], args, next(a for a in args if _is_group(a)))
        elif func.namespace == "_c10d_functional" and func._opname in _FUNCTIONAL:
            name = next(a for a in list(args) + list(kwargs.values()) if isinstance(a, str))
            self._record(_FUNCTIONAL[func._opname], args, dist.distributed_c10d._resolve_process_group(name))
        return out

    def _record(self, spec, args, group) -> None:
        op, arg, times_size = spec
        if isinstance(group, torch.ScriptObject):
            group = dist.ProcessGroup.unbox(group)
        key = id(group)
        if key not in self._spans:
            self._spans[key] = span_of(dist.get_process_group_ranks(group), self.rank, self.ranks_per_node)
        span = self._spans[key]
        payload = _nbytes(args[arg]) * (span.size if times_size else 1)
        self.calls.append({"op": op, "group": self.roles.get(key, "other"), "group_size": span.size,
                           "group_on_node": span.on_node, "phase": self._phase or _autograd_phase(),
                           "payload_bytes": payload, "dtype": _dtype(args[arg])})


def _dtype(obj) -> str:
    """The dtype of the payload's (first) tensor, e.g. "float32"."""
    while isinstance(obj, (list, tuple)) and obj:
        obj = obj[0]
    return str(obj.dtype).removeprefix("torch.") if isinstance(obj, torch.Tensor) else ""


def _is_group(a) -> bool:
    return isinstance(a, dist.ProcessGroup) or (isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()))


def _autograd_phase() -> str:
    in_backward = torch._C._current_graph_task_id() != -1
    f = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if name.endswith("dsa_train/loss.py"):
            return "step"  # the step's token counts and metric sums: reduced once per step
        if in_backward and name.endswith("torch/utils/checkpoint.py"):
            return "recompute"  # a checkpointed forward re-run by the backward
        f = f.f_back
    return "backward" if in_backward else "forward"


def traced_communication(calls: list[dict], micro_batches: int, net) -> dict:
    """Per (op, group, phase) over one step: calls, payload bytes and seconds (the traced
    micro-batch's collectives counted `micro_batches` times, the step's once)."""
    out: dict = defaultdict(lambda: {"calls": 0.0, "payload_bytes": 0.0, "seconds": 0.0})
    from dsa_train.plan.comm import GroupSpan

    for c in calls:
        repeat = 1 if c["phase"] == "step" else micro_batches
        row = out[key_of(c)]
        row["calls"] += repeat
        row["payload_bytes"] += repeat * c["payload_bytes"]
        row["seconds"] += repeat * collective_seconds(c["op"], c["payload_bytes"],
                                                      GroupSpan(c["group_size"], c["group_on_node"]), net)
    return dict(out)


def key_of(row: dict) -> str:
    return f"{row['op']} {row['group']} {row['phase']}"


def compare_communication(planned: list[dict], traced: dict) -> list[dict]:
    """The plan's kinds (plan_comm.price rows) beside the traced record, per (op, group, phase):
    planned and traced payload bytes and seconds per step (0 where one side has none)."""
    plan_by_key: dict = defaultdict(lambda: {"kinds": [], "payload_bytes": 0.0, "seconds": 0.0, "calls": 0.0})
    for r in planned:
        row = plan_by_key[key_of(r)]
        row["kinds"].append(r["kind"])
        for k in ("payload_bytes", "seconds", "calls"):
            row[k] += r[k]
    rows = []
    for key in sorted(set(plan_by_key) | set(traced)):
        p = plan_by_key.get(key, {"kinds": [], "payload_bytes": 0.0, "seconds": 0.0, "calls": 0.0})
        t = traced.get(key, {"payload_bytes": 0.0, "seconds": 0.0, "calls": 0.0})
        rows.append({"key": key, "kinds": sorted(set(p["kinds"])), "planned_calls": p["calls"], "traced_calls": t["calls"],
                     "planned_bytes": p["payload_bytes"], "traced_bytes": t["payload_bytes"],
                     "planned_s": p["seconds"], "traced_s": t["seconds"]})
    return rows
