"""One run per run directory: a lock file that names its holder.

Two runs writing checkpoints into one directory corrupt each other's saves (both prune, both
replace `latest`). The trainer's rank 0 takes `<run_dir>/.dsa-train.lock` (and the same in
`checkpoint.dir` when that lies outside the run directory) before it resumes, and removes it when
the process ends. The other ranks take nothing: one lock per run, however many ranks and nodes.

The lock is a file created with O_CREAT | O_EXCL (atomic on local file systems and on NFSv3+ /
Lustre / GPFS, unlike flock, which NFS does not carry between nodes). It holds JSON: host, pid,
start time, and the job it belongs to (Slurm job id, or torchrun's run id and rendezvous
endpoint). A second run finds it and stops with `RunDirLocked` naming the holder. A lock is stale
and taken over (with a warning) when
  * its holder ran on this host and that pid no longer exists (a killed run), or
  * it belongs to the same job as this process (a torchrun restart or a Slurm requeue: the job's
    earlier attempt is gone, whatever node its rank 0 ran on).
A lock held by another host's live-looking process cannot be checked from here: the message says
how to remove it when that run is known to be gone.
"""

from __future__ import annotations

import atexit
import errno
import json
import logging
import os
import socket
import time
from pathlib import Path

from dsa_train.errors import DSATrainError
from dsa_train.tempdirs import pid_alive

log = logging.getLogger(__name__)

LOCK_NAME = ".dsa-train.lock"


class RunDirLocked(DSATrainError, RuntimeError):
    """Another run holds the run directory."""


class RunDirNotWritable(DSATrainError, PermissionError):
    """The run directory (or checkpoint.dir) cannot be written."""


def job_identity() -> str | None:
    """What identifies this launch across its restarts (None for a plain process)."""
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm:{os.environ['SLURM_JOB_ID']}"
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return (f"torchrun:{os.environ['TORCHELASTIC_RUN_ID']}@{os.environ.get('MASTER_ADDR', '')}:"
                f"{os.environ.get('MASTER_PORT', '')}")
    return None


class RunLock:
    def __init__(self, directory: str | os.PathLike):
        self.path = Path(directory) / LOCK_NAME
        self.held = False
        self.info = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                     "job": job_identity()}

    def _holder(self) -> dict | None:
        try:
            data = json.loads(self.path.read_text())
            return data if isinstance(data, dict) else {}
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # being written, or garbage: treated as held by an unknown run

    def _stale_reason(self, holder: dict) -> str | None:
        if holder.get("host") == self.info["host"] and isinstance(holder.get("pid"), int):
            if holder["pid"] == os.getpid():
                return "held by this process"
            if not pid_alive(holder["pid"]):
                return f"its process {holder['pid']} on this host is gone"
        if holder.get("job") and holder.get("job") == self.info["job"]:
            return f"it belongs to an earlier attempt of this job ({holder['job']})"
        return None

    def acquire(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is None:  # removed in the meantime
                    continue
                reason = self._stale_reason(holder)
                if reason is None:
                    who = (f"{holder.get('host', '?')} pid {holder.get('pid', '?')}, started {holder.get('started', '?')}"
                           + (f", job {holder['job']}" if holder.get("job") else "")) if holder else "an unknown run"
                    raise RunDirLocked(
                        f"{self.path.parent} is in use by another run ({who}): two runs in one directory "
                        "overwrite each other's checkpoints",
                        fix=f"wait for it to finish, or use another run_dir; if that run is gone, delete {self.path}")
                # take over a stale lock: rename it away first, so that of two processes recovering
                # the same lock only one succeeds (the other's rename fails and it retries)
                aside = self.path.with_name(f"{LOCK_NAME}.stale.{os.getpid()}")
                try:
                    os.replace(self.path, aside)
                    aside.unlink(missing_ok=True)
                except FileNotFoundError:
                    continue
                if reason != "held by this process":
                    log.warning("run lock %s was stale (%s): taking it over", self.path, reason)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self.info, f)
                f.flush()
                os.fsync(f.fileno())
            self.held = True
            atexit.register(self.release)
            return self
        raise RunDirLocked(f"could not take the run lock {self.path} (other processes keep taking it)",
                           fix="make sure only one run uses this run_dir")

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        holder = self._holder()
        if holder and holder.get("pid") == self.info["pid"] and holder.get("host") == self.info["host"]:
            self.path.unlink(missing_ok=True)


def lock_run(run_dir, checkpoint_dir) -> list[RunLock]:
    """Take the run directory's lock (and checkpoint.dir's when it lies outside the run dir)."""
    run_dir = Path(run_dir).resolve()
    dirs = [run_dir]
    ckpt = Path(checkpoint_dir).resolve()
    if run_dir != ckpt and run_dir not in ckpt.parents:
        dirs.append(ckpt)
    locks = []
    try:
        for d in dirs:
            try:
                locks.append(RunLock(d).acquire())
            except OSError as err:  # cannot create the directory or the lock file
                permission = err.errno in (errno.EACCES, errno.EPERM, errno.EROFS)
                raise RunDirNotWritable(
                    f"cannot write to {d}: {err.strerror or err}"
                    + (" (a permission problem, not a full disk)" if permission else ""),
                    fix="make it writable, or set run_dir (and checkpoint.dir) to a writable directory") from err
    except BaseException:
        for lock in locks:
            lock.release()
        raise
    return locks
