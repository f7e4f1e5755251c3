"""Temporary folders named after the process that writes them (`<prefix><pid>`), and the removal of
those whose process is gone (killed, or a machine restart). Imports only the standard library."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this machine (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def remove_dead_temporaries(parent: Path, prefix: str) -> list[Path]:
    """Remove the folders `parent/<prefix><pid>` whose process is gone (never this process's own);
    returns what was removed."""
    removed: list[Path] = []
    if not parent.is_dir():
        return removed
    for p in parent.glob(prefix + "*"):
        pid = p.name[len(prefix):]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed
