"""`dsa-train plan --trace`: one rank of the recipe's real layout, traced for one training step.

    dsa-train plan --trace [--rank R] [--world N] [--json] --config-name R [overrides ...]

Rank R (default 0) of the recipe's full world size, in one CPU process, without allocating it:
  1. torch.distributed on the `fake` backend (torch.testing's FakeStore: collectives return at
     once) and megatron-core's groups for the recipe's TP / CP / EP at that world size;
  2. the model on the meta device, parallelized as the trainer does (`parallelize_model`, the
     same code as the meta-device start-up), materialized under FakeTensorMode (tensors with
     shapes, dtypes and storages but no memory), the stage's parameters set trainable;
  3. one training step of the recipe's largest stage: the trainer's `forward_backward` on one
     micro-batch of `data.micro_batch_size` x `data.seq_len` tokens (its CP share on this rank),
     then the optimizer step. The step is DeepSpeed's ZeRO-1/2 as it lays out memory, run with
     real torch ops on fake tensors (DeepSpeed itself does not run under FakeTensorMode): fp32
     master weights and AdamW moments for this rank's partition (dense parameters over DP x CP,
     experts over expert-DP), gradients reduced into fp32 buffers -- this rank's partition under
     ZeRO-2 (plus one reduce bucket), the whole trainable set under ZeRO-1 -- AdamW (foreach) on
     the partition, one param group per flat partition (dense, experts) stepped one after the
     other as DeepSpeed does, and the updated partition all-gathered back into the bf16 parameters.
A TorchDispatchMode counts every live storage by category (parameters, gradients, optimizer
state, activations, DSA buffers: the top-k indices, the kernels' working sets and what dsa_kernels/
allocates, as the plan counts them (`_DSA_OPS`), communication buffers: what collectives write;
an allocation belongs to the nearest project frame on its stack: the model's code beneath a
kernel's frame, as an activation checkpoint's recompute run from a kernel's backward, makes
activations) and keeps the categories at the peak, the DSA buffers also by allocation site
(`peak_dsa_sites`), the plan's phase the peak fell in (`peak_phase`: forward_backward or
optimizer_step, from the update's start), and each category's own maximum over the step
(`category_max`). An op's own temporaries are not among its outputs: where one is known it is added
as a transient of the op's category (`torch.logsumexp`'s copy of its input, `_logsumexp_temporary`:
the loss's forward holds it beside its fp32 row chunk).

Data-dependent values (the MoE's per-rank token counts, `.item()` of metrics) have no value
under FakeTensorMode: token counts are taken as balanced routing (every expert gets
tokens * top-k / experts; the aux-loss-free bias keeps loads near that), other scalars as 1
(integers and floats; the optimizer's step count) or False -- they feed metrics only.

Chunk loops: every op runs once under FakeTensorMode (~0.5-1 ms each on this CPU), and the
PyTorch paths of the DSA ops walk the queries in chunks (at the 671B sparse shapes under context
parallelism the top-k alone is ~2000 chunks per layer). Those loops are torch ops
(`dsa_kernels.chunk_ops`: the CP top-k, the CPU sparse MLA forward and backward, the sparse
indexer KL): one fake dispatch each, whose fake implementation offers the loop's own code on its
largest chunk; `MemoryTrace.chunk_workspace` runs that under a nested counter (once per distinct
shapes) and adds its peak as a transient DSA buffer on top of what is live at the call.

Kernel path: a `device: cuda` recipe is traced on the code a CUDA run executes
(`dsa_kernels.custom_ops.trace_cuda_path`): the Triton autograd Functions and the library attention,
their launchers torch custom ops whose fake implementations give the outputs' shapes and offer
their transient working set like the chunk loops' (`kernel_path_of`; `kernels=` overrides it).

The step's gradients: autograd produces each parameter's gradient in the model dtype; ZeRO's hook
(`TracedZeroStep._reduce`) copies it into the fp32 bucket and frees it; the trace retags it as a
gradient (also in the peak's breakdown when it was live at the peak). AdamW's moments exist from
the start (DeepSpeed creates them at initialization).
"""

from __future__ import annotations

import functools
import math
import os
import sys
import time
import weakref
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import dsa_kernels
from dsa_train.model.dtypes import apply as apply_dtype_policy
from dsa_train.parallel.buckets import REDUCE_BUCKET
from dsa_train.sharding import sharding_of
from dsa_train.stage import Stage

GiB = 2**30
CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "dsa_buffers", "comm_buffers")
# The DSA buffers, as the plan counts them (`dsa_train.plan.estimate`): the top-k indices (the
# outputs of these custom ops, the recompute's memo of them included), the kernels' transient
# working sets, and what the kernels' host-side glue in dsa_kernels/ allocates. The attention's and
# the KL's outputs kept for the backward, and the indexer's projections, are activations (the plan's
# per-layer terms); the CP gathers are collectives' outputs (communication buffers here).
# plain allocations from these packages' source files are DSA buffers (by the package's own
# directory: a path that merely contains the name, e.g. torch's files in a checkout called
# dsa_train/, is not the project's)
_DSA_FILES = (os.path.join(os.path.dirname(os.path.abspath(dsa_kernels.__file__)), ""),)
# the model's code: allocations from these source files (the trace's own excepted) are activations
_MODEL_FILES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "")
_TRACE_FILES = (os.path.abspath(__file__), os.path.join(os.path.dirname(os.path.abspath(__file__)), "trace_comm.py"))
_DSA_OPS = ("indexer_topk", "indexer_topk_at_positions")  # custom ops whose outputs are DSA buffers


class MemoryTrace(TorchDispatchMode):
    """Counts live storages (fake or real) by category; records the categories at the peak."""

    def __init__(self):
        super().__init__()
        self.matmul_flops: dict[str, int] = defaultdict(int)  # aten op -> FLOPs (`_matmul_formulas`)
        self.live: dict[int, list] = {}  # storage key -> [nbytes, category]
        self.current: dict[str, int] = defaultdict(int)
        self.peak_total = 0
        self.peak: dict[str, int] = {}
        self.phase = "activations"  # or "optimizer"
        # the plan's phase the step is in ("forward_backward", then "optimizer_step" from the
        # update on: `TracedZeroStep.step`); `peak_phase`: the one the peak fell in
        self.step_phase = "forward_backward"
        self.peak_phase = self.step_phase
        self.balanced: dict[int, int] = {}  # storage key -> balanced element value (MoE counts)
        self._transient = 0  # bytes a chunk-loop op held during the current dispatch
        self.peak_where = ""  # where the peak was reached (source line)
        self.seq = 0  # allocation counter: live[k][2] is a storage's, peak_seq the peak's
        self.peak_seq = 0
        self._workspace_cache: dict[tuple, int] = {}
        self.kernel_ops: dict[str, int] = defaultdict(int)  # dsa_kernels custom op -> calls
        # the DSA buffers by where they were allocated (source line and function): live now, at the peak
        self.dsa_sites: dict[str, int] = defaultdict(int)
        self.peak_dsa_sites: dict[str, int] = {}
        # each category's own maximum over the step (the plan's terms are per-category upper bounds;
        # the total's peak may fall where one category is below its maximum): a log of allocations
        # (seq, bytes), frees (seq, -bytes) and transients (0, bytes, category), replayed with each
        # storage's last category (a gradient or collective buffer is retagged after it is made)
        self.events: list[tuple] = []
        self.category_of: dict[int, str] = {}  # allocation seq -> its (last) category

    # -------------------------------------------------------------- accounting
    @staticmethod
    def key(t: torch.Tensor) -> int:
        return t.untyped_storage()._cdata

    def add(self, t: torch.Tensor, category: str, site: str = "") -> None:
        st = t.untyped_storage()
        k = st._cdata
        if k in self.live:
            return
        n = st.nbytes()
        self.seq += 1
        site = (site or "?") if category == "dsa_buffers" else ""
        self.live[k] = [n, category, self.seq, site]
        self.current[category] += n
        self.events.append((self.seq, n))
        self.category_of[self.seq] = category
        if site:
            self.dsa_sites[site] += n
        weakref.finalize(st, self._free, k)
        total = sum(self.current.values())
        if total > self.peak_total:
            self._new_peak(total)

    def _new_peak(self, total: int, transient: tuple[int, str, str] | None = None) -> None:
        self.peak_total = total
        self.peak = dict(self.current)
        self.peak_dsa_sites = {s: n for s, n in self.dsa_sites.items() if n}
        if transient is not None:  # (bytes, category, site) live only during the current op
            n, category, site = transient
            self.peak[category] = self.peak.get(category, 0) + n
            if category == "dsa_buffers":
                self.peak_dsa_sites[site] = self.peak_dsa_sites.get(site, 0) + n
        self.peak_where = _where()
        self.peak_seq = self.seq
        self.peak_phase = self.step_phase

    def _bump(self, nbytes: int, category: str, site: str = "") -> None:
        """A transient allocation of `nbytes` on top of what is live now: a peak candidate."""
        total = sum(self.current.values()) + nbytes
        self.events.append((0, nbytes, category))
        if total > self.peak_total:
            self._new_peak(total, (nbytes, category, site or "?"))

    def chunk_workspace(self, key: tuple, run_worst_chunk) -> None:
        """Listener of `dsa_kernels.chunk_ops`: a chunk-loop op (one fake dispatch for its whole
        loop) offers its largest chunk; it runs here under a nested counter that ignores what is
        already live (the op's inputs), and its peak is the op's transient working set (measured
        once per distinct op and argument shapes)."""
        if key not in self._workspace_cache:
            nested = MemoryTrace()
            nested.live = {k: [0, "live", 0, ""] for k in self.live}
            with nested:
                run_worst_chunk()
            self._workspace_cache[key] = nested.peak_total
        self._transient = max(self._transient, self._workspace_cache[key])

    def _free(self, k: int) -> None:
        self.balanced.pop(k, None)  # a later storage may reuse the key
        entry = self.live.pop(k, None)
        if entry is not None:
            self.current[entry[1]] -= entry[0]
            self.events.append((entry[2], -entry[0]))
            if entry[3]:
                self.dsa_sites[entry[3]] -= entry[0]

    def category_max(self, start: int = 0) -> dict[str, int]:
        """Each category's maximum over the events from `start` on (a storage counted in its last
        category all its life, as `retag` does for the peak)."""
        current: dict[str, int] = defaultdict(int)
        best: dict[str, int] = defaultdict(int)
        for i, e in enumerate(self.events):
            if i == start:  # what is live when the counting starts
                best.update(current)
            if len(e) == 3:  # a transient on top of what is live
                if i >= start:
                    best[e[2]] = max(best[e[2]], current[e[2]] + e[1])
                continue
            category = self.category_of.get(e[0], "")
            current[category] += e[1]
            if i >= start:
                best[category] = max(best[category], current[category])
        return dict(best)

    def retag(self, t: torch.Tensor, category: str) -> None:
        entry = self.live.get(self.key(t))
        if entry is None:
            self.add(t, category)
        elif entry[1] != category:
            self.current[entry[1]] -= entry[0]
            self.current[category] += entry[0]
            self.category_of[entry[2]] = category
            if entry[2] <= self.peak_seq:  # live now and allocated before the peak: live at the peak
                self.peak[entry[1]] = self.peak.get(entry[1], 0) - entry[0]
                self.peak[category] = self.peak.get(category, 0) + entry[0]
                if entry[3]:
                    self.peak_dsa_sites[entry[3]] = self.peak_dsa_sites.get(entry[3], 0) - entry[0]
            if entry[3]:  # no longer a DSA buffer
                self.dsa_sites[entry[3]] -= entry[0]
                entry[3] = ""
            entry[1] = category

    def _category_of_new(self, func) -> tuple[str, str]:
        """(category, allocation site) of what `func` just allocated; the site names DSA buffers only."""
        ns = func.namespace
        if ns == "dsa_kernels":  # a custom op's outputs: named by the op, not its wrapper's line
            name = func._schema.name.split("::")[-1]
            return ("dsa_buffers" if name in _DSA_OPS else "activations"), f"{name} outputs"
        if ns in ("c10d", "_c10d_functional"):
            return "comm_buffers", ""
        if self.phase == "optimizer":
            return "optimizer", ""
        # the nearest of the project's frames decides: code in dsa_kernels/ allocates DSA buffers,
        # the model's code activations -- also where the model runs beneath a kernel's frame: a
        # recompute that an activation checkpoint runs when a kernel's backward unpacks its saved
        # tensors (`ctx.saved_tensors` in the dense KL's backward: the recomputed layer's tensors)
        f = sys._getframe(2)
        while f is not None:
            name = f.f_code.co_filename
            if name.startswith(_DSA_FILES):
                return "dsa_buffers", f"{_short(name)}:{f.f_lineno} ({f.f_code.co_name})"
            if name.startswith(_MODEL_FILES) and name not in _TRACE_FILES:
                return "activations", ""
            f = f.f_back
        return "activations", ""

    # -------------------------------------------------------------- dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        if func is aten._local_scalar_dense.default:
            return self._scalar(args[0])
        if func in (aten.bincount.default,):
            return self._bincount(*args, **kwargs)
        self._transient = 0
        if func.namespace == "dsa_kernels":
            self.kernel_ops[func._schema.name] += 1
        if func is aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
            out = _grouped_mm_other_dtype(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        formula = _matmul_formulas().get(func._overloadpacket)
        if formula is not None:  # the matmuls the rank runs (aten's FLOP formulas)
            self.matmul_flops[str(func._overloadpacket)] += int(formula(*args, **kwargs, out_val=out))
        elif func.namespace == "dsa_kernels":  # a custom op's own matmuls, where it declares them
            from dsa_kernels.chunk_ops import MATMUL_FLOPS

            if func._schema.name in MATMUL_FLOPS:
                self.matmul_flops[func._schema.name] += int(MATMUL_FLOPS[func._schema.name](*args, **kwargs))
        category, site = self._category_of_new(func)
        for t in _tensors(out):
            self.add(t, category, site)
        if func is aten.logsumexp.default:  # a temporary of the op's own, not among its outputs
            self._bump(_logsumexp_temporary(args[0]), category, f"{site or 'logsumexp'} temporary")
        if self._transient:  # a chunk-loop op's (or a kernel launcher's) working set, live only during the op
            self._bump(self._transient, "dsa_buffers", f"{func._schema.name} working set")
            self._transient = 0
        if func.namespace in ("c10d", "_c10d_functional"):
            outs = list(_tensors(out)) + [a for a in _tensors(args) if isinstance(a, torch.Tensor)]
            for t in outs:  # collectives write into buffers allocated just before them
                if self.key(t) in self.live and self.live[self.key(t)][1] == "activations":
                    self.retag(t, "comm_buffers")
            src = next((a for a in _tensors(args) if self.key(a) in self.balanced), None)
            if src is not None:  # the exchanged token counts are balanced too
                value = self.balanced[self.key(src)]
                for t in _tensors(args):
                    self.balanced[self.key(t)] = value
        return out

    def _bincount(self, x, weights=None, minlength=0):
        n = max(int(minlength), 1)
        out = torch.zeros(n, dtype=torch.int64, device=x.device)
        self.balanced[self.key(out)] = max(x.numel() // n, 1)
        self.add(out, *self._category_of_new(torch.ops.aten.bincount.default))
        return out

    def _scalar(self, t: torch.Tensor):
        value = self.balanced.get(self.key(t))
        if t.dtype == torch.bool:
            return False
        if t.is_floating_point():
            return 1.0
        return value if value is not None else 1


def _logsumexp_temporary(x: torch.Tensor) -> int:
    """Bytes `torch.logsumexp(x)` allocates and frees inside itself (aten's `logsumexp_out_impl`, CPU
    and CUDA: `(x - amax).exp_()`, one copy of a floating input, summed into the output); the
    loss's forward holds it beside its fp32 row chunk (the plan's `head_working_set_bytes`)."""
    return x.numel() * x.element_size() if x.is_floating_point() else 0


def _short(filename: str) -> str:
    """`dsa_kernels/ops/indexer_topk/memo.py` from an absolute path (the part from the package on)."""
    for package in ("dsa_kernels/", "dsa_train/"):
        i = filename.rfind(package)
        if i >= 0:
            return filename[i:]
    return filename.rsplit("/", 1)[-1]


def _where() -> str:
    """The innermost project source line on the stack (dsa_train / kernels), for the report."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if ("dsa_train" in name or "/dsa_kernels/" in name) and not name.endswith("plan/trace.py"):
            return f"{name.rsplit('/', 2)[-2]}/{name.rsplit('/', 1)[-1]}:{f.f_lineno} ({f.f_code.co_name})"
        f = f.f_back
    return "?"


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


# ------------------------------------------------------------------ ZeRO optimizer step
class TracedZeroStep:
    """DeepSpeed ZeRO-1/2's memory layout for one step, with real ops on (fake) tensors. ZeRO-0 with
    fp32 parameters (a CPU recipe: the demo, repro_small) keeps no master copy: the optimizer steps
    the parameters themselves and their gradients stay in `p.grad` (the single-process `Engine`;
    DeepSpeed without ZeRO and without fp16 / bf16), reduced over the data-parallel ranks at the step."""

    def __init__(self, trainable, state, zero_stage: int, trace: MemoryTrace, bucket: int, reduce_dtype: torch.dtype,
                 recorder=None):
        sizes = state.sizes
        self.trace = trace
        self.zero = zero_stage
        dense = [p for _, p in trainable if not sharding_of(p).expert]
        expert = [p for _, p in trainable if sharding_of(p).expert]
        self.groups = [(dense, sizes.dense_dp), (expert, sizes.expert_dp)]
        # DeepSpeed's reductions: dense gradients over DP x CP, experts' over expert-DP
        self.process_groups = [state.dense_dp_group, state.expert_dp_group]
        self.reduce_dtype, self.recorder = reduce_dtype, recorder
        self._pending = [0, 0]  # gradient elements in the reduce bucket, per group (ZeRO-2)
        self._arrived = [0, 0]  # gradient elements of the step, per group (ZeRO-0/1 reduce them at the step)
        self.bucket = bucket
        self._reduce_buffer = None
        self.direct = zero_stage == 0 and all(p.dtype == torch.float32 for _, p in trainable)
        if self.direct:
            from dsa_train.trainer.optimizer import weight_decay_groups

            # the engines' groups (matrices, vectors), stepped by foreach AdamW (CUDA's default)
            self.optimizer = torch.optim.AdamW(weight_decay_groups(list(trainable), 0.1), lr=1e-5, foreach=True)
            # the moments, live through forward and backward after the first step
            self._moments([p for params, _ in self.groups for p in params])
            for params, _ in self.groups:
                for p in params:
                    p.register_post_accumulate_grad_hook(self._keep)
            return
        trace.phase = "optimizer"
        self.masters, self.grads = [], []
        for params, shard in self.groups:
            n = sum(p.numel() for p in params)
            if not n:
                continue
            part = math.ceil(n / shard) if zero_stage >= 1 else n
            self.masters.append(torch.zeros(part, dtype=torch.float32, requires_grad=False))
            # ZeRO-2: this rank's partition of the fp32 gradients; ZeRO-1: all of them
            g = torch.zeros(part if zero_stage >= 2 else n, dtype=torch.float32)
            trace.retag(g, "gradients")
            self.grads.append((g, part))
        trace.phase = "activations"
        self.master_params = [torch.nn.Parameter(m) for m in self.masters]
        for mp, (g, part) in zip(self.master_params, self.grads):
            mp.grad = g.narrow(0, 0, part)
        # one param group per flat partition, stepped one after the other (DeepSpeed's
        # `_optimizer_step(i)`): the update's temporaries are one group's at a time
        self.optimizer = torch.optim.AdamW([{"params": [mp]} for mp in self.master_params], lr=1e-5, foreach=True)
        # DeepSpeed's ZeRO-1/2 optimizer creates the AdamW moments at initialization
        # (`initialize_optimizer_states`), so they are live through forward and backward
        self._moments(self.master_params)
        for params, _ in self.groups:
            for p in params:
                p.register_post_accumulate_grad_hook(self._reduce)

    def _moments(self, params) -> None:
        """AdamW's state of `params` (the step counter, both moments), tagged optimizer."""
        self.trace.phase = "optimizer"
        for p in params:
            self.optimizer.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                       "exp_avg_sq": torch.zeros_like(p)}
        self.trace.phase = "activations"

    def _keep(self, p: torch.Tensor) -> None:
        """ZeRO-0 fp32: the gradient stays in `p.grad` until the step reduces it."""
        self.trace.retag(p.grad, "gradients")
        self._arrived[1 if sharding_of(p).expert else 0] += p.numel()

    def _reduce(self, p: torch.Tensor) -> None:
        """As ZeRO's gradient hooks: the gradient goes into a reduce bucket (fp32), is reduced over
        the data-parallel ranks and lands in the fp32 gradient buffer; the parameter's own
        gradient is freed."""
        if self._reduce_buffer is None:
            total = sum(p.numel() for params, _ in self.groups for p in params)
            self._reduce_buffer = torch.empty(min(self.bucket, total), dtype=torch.float32)
            self.trace.retag(self._reduce_buffer, "comm_buffers")
        self.trace.retag(p.grad, "gradients")  # the model-dtype gradient autograd just produced
        self._arrived[1 if sharding_of(p).expert else 0] += p.numel()
        n = min(p.numel(), self._reduce_buffer.numel())
        self._reduce_buffer[:n].copy_(p.grad.reshape(-1)[:n])
        p.grad = None
        if self.zero >= 2:  # ZeRO-2 reduces in its backward hooks, a bucket at a time
            g = 1 if sharding_of(p).expert else 0
            self._pending[g] += p.numel()
            while self._pending[g] >= self.bucket:
                self._reduce_elements(g, self.bucket)
                self._pending[g] -= self.bucket

    def _reduce_elements(self, g: int, n: int) -> None:
        """DeepSpeed's reduction of `n` gradient elements of group `g` (an `all_reduce` of the bucket,
        `plan.comm.gradient_reduction`; one call per bucket here) in its communication dtype."""
        groups = self.groups[g]
        if groups[1] <= 1 or n <= 0:
            return
        if self._reduce_buffer is None or self._reduce_buffer.dtype != self.reduce_dtype:
            self._reduce_buffer = torch.empty(min(self.bucket, max(n, 1)), dtype=self.reduce_dtype)
            self.trace.retag(self._reduce_buffer, "comm_buffers")
        group = self.process_groups[g]
        dist.all_reduce(self._reduce_buffer[:n], group=group)

    def end_of_backward(self) -> None:
        """ZeRO-2's epilogue: the partly filled buckets are reduced."""
        for g in (0, 1):
            self._reduce_elements(g, self._pending[g])
            self._pending[g] = 0

    def step(self) -> None:
        self.trace.step_phase = "optimizer_step"  # the plan's optimizer step phase from here on
        if self.zero < 2:  # ZeRO-0/1: the gradients the backward produced, reduced at the step a bucket at a time
            # (ZeRO-0 in bf16: DeepSpeed's BF16_Optimizer reduces its whole flat gradient buffers)
            flat = self.zero == 0 and not self.direct
            arrived = [sum(p.numel() for p in params) for params, _ in self.groups] if flat else self._arrived
            for g, total in enumerate(arrived):
                for start in range(0, total, self.bucket):
                    self._reduce_elements(g, min(self.bucket, total - start))
        self.trace.phase = "optimizer"
        self.optimizer.step()  # the moments exist already; the update's temporaries are tagged optimizer
        self.trace.phase = "activations"
        # updated partitions back into the (bf16) parameters: all-gathered over each group,
        # `bucket` elements of output per call (DeepSpeed's allgather_bucket_size)
        for (params, shard), group in zip(self.groups, self.process_groups):
            if not params or shard <= 1 or self.zero < 1:
                continue
            dtype = params[0].dtype
            part = math.ceil(sum(p.numel() for p in params) / shard)
            chunk = max(self.bucket // shard, 1)
            for start in range(0, part, chunk):
                n = min(chunk, part - start)
                flat = torch.empty(n * shard, dtype=dtype)
                self.trace.retag(flat, "comm_buffers")
                dist.all_gather_into_tensor(flat, flat.narrow(0, 0, n), group=group)
                del flat


class _TraceEngine:
    """What `forward_backward` needs of an engine (`TrainingEngine`): a forward and a backward."""

    def __init__(self, model):
        self.model = model

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()


# ------------------------------------------------------------------ the trace
def init_fake_world(parallel, rank: int, world: int):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from dsa_train.config import resolve_sizes
    from dsa_train.parallel.groups import ParallelState

    sizes = resolve_sizes(parallel, world)
    if dist.is_initialized():
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    ps.initialize_model_parallel(tensor_model_parallel_size=sizes.tensor, context_parallel_size=sizes.context,
                                 expert_model_parallel_size=sizes.expert, create_gloo_process_groups=False)
    return ParallelState(sizes)


def close_fake_world() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def kernel_path_of(cfg, kernels: str | None = None) -> str:
    """"cuda" (the Triton kernels and library attention, as custom ops with fake implementations:
    `dsa_kernels.custom_ops`) or "cpu" (the PyTorch paths): the recipe's device's unless given."""
    if kernels is not None:
        if kernels not in ("cuda", "cpu"):
            raise ValueError(f"kernels must be 'cuda' or 'cpu', got {kernels!r}")
        return kernels
    return "cpu" if getattr(cfg.device, "value", cfg.device) == "cpu" else "cuda"


@functools.lru_cache(maxsize=None)
def _matmul_formulas() -> dict:
    """aten op packet -> FLOPs of a call from its arguments: `torch.utils.flop_counter`'s registry
    (mm, bmm, addmm, convolution, attention ops, ...) and the grouped expert GEMMs'. Counted in
    `MemoryTrace` itself, not by FlopCounterMode, whose module tracker hooks every module's inputs
    and outputs (the 671B trace kept 107 GiB of activations alive under it)."""
    from torch.utils.flop_counter import flop_registry, shape_wrapper

    return {**flop_registry, torch.ops.aten._grouped_mm: shape_wrapper(grouped_mm_flops)}


def _grouped_mm_other_dtype(func, args, kwargs):
    """`torch._grouped_mm` on fp32 / fp16 operands under FakeTensorMode: the CPU kernel takes any
    float dtype (`model/grouped_experts.py`: a CPU recipe in fp32, the demo's), but torch's meta
    function accepts bf16 only, so the fake call raises. The output's shape from a bf16 call,
    in the operands' dtype."""
    a, b, *rest = args
    out = func(a.to(torch.bfloat16), b.to(torch.bfloat16), *rest, **kwargs)
    return out.to(a.dtype)


def grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of `torch._grouped_mm(a, b, offs=...)` (`model/grouped_experts.py`), from the shapes: each
    row of a 2-D operand meets one group of the other, so 2 x (the rows' extent) x K x N in all:
    [M, K] x [G, K, N] -> [M, N] (forward, dx); [K, M] x [M, N] -> [G, K, N] (dw, groups along M);
    [G, M, K] x [K, N] -> [M, N]; [G, M, K] x [G, K, N] (batched)."""
    if len(a_shape) == 2 and len(b_shape) == 3:
        return 2 * a_shape[0] * a_shape[1] * b_shape[2]
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    if len(a_shape) == 3 and len(b_shape) == 2:  # [G, M, K] x [K, N] (groups along N) -> [M, N]
        return 2 * a_shape[1] * a_shape[2] * b_shape[1]
    return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[2]


def pack_fake_expert_weights(model) -> None:
    """A layer's local experts' weights as one [E, ...] storage per projection, as training holds
    them (DeepSpeed's flat ZeRO buffers lay a layer's experts one after the other; the single
    process packs them, `grouped_experts.pack_expert_weights`), so that the grouped GEMMs take views
    of them (`grouped_experts._Stacked`). `pack_expert_weights` leaves fake weights alone; the traced
    model's are separate storages, and its grouped GEMMs then stacked a copy of every layer's
    experts in each forward and kept it for the backward (the demo at EP 2: 4 local experts x 3 x
    [64, 128] bf16, 196,608 B a layer, counted as activations)."""
    from dsa_train.model.grouped_experts import PROJECTIONS
    from dsa_train.model.moe import MoE

    for module in model.modules():
        if not (isinstance(module, MoE) and module.grouped_gemm and len(module.experts) > 1):
            continue
        experts = list(module.experts.values())
        for name in PROJECTIONS:
            weights = [getattr(e, name).weight for e in experts]
            if any(w.shape != weights[0].shape or w.dtype != weights[0].dtype for w in weights):
                continue
            with torch.no_grad():
                stack = torch.stack([w.detach() for w in weights])
            for w, view in zip(weights, stack.unbind(0)):
                w.data = view  # the same Parameter object


def trace_step(cfg, model_cfg, rank: int = 0, world: int | None = None, stage_name: str | None = None,
               kernels: str | None = None):
    """Trace one step of `stage_name` (default: the recipe's last stage) on rank `rank` of the model
    `model_cfg` (a DSAConfig; the planner's `model_config_of(cfg)`); returns the per-category peak
    in bytes and what was traced. `kernels`: the code path traced (`kernel_path_of`; default the
    recipe device's: a CUDA recipe traces the Triton Functions, not the CPU references)."""
    import contextlib

    from dsa_kernels.chunk_ops import workspace_listener
    from dsa_kernels.custom_ops import trace_cuda_path
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dsa_train.checkpoint.skeleton import empty_model
    from dsa_train.trainer.step import forward_backward
    from dsa_train.parallel.model import parallelize_model
    from dsa_train.plan.comm import gradient_reduce_bytes, ranks_per_node
    from dsa_train.trainer.startup import materialize
    from dsa_train.parallel.reduction import parallel_reduction
    from dsa_train.plan.trace_comm import CollectiveRecorder

    cl = cfg.cluster
    world = world or cl.nodes * (cl.procs_per_node or cl.gpus_per_node)
    stage_name = stage_name or list(cfg.stages)[-1]
    stage = Stage.of(stage_name, cfg.stages[stage_name])
    dtype = getattr(torch, cfg.model.dtype.value)
    start = time.perf_counter()
    state = init_fake_world(cfg.parallel, rank, world)
    try:
        sizes = state.sizes
        model = empty_model(model_cfg)
        with torch.device("meta"):
            parallelize_model(model, state, recompute=cfg.parallel.recompute, grouped_experts=cfg.parallel.grouped_experts)
        trace = MemoryTrace()
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        recorder = CollectiveRecorder(state, ranks_per_node(cfg))
        pb = torch.finfo(dtype).bits // 8
        reduce_dtype = torch.float32 if gradient_reduce_bytes(cfg.parallel.zero_stage, pb, cfg.optim.grad_accum_dtype) == 4 \
            else dtype
        path = kernel_path_of(cfg, kernels)
        on_cuda = trace_cuda_path() if path == "cuda" else contextlib.nullcontext()
        with fake, trace, workspace_listener(trace.chunk_workspace), recorder, on_cuda:
            materialize(model, torch.device("cpu"), dtype)
            apply_dtype_policy(model, dtype)  # as the loader: model/dtypes.py
            pack_fake_expert_weights(model)
            for t in list(model.parameters()) + list(model.buffers()):
                trace.retag(t, "parameters")
            model.train()
            trainable = stage.select_trainable(model)
            zero = TracedZeroStep(trainable, state, cfg.parallel.zero_stage, trace, REDUCE_BUCKET, reduce_dtype)
            T, B = cfg.data.seq_len, cfg.data.micro_batch_size
            ids = torch.zeros(B, T, dtype=torch.long)
            batch = {"input_ids": ids, "labels": ids.clone(),
                     "position_ids": torch.arange(T).expand(B, T).contiguous()}
            # the maxima count from the step on (materializing the model allocates its parameters
            # as activations before they are retagged)
            step_start = len(trace.events)
            # the trainer's step: one micro-batch (its collectives count micro_batches times),
            # metrics reduced over the layout, then the update and the router's bias step
            forward_backward(_TraceEngine(model), [batch], stage, reduction=parallel_reduction(state))
            with recorder.phase("backward"):
                zero.end_of_backward()
            with recorder.phase("step"):
                zero.step()
                if stage.config.router_bias_update_rate and stage.kind.main_backward:
                    model.update_router_bias(stage.config.router_bias_update_rate)
        peak = {c: int(trace.peak.get(c, 0)) for c in CATEGORIES}
        return {
            "world_size": world, "rank": rank, "stage": stage_name, "layers": model_cfg.num_hidden_layers,
            "peak": peak, "peak_total": int(trace.peak_total), "peak_at": trace.peak_where,
            "peak_phase": trace.peak_phase,
            "category_max": {c: int(v) for c, v in ((c, trace.category_max(step_start).get(c, 0)) for c in CATEGORIES)},
            # the DSA buffers live at the peak by allocation site (bytes, largest first)
            "peak_dsa_sites": dict(sorted(((k, int(v)) for k, v in trace.peak_dsa_sites.items() if v),
                                          key=lambda kv: -kv[1])),
            "layout": {"tp": sizes.tensor, "cp": sizes.context, "ep": sizes.expert, "dp": sizes.data,
                       "zero": cfg.parallel.zero_stage, "recompute": cfg.parallel.recompute},
            "seconds": time.perf_counter() - start, "collectives": recorder.calls, "kernels": path,
            "kernel_ops": dict(trace.kernel_ops),
            "matmul_flops": {str(op): int(n) for op, n in trace.matmul_flops.items()},
        }
    finally:
        close_fake_world()
