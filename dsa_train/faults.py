"""Fault injection: the `DSA_FAULT` environment variable makes the trainer fail on purpose.

    DSA_FAULT="rank=1,step=3,kind=crash,at=mid_step"
    DSA_FAULT="step=4,kind=sigkill,at=checkpoint; step=6,kind=sigterm"   (several, `;`-separated)

Keys (all optional except `step`):
    step     global step (1-based: the step that becomes global step N when it completes; for
             `at=checkpoint|commit` the checkpoint written with global step N)
    rank     global rank it fires on (`RANK` of torchrun; 0 without it); `*` (default): every rank
    kind     crash    raise InjectedFault (a Python error: non-zero exit, traceback)
             sigkill  SIGKILL to the own process (no clean-up of any kind)
             sigterm, sigusr1   the signal to the own process (preemption path)
             hang     sleep forever (a stuck rank; for timeout handling)
             nan      make the step's loss and gradients NaN (the non-finite policy path)
             inf_grad make one gradient element +inf where the engine keeps it (ZeRO-2: its
                      gradient partition), the loss finite: only the gradient check sees it
             enospc   OSError(ENOSPC) from the checkpoint writer (a full disk)
    at       step       at the start of the step, before its data is read (default)
             mid_step   after forward/backward, before the optimizer update
             checkpoint inside the checkpoint write, after part of a file is on disk
             commit     after the checkpoint directory is renamed into place, before the
                        `latest` pointer is updated
             (`nan` always fires after backward; `enospc` always inside the checkpoint write)
    restart  restart count it fires on (default 0: only the first attempt), compared with
             `TORCHELASTIC_RESTART_COUNT` (torchrun) or `SLURM_RESTART_COUNT`; a restarted job
             does not fail again at the same step. `*`: every attempt.

A malformed `DSA_FAULT` raises ValueError naming the problem: a fault switch that silently does
nothing would make a reliability test pass for the wrong reason.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import dataclass

from dsa_train.errors import DSATrainError

ENV = "DSA_FAULT"
KINDS = ("crash", "sigkill", "sigterm", "sigusr1", "sigint", "hang", "nan", "inf_grad", "enospc", "erofs")
POISON_KINDS = ("nan", "inf_grad")  # fire after backward, through the trainer
POINTS = ("step", "mid_step", "checkpoint", "commit")


class FaultSwitchError(DSATrainError, ValueError):
    """A malformed DSA_FAULT (one line, exit 2)."""


class InjectedFault(RuntimeError):
    """Raised by `kind=crash`."""


@dataclass(frozen=True)
class Fault:
    step: int
    kind: str = "crash"
    at: str = "step"
    rank: int | None = None  # None: every rank
    restart: int | None = 0  # None: every attempt

    def point(self) -> str:
        if self.kind in POISON_KINDS:
            return "mid_step"
        if self.kind in ("enospc", "erofs"):
            return "checkpoint"
        return self.at


def parse(spec: str) -> list[Fault]:
    faults = []
    for part in spec.split(";"):
        part = part.strip()
        if not part:
            continue
        fields: dict = {}
        for item in part.split(","):
            key, sep, value = item.partition("=")
            key, value = key.strip(), value.strip()
            if not sep or not key:
                raise FaultSwitchError(f"{ENV}: {item.strip()!r} in {part!r} is not key=value")
            fields[key] = value
        unknown = set(fields) - {"step", "kind", "at", "rank", "restart"}
        if unknown:
            raise FaultSwitchError(f"{ENV}: unknown key(s) {sorted(unknown)} in {part!r}; keys: step, kind, at, rank, restart")
        if "step" not in fields:
            raise FaultSwitchError(f"{ENV}: {part!r} has no step=N")
        kind = fields.get("kind", "crash")
        at = fields.get("at", "step")
        if kind not in KINDS:
            raise FaultSwitchError(f"{ENV}: kind={kind!r} in {part!r}; one of {', '.join(KINDS)}")
        if at not in POINTS:
            raise FaultSwitchError(f"{ENV}: at={at!r} in {part!r}; one of {', '.join(POINTS)}")
        try:
            step = int(fields["step"])
            rank = None if fields.get("rank", "*") == "*" else int(fields["rank"])
            restart = None if fields.get("restart", "0") == "*" else int(fields.get("restart", "0"))
        except ValueError:
            raise FaultSwitchError(f"{ENV}: step, rank and restart must be integers (rank/restart may be *) in {part!r}")
        faults.append(Fault(step=step, kind=kind, at=at, rank=rank, restart=restart))
    return faults


def current_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def restart_count() -> int:
    for var in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        if os.environ.get(var):
            return int(os.environ[var])
    return 0


def active() -> list[Fault]:
    """Faults of DSA_FAULT that apply to this process (rank and restart count)."""
    spec = os.environ.get(ENV, "")
    if not spec.strip():
        return []
    rank, restart = current_rank(), restart_count()
    return [
        f for f in parse(spec)
        if (f.rank is None or f.rank == rank) and (f.restart is None or f.restart == restart)
    ]


def _matching(point: str, step: int) -> list[Fault]:
    return [f for f in active() if f.step == step and f.point() == point]


def fire(fault: Fault) -> None:
    where = f"rank {current_rank()} at {fault.point()} of step {fault.step}"
    if fault.kind == "crash":
        raise InjectedFault(f"{ENV}: injected crash on {where}")
    if fault.kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # the signal is delivered asynchronously
    if fault.kind in ("sigterm", "sigusr1", "sigint"):
        os.kill(os.getpid(), getattr(signal, fault.kind.upper()))
        return
    if fault.kind == "hang":
        while True:
            time.sleep(3600)
    if fault.kind == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device ({ENV}: injected on {where})")
    if fault.kind == "erofs":
        raise OSError(errno.EROFS, f"Read-only file system ({ENV}: injected on {where})")


def at(point: str, step: int) -> None:
    """Fire the process-level faults (crash, signals, hang) registered for `point` of `step`."""
    for fault in _matching(point, step):
        if fault.kind not in POISON_KINDS:
            fire(fault)


def poison_step(step: int) -> bool:
    """True when a `kind=nan` fault is set for `step` (the trainer then makes its loss and
    gradients NaN)."""
    return any(f.kind == "nan" for f in _matching("mid_step", step))


def inf_gradient_step(step: int) -> bool:
    """True when a `kind=inf_grad` fault is set for `step` on this rank (the trainer then makes
    one of the gradients it holds +inf)."""
    return any(f.kind == "inf_grad" for f in _matching("mid_step", step))


def requested() -> bool:
    """True when `DSA_FAULT` is set: only then do the trainer and the checkpoint writer take
    their fault hooks (`trainer/hooks.py` InjectedFaults, `checkpoint_faults`)."""
    return bool(os.environ.get(ENV, "").strip())


class CheckpointFaults:
    """The checkpoint writer's fault wrapper (checkpoint/training.py), with no fault: `on_write`
    runs before each chunk a checkpoint file gets, `on_commit` after the checkpoint directory is
    renamed into place, before `latest` is updated. `checkpoint_faults` gives this one (every
    hook a no-op) unless `DSA_FAULT` is set."""

    def on_write(self) -> None:
        pass

    def on_commit(self) -> None:
        pass


NO_FAULTS = CheckpointFaults()


class WriteFaults(CheckpointFaults):
    """`DSA_FAULT`'s faults for the checkpoint of `step`: the `at=checkpoint` ones (and `enospc`)
    fire on the second chunk written, so part of a file is already on disk; the `at=commit` ones
    after the rename."""

    def __init__(self, step: int, disk_freed: bool = False):
        # `enospc` stands for a full disk: it no longer fires once a checkpoint was pruned for room
        self.faults = [f for f in _matching("checkpoint", step) if not (disk_freed and f.kind == "enospc")]
        self.chunks = 0
        self.step = step

    def on_write(self) -> None:
        if not self.faults:
            return
        self.chunks += 1
        if self.chunks >= 2:
            faults, self.faults = self.faults, []
            for fault in faults:
                fire(fault)

    def on_commit(self) -> None:
        at("commit", self.step)


def checkpoint_faults(step: int, disk_freed: bool = False) -> CheckpointFaults:
    """The one factory of the checkpoint writer's fault wrapper for the checkpoint of `step`
    (`disk_freed`: a retry after pruning for room, where `enospc` no longer fires): `NO_FAULTS`
    unless `DSA_FAULT` is set."""
    return WriteFaults(step, disk_freed) if requested() else NO_FAULTS
