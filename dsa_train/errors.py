"""The project's one error base class, and the one place that turns it into a message.

Every error the project raises on purpose (a bad recipe, an unreadable checkpoint, a data file it
cannot parse, a run directory held by another run, a full disk, ...) derives from `DSATrainError`.
Its message names the problem and the fix; the command line prints it as one line

    dsa-train: <problem> — <fix>

and exits with `EXIT_USER_ERROR` (2), never with a traceback. Anything else that escapes is a bug
and keeps its traceback (exit 1). Preemption is not an error: `engine.signals.Preempted` exits 75.

Exit codes of `dsa-train` and of the per-rank `python -m dsa_train.launch.rank`:
    0  finished            1  a bug (traceback)          2  an error the user can fix (one line)
    75 preempted or interrupted after a checkpoint: run the same command again to resume

Under torchrun a rank that fails with a `DSATrainError` records it in torchrun's error file; the
restarted workers find it and exit 2 before loading anything (`exit_if_failed_earlier`): a restart
cannot fix a bad recipe or a full disk, so the job ends within seconds instead of repeating it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Callable

EXIT_USER_ERROR = 2


class DSATrainError(Exception):
    """An error the user can fix. `str(err)` is `<problem> — <fix>` (or the message alone when it
    already says what to do). Subclasses keep their historical built-in bases (ValueError,
    RuntimeError, ...) so that existing `except ValueError` callers still see them."""

    exit_code = EXIT_USER_ERROR

    def __init__(self, message: str, fix: str | None = None):
        self.problem = message
        self.fix = fix
        super().__init__(f"{message} — {fix}" if fix else message)


def one_line(err: BaseException, prefix: str = "dsa-train") -> str:
    """The message printed for `err`: `<prefix>: ...` (a ConfigError listing several problems
    keeps one line per problem)."""
    text = str(err).strip()
    return text if text.startswith("dsa-train") else f"{prefix}: {text}"


def report(err: DSATrainError, prefix: str = "dsa-train") -> int:
    """Print `err` as the user sees it; returns the exit code."""
    sys.stderr.flush()
    print(one_line(err, prefix), file=sys.stderr, flush=True)
    _record_for_torchrun(err)
    return err.exit_code


EXIT_INTERRUPTED = 130
EXIT_PREEMPTED = 75


class SignalOutsideTraining(BaseException):
    """SIGTERM / SIGUSR1 outside the training loop (signals.py `startup_signals`): a
    BaseException, so that no `except Exception` on the way keeps it; exits 75 with one line."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum
        self.code = EXIT_PREEMPTED

    def __str__(self) -> str:
        import signal

        name = signal.Signals(self.signum).name
        return (f"dsa-train: stopped by {name} outside the training loop (no step was running; checkpoints are "
                "written atomically, nothing was lost) — run the same command again to resume")


def run_reporting(func: Callable[[], int | None], prefix: str = "dsa-train") -> int:
    """Call `func`; a DSATrainError becomes its one line and exit code (the one place that does).
    Ctrl-C outside the training loop (which checkpoints first: signals.py) exits 130."""
    try:
        return int(func() or 0)
    except DSATrainError as err:
        return report(err, prefix)
    except SignalOutsideTraining as err:  # SIGTERM / SIGUSR1 before or after the training loop
        print(str(err), file=sys.stderr, flush=True)
        return err.code
    except KeyboardInterrupt:
        print(f"{prefix}: interrupted (Ctrl-C) — nothing was being trained yet, or the run had ended; "
              "run the same command again to resume", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED


# ---------------------------------------------------------------------------------------------
# torchrun: do not restart a run whose failure a restart cannot fix. torchrun gives every worker
# TORCHELASTIC_ERROR_FILE (<log dir>/attempt_<n>/<local rank>/error.json; its failure summary
# shows the message written there). The restarted workers of attempt n+1 read the files of
# attempt n next to theirs.

_MARK = "dsa_train_error"


def _record_for_torchrun(err: DSATrainError) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        import time

        first = getattr(err, "original", None) or one_line(err)
        Path(path).write_text(json.dumps({"message": one_line(err), "timestamp": int(time.time()), _MARK: True,
                                          "original": first}))
    except OSError:
        pass


def failure_of_previous_attempt() -> str | None:
    """The message of a DSATrainError that ended this torchrun's previous attempt on this node."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if not path or attempt == 0:
        return None
    attempt_dir = Path(path).parent.parent  # .../attempt_<n>/<local rank>/error.json
    if not attempt_dir.name.startswith("attempt_"):
        return None
    for n in range(attempt - 1, -1, -1):
        for f in sorted(attempt_dir.parent.glob(f"attempt_{n}/*/error.json")):
            try:
                data = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(data, dict) and data.get(_MARK):
                return str(data.get("original") or data.get("message"))
    return None


class FailedEarlier(DSATrainError):
    """A torchrun restart after a failure that a restart cannot fix; `original` is that failure."""

    def __init__(self, original: str):
        self.original = original
        super().__init__(f"not restarting after: {original.removeprefix('dsa-train: ')}")


def exit_if_failed_earlier() -> None:
    """In a torchrun restart whose previous attempt ended with a DSATrainError: exit 2 at once
    (local rank 0 says why in one line; the other ranks exit quietly)."""
    message = failure_of_previous_attempt()
    if message is None:
        return
    if int(os.environ.get("LOCAL_RANK", "0") or 0) != 0:
        _record_for_torchrun(FailedEarlier(message))
        raise SystemExit(EXIT_USER_ERROR)
    raise FailedEarlier(message)
