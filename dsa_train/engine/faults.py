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


class WriteFaults:
    """The checkpoint writer's hook: fires `at=checkpoint` faults (and `enospc`) for the
    checkpoint of `step` on the second chunk written, so part of a file is already on disk."""

    def __init__(self, step: int, disk_freed: bool = False):
        # `enospc` stands for a full disk: it no longer fires once a checkpoint was pruned for room
        self.faults = [f for f in _matching("checkpoint", step) if not (disk_freed and f.kind == "enospc")]
        self.chunks = 0

    def on_write(self) -> None:
        if not self.faults:
            return
        self.chunks += 1
        if self.chunks >= 2:
            faults, self.faults = self.faults, []
            for fault in faults:
                fire(fault)
