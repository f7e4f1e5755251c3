"""Preemption: SIGTERM / SIGUSR1 ask the trainer to checkpoint at the next step boundary and exit.

Slurm sends SIGUSR1 (with `--signal=USR1@<seconds>`) as a warning before the end of a time limit
or a preemption, and SIGTERM when it cancels or preempts a job (followed by SIGKILL after
`KillWait`, 30 s by default); torchrun forwards SIGTERM to its workers. The handler only records
the signal; the training loop checks it between steps (a step is never cut in half), writes a
checkpoint and raises `Preempted`, a SystemExit with code 75 (EX_TEMPFAIL: "try again"), so the
process ends without a traceback and a wrapper can tell a preempted run from a finished one
(0) and from a failure (1). Run the same command again (or requeue the job) and it resumes.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from pathlib import Path

from dsa_train.errors import SignalOutsideTraining
from dsa_train.runtime import warn_rank_local

log = logging.getLogger(__name__)

EXIT_PREEMPTED = 75  # os.EX_TEMPFAIL
DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")


EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C


class Preempted(SystemExit):
    """A run stopped by a preemption signal (or Ctrl-C) after writing its checkpoint."""

    def __init__(self, message: str, result=None, checkpoint=None, code: int = EXIT_PREEMPTED):
        super().__init__(code)
        self.message = message
        self.result = result  # TrainResult so far
        self.checkpoint = checkpoint

    def __str__(self) -> str:
        return self.message


def resolve(names) -> list[signal.Signals]:
    out = []
    for name in names:
        key = str(name).upper()
        key = key if key.startswith("SIG") else "SIG" + key
        if not hasattr(signal, key):
            raise ValueError(f"unknown signal {name!r}")
        out.append(getattr(signal, key))
    return out


class Interrupted(SystemExit):
    """A second Ctrl-C: stop at once, without the checkpoint (exit 130)."""

    def __init__(self, message: str):
        super().__init__(EXIT_INTERRUPTED)
        self.message = message

    def __str__(self) -> str:
        return self.message


class PreemptionHandler:
    """Installs handlers for `names` and, with `interrupt`, for SIGINT (Ctrl-C), in the main thread
    only; they record the first signal received. Ctrl-C is handled like a preemption signal
    (checkpoint at the next step boundary, exit 130); a second Ctrl-C raises `Interrupted` at once.
    `restore()` puts the previous handlers back."""

    def __init__(self, names=DEFAULT_SIGNALS, interrupt: bool = True):
        self.received: int | None = None
        self._previous: dict[int, object] = {}
        if threading.current_thread() is not threading.main_thread():
            log.warning("preemption signals not handled: the trainer does not run in the main thread")
            return
        sigs = resolve(names)
        if interrupt and signal.SIGINT not in sigs:
            sigs.append(signal.SIGINT)
        for sig in sigs:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum
            if signum == signal.SIGINT:
                log.warning("Ctrl-C: checkpointing at the next step boundary, then exiting (code %d); "
                            "press Ctrl-C again to stop at once without the checkpoint", EXIT_INTERRUPTED)
            else:
                log.warning("received %s: checkpointing at the next step boundary, then exiting (code %d)",
                            signal.Signals(signum).name, EXIT_PREEMPTED)
        elif signum == signal.SIGINT:
            self.restore()  # a third Ctrl-C gets Python's default
            message = ("dsa-train: stopped by a second Ctrl-C before the checkpoint: the steps since the last "
                       "checkpoint are lost; run the same command again to resume from it")
            print(message, file=sys.stderr, flush=True)
            raise Interrupted(message)

    @property
    def exit_code(self) -> int:
        return EXIT_INTERRUPTED if self.received == signal.SIGINT else EXIT_PREEMPTED

    def describe(self) -> str:
        return "Ctrl-C (SIGINT)" if self.received == signal.SIGINT else self.name

    @property
    def requested(self) -> bool:
        return self.received is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else ""

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}


# ---------------------------------------------------------------------------------------------
# Preemption and torchrun restarts in one Slurm allocation. A preempted rank exits 75, which
# torchrun (--max-restarts > 0) takes for a failure and answers by restarting the workers on the
# allocation that is about to end. The preempted ranks leave a marker for their allocation (job
# id + Slurm restart count: a requeued job is a new allocation); a restarted worker that finds
# it exits 75 again at once, so torchrun runs out of restarts quickly and the batch script
# requeues the job.


def allocation_id() -> str | None:
    """This Slurm allocation ('<job id>.<requeue count>'), None outside Slurm."""
    job = os.environ.get("SLURM_JOB_ID")
    return f"{job}.{os.environ.get('SLURM_RESTART_COUNT', '0') or '0'}" if job else None


def _marker(run_dir) -> Path | None:
    alloc = allocation_id()
    return Path(run_dir) / f".preempted-{alloc}" if alloc else None


def mark_preempted(run_dir) -> None:
    marker = _marker(run_dir)
    if marker is not None:
        try:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
        except OSError as err:  # the checkpoint is written already; the marker only saves restarts
            warn_rank_local(log, "could not write the preemption marker %s: %s", marker, err)  # this rank's I/O


def exit_if_preempted_earlier(run_dir) -> None:
    """In a torchrun restart (TORCHELASTIC_RESTART_COUNT > 0) of an allocation that was
    preempted, exit 75 before doing any work."""
    marker = _marker(run_dir)
    if marker is None or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) == 0 or not marker.exists():
        return
    message = (f"this Slurm allocation ({allocation_id()}) was preempted and its checkpoint written; "
               "not restarting on it (the job is requeued and resumes)")
    log.warning(message)
    raise Preempted(message)


# ---------------------------------------------------------------------------------------------
# Signals outside the training loop (start-up: composing the recipe, preparing the data cache,
# loading the model, resuming; and the end: export). No step is in progress, so there is nothing
# to checkpoint: the signal unwinds the stack (temporary files are removed on the way out, e.g.
# prepare-data's `.tmp-<pid>` folder), and the command ends with one line and exit 75, like a
# preemption during training. The training loop's PreemptionHandler takes over from these
# handlers while it runs and puts them back after.


_INSTALLED_IN: int | None = None  # the pid that installed the start-up handlers


def _raise_signal(signum, frame) -> None:
    if os.getpid() != _INSTALLED_IN:  # a forked child (data loader worker): die of the signal as before
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    raise SignalOutsideTraining(signum)


class startup_signals:  # noqa: N801 (a context manager, used as `with startup_signals():`)
    """Handle `names` (SIGTERM, SIGUSR1) by raising SignalOutsideTraining until the block ends;
    the block's SignalOutsideTraining becomes its line and SystemExit(75)."""

    def __init__(self, names=DEFAULT_SIGNALS):
        self.names = names
        self.previous: dict[int, object] = {}

    def __enter__(self):
        global _INSTALLED_IN
        _INSTALLED_IN = os.getpid()
        if threading.current_thread() is threading.main_thread():
            for sig in resolve(self.names):
                self.previous[sig] = signal.signal(sig, _raise_signal)
        return self

    def __exit__(self, kind, err, tb):
        for sig, previous in self.previous.items():
            signal.signal(sig, previous)
        self.previous = {}
        if isinstance(err, SignalOutsideTraining):
            print(str(err), file=sys.stderr, flush=True)
            raise SystemExit(err.code) from None
        return False
