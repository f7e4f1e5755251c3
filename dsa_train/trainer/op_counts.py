"""What a training step asks of the host, counted on any device (the CPU included): the ATen
operators it dispatches (on a GPU, about one kernel launch each) and the points where the host
reads a tensor's values (on a GPU, each one waits for the device).

    with StepCounts() as counts:
        trainer.train_step(...)
    counts.ops["aten.mm"], counts.reads, counts.kernels

* `ops`: every ATen operator that reaches the dispatcher below autograd (a TorchDispatchMode),
  by overload packet (`aten.mm`, `aten.isfinite`, ...). Composite operators are counted as the
  ones they decompose into (`isfinite` is `eq`, `abs`, `ne`, `mul`), which is what a GPU launches.
  A custom operator counts once (its own implementation's operators are not seen).
* `kernels`: `ops` without views and metadata-only operators (what launches work on a GPU).
* `reads`: host reads of tensor values, by kind: `item` (`aten._local_scalar_dense`: `.item()`,
  `float(t)`, `int(t)`, `bool(t)`, `if t:`), and, seen as Python calls (a TorchFunctionMode, since
  on the CPU they dispatch nothing), `tolist`, `cpu`, `numpy`, and `to` the CPU of a tensor on
  another device (`copy_to_cpu` / `to_cpu`: GPU runs only; on a CPU run `.to(device)` cannot be
  told from a read). On a GPU each waits for the work queued before it (a stream synchronization
  or a blocking copy), unless the tensor lives on the host (AdamW's step counters: an `item` here).

Counting costs a Python call per operator: measure counts with it, never times.
"""

from __future__ import annotations

import functools
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# operators that launch nothing on a GPU (views, metadata, allocation without initialization)
NO_KERNEL = {
    "aten.empty", "aten.empty_strided", "aten.empty_like", "aten.detach", "aten.alias", "aten.lift_fresh",
    "aten._local_scalar_dense", "aten.set_", "aten.resize_", "aten.is_same_size", "aten.sym_size", "aten.sym_stride",
    "aten.sym_numel", "aten.sym_storage_offset", "aten.is_nonzero", "aten.record_stream",
}
HOST_READ_METHODS = {"tolist": "tolist", "cpu": "cpu", "numpy": "numpy"}


def _is_cpu_target(args, kwargs) -> bool:
    for a in (*args[1:], kwargs.get("device")):
        if isinstance(a, (str, torch.device)):
            return torch.device(a).type == "cpu"
    return False


class _Ops(TorchDispatchMode):
    def __init__(self, counts: "StepCounts"):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)  # "aten.mm", "dsa.sparse_mla_fwd", ...
        self.counts.op(name)
        if func is torch.ops.aten._local_scalar_dense.default:
            self.counts.read("item")
        elif name in ("aten._to_copy", "aten.copy_") and args and isinstance(args[0], torch.Tensor):
            src = args[1] if name == "aten.copy_" else args[0]
            dst_cpu = (args[0].device.type == "cpu") if name == "aten.copy_" else (
                torch.device(kwargs.get("device", src.device)).type == "cpu")
            if isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst_cpu:
                self.counts.read("copy_to_cpu")  # a device -> host copy (GPU runs)
        return func(*args, **kwargs)


class _Reads(TorchFunctionMode):
    def __init__(self, counts: "StepCounts"):
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in HOST_READ_METHODS and args and isinstance(args[0], torch.Tensor):
            self.counts.read(HOST_READ_METHODS[name])
        elif (name == "to" and args and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu"
              and _is_cpu_target(args, kwargs)):
            self.counts.read("to_cpu")  # a device tensor to the host (on a CPU run `.to(device)` is not one)
        return func(*args, **kwargs)


class StepCounts:
    """Counts the operators and host reads of the enclosed code (this thread and the autograd
    engine's, which inherits the modes)."""

    def __init__(self, where: bool = False, where_ops: tuple[str, ...] = ()):
        self.ops: Counter = Counter()
        self.reads: Counter = Counter()
        self.phase = "step"  # what counts also goes to phase_ops / phase_reads[phase] (`in_phase`)
        self.phase_ops: dict[str, Counter] = {}
        self.phase_reads: dict[str, Counter] = {}
        self.read_files: Counter = Counter()  # the file (innermost frame outside torch) of each read
        # (kind, "file:line < caller < caller") of each read and of each op named in `where_ops`
        self.where: Counter | None = Counter() if where or where_ops else None
        self.where_ops = set(where_ops)
        self._modes: list = []

    def read(self, kind: str) -> None:
        self.reads[kind] += 1
        self.phase_reads.setdefault(self.phase, Counter())[kind] += 1
        self.read_files[_caller_file()] += 1
        self.place(kind)

    def op(self, name: str) -> None:
        self.ops[name] += 1
        self.phase_ops.setdefault(self.phase, Counter())[name] += 1
        if name in self.where_ops:
            self.place(name)

    def in_phase(self, phase: str, fn):
        """`fn` wrapped so that what it dispatches and reads counts under `phase` as well."""
        @functools.wraps(fn)  # keeps marks such as the LR scheduler's on an optimizer's step
        def wrapped(*args, **kwargs):
            saved, self.phase = self.phase, phase
            try:
                return fn(*args, **kwargs)
            finally:
                self.phase = saved
        return wrapped

    def kernels_in(self, phase: str) -> int:
        return _kernels(self.phase_ops.get(phase, Counter()))

    def reads_outside(self, *parts: str) -> int:
        """Host reads whose caller's file path contains none of `parts` (e.g. the reference
        kernels' own reads, which a GPU run does not make: "/ops/", "dsa_kernels/masking")."""
        return sum(n for f, n in self.read_files.items() if not any(p in f for p in parts))

    def place(self, kind: str) -> None:
        if self.where is not None:
            import traceback

            frames = [f for f in traceback.extract_stack()[:-3] if "op_counts.py" not in f.filename
                      and "/torch/" not in f.filename]
            self.where[(kind, " < ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}" for f in frames[-3:][::-1]))] += 1

    def __enter__(self) -> "StepCounts":
        self._modes = [_Reads(self), _Ops(self)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = []

    @property
    def kernels(self) -> int:
        return _kernels(self.ops)

    @property
    def host_reads(self) -> int:
        return sum(self.reads.values())

    def summary(self, top: int = 12) -> dict:
        """{"kernels", "host_reads", "reads" {kind: n}, "top_ops" [[name, n], ...]} (JSON-ready)."""
        return {"kernels": self.kernels, "host_reads": self.host_reads, "reads": dict(sorted(self.reads.items())),
                "top_ops": [[n, c] for n, c in self.ops.most_common(top)]}


def _kernels(ops: Counter) -> int:
    return sum(n for name, n in ops.items() if name not in NO_KERNEL and not _is_view(name))


def _caller_file() -> str:
    import traceback

    for frame in reversed(traceback.extract_stack()[:-3]):
        if "op_counts.py" not in frame.filename and "/torch/" not in frame.filename:
            return frame.filename
    return "?"


@functools.lru_cache(maxsize=None)
def _is_view(name: str) -> bool:
    op = getattr(torch.ops.aten, name.removeprefix("aten."), None) if name.startswith("aten.") else None
    if op is None:
        return False
    try:
        return any(getattr(op, o).is_view for o in op.overloads())
    except (AttributeError, RuntimeError):
        return False


def count_training_steps(recipe: str, overrides: list[str], distributed: bool = False) -> list[dict]:
    """Runs `recipe` with `overrides` in this process (`distributed`: as rank 0 of a 1-rank
    torch.distributed job, the DeepSpeed engine of the parallel layouts) and returns, per training
    step of `Trainer.train_step` (forward, backward, the step hooks and the update): {"stage",
    "step", "logged", "kernels", "host_reads", "reads", "ops", "read_files", "update_kernels",
    "update_ops", "phase_reads" {"step" | "update" | "optimizer": {kind: n}}}. The update phase is the non-finite check and `engine.step`
    without the optimizer's own `step` (AdamW's per-parameter loop on the CPU; foreach on a GPU)."""
    import os

    from dsa_train.config import load_recipe
    from dsa_train.trainer.hooks import NonFiniteGuard
    from dsa_train.trainer.trainer import Trainer

    rows: list[dict] = []
    active: list[StepCounts] = []

    def phase(name: str, fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            if not active:
                return fn(*args, **kwargs)
            return active[-1].in_phase(name, fn)(*args, **kwargs)
        return wrapped

    class Counting(Trainer):
        def open_stage(self, stage) -> None:
            super().open_stage(stage)
            engine = self.engine
            engine.step = phase("update", engine.step)
            # the torch optimizer's own step (DeepSpeed: the AdamW its ZeRO optimizer wraps; the ZeRO
            # optimizer's gradient norm, clipping and overflow checks stay in the update phase)
            ds = getattr(engine, "ds", None)
            opt = engine.optimizer if ds is None else getattr(ds.optimizer, "optimizer", ds.optimizer)
            opt.step = phase("optimizer", opt.step)
            for hook in self.step_hooks:
                if isinstance(hook, NonFiniteGuard):
                    hook.skip_update = phase("update", hook.skip_update)

        def train_step(self, micro_batches, measure_recall: bool = False):
            with StepCounts() as counts:
                active.append(counts)
                try:
                    metrics = super().train_step(micro_batches, measure_recall=measure_recall)
                finally:
                    active.pop()
            update = counts.phase_ops.get("update", Counter())
            rows.append({"stage": self.stage.name, "step": self.state.global_step + 1, "logged": measure_recall,
                         "kernels": counts.kernels, "host_reads": counts.host_reads, "reads": dict(counts.reads),
                         "ops": dict(counts.ops), "read_files": dict(counts.read_files),
                         "update_kernels": counts.kernels_in("update"), "update_ops": dict(update),
                         "phase_reads": {k: dict(v) for k, v in counts.phase_reads.items()}})
            return metrics

    cfg = load_recipe(recipe, overrides)
    if not distributed:
        Counting(cfg).run()
        return rows
    from dsa_train.parallel.groups import destroy_parallel

    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": os.environ.get("DSA_COUNT_PORT", "29533")}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        Counting(cfg, distributed=True).run()
    finally:
        destroy_parallel()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return rows


def main(argv: list[str] | None = None) -> int:
    """`python -m dsa_train.trainer.op_counts [--distributed] [--json OUT] RECIPE [overrides...]`:
    one line per training step (stage, step, logged, operators, host reads by kind, update
    operators, host reads outside the reference kernels and AdamW's own step); `--json` writes
    every count."""
    import argparse
    import json
    import os
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="python -m dsa_train.trainer.op_counts", description=main.__doc__)
    parser.add_argument("--distributed", action="store_true", help="rank 0 of a 1-rank job (the DeepSpeed engine)")
    parser.add_argument("--json", type=Path, help="write every step's counts here")
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    rows = count_training_steps(args.recipe, args.overrides, distributed=args.distributed)
    import dsa_kernels

    kernels_dir = os.path.dirname(os.path.abspath(dsa_kernels.__file__))
    for r in rows:
        outside = (sum(n for f, n in r["read_files"].items() if not os.path.abspath(f).startswith(kernels_dir))
                   - sum(r["phase_reads"].get("optimizer", {}).values()))
        print(f"{r['stage']} step {r['step']}{' (logged)' if r['logged'] else ''}: {r['kernels']} operators, "
              f"host reads {r['reads']} ({outside} outside the reference kernels and AdamW), "
              f"update {r['update_kernels']} operators, mm {r['ops'].get('aten.mm', 0)}, "
              f"grouped mm {r['ops'].get('aten._grouped_mm', 0)}")
    if args.json:
        args.json.write_text(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
