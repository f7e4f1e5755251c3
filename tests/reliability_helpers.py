"""Shared by the Reliability III tests (issue 30): run `dsa-train` in this process, assert one line
without a traceback, and hash folders to show that nothing outside a command's own output changed."""

from __future__ import annotations

import hashlib
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# the demo recipe, two tiny stages of two steps, a checkpoint after every step
TINY = [
    "~stages.pretrain", "logging.wandb_mode=disabled", "logging.progress_bar=false", "data.seq_len=64",
    "data.micro_batch_size=2", "probe_batches=0", "stages.warmup.steps=2", "stages.warmup.global_batch_size=2",
    "stages.sparse.steps=2", "stages.sparse.global_batch_size=2", "stages.sparse.topk=16",
    "stages.sparse.warmup_steps=1", "checkpoint.every_n_steps=1", "checkpoint.export=false",
]


class Done:
    """What `dsa-train ARGS` in this process left: exit code and output (like CompletedProcess)."""

    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def tree_hash(*roots: Path) -> dict[str, str]:
    """Every file (and empty folder) under `roots` -> sha256 of its bytes."""
    out = {}
    for root in roots:
        root = Path(root)
        if root.is_file():
            out[str(root)] = hashlib.sha256(root.read_bytes()).hexdigest()
            continue
        for p in sorted(root.rglob("*")):
            if p.is_file():
                out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
            elif p.is_dir() and not any(p.iterdir()):
                out[str(p)] = "<empty dir>"
    return out


def run(capsys, *args: str) -> Done:
    """`dsa-train ARGS` in this process: exit code, stdout, stderr."""
    from dsa_train.cli import main

    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    out, err = capsys.readouterr()
    return Done(code, out, err)


def one_line(done: Done, *expected: str, code: int = 2) -> str:
    """The exit code, no traceback, and the last stderr line `dsa-train...` holding `expected`."""
    err = done.stderr
    assert done.returncode == code, err[-3000:]
    assert "Traceback" not in err and "Error executing job" not in err and "HYDRA_FULL_ERROR" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("dsa-train"), err[-3000:]
    for text in expected:
        assert text in last, last
    return last


def suggested_command(line: str) -> list[str]:
    """The first `dsa-train ...` command a message quotes in backticks, as argv (without `dsa-train`)."""
    start = line.index("`dsa-train ") + 1
    end = line.index("`", start)
    return shlex.split(line[start:end])[1:]
