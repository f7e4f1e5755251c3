"""Runs training on a real small file system (a tmpfs mounted in a private mount namespace) for
tests/test_reliability_disk.py; prints one JSON object per scenario, one per stdout line, prefixed
with `RESULT `.

    unshare --mount [--user --map-root-user] python tests/full_disk_driver.py BASE SCENARIO...

Each scenario mounts its own tmpfs under BASE. The mounts exist only inside this process's
namespace and disappear with it: nothing to unmount after a crash. Scenarios:
  prune     the disk fills up during a run: after the second checkpoint the file system shrinks to
            what is there and half a checkpoint. The third save runs out of space inside torch's
            writer (DCP: a CheckpointException holding `RuntimeError: ... unexpected pos`), prunes the
            oldest checkpoint (checkpoint.keep_last=2) and saves; so do the later ones.
  full      the same with checkpoint.keep_last=0 (nothing may be pruned): one line, exit 2, the
            previous checkpoints intact, no temporary folder left.
  readonly  the run directory on a read-only file system: one line, exit 2, nothing changed.
  cache_ro  the data cache (DSA_TRAIN_CACHE) on a read-only file system: one line, exit 2.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

TINY = [
    "~stages.pretrain", "~stages.warmup", "logging.wandb_mode=disabled", "logging.progress_bar=false",
    "data.seq_len=64", "data.micro_batch_size=2", "probe_batches=0", "stages.sparse.steps=8",
    "stages.sparse.global_batch_size=2", "stages.sparse.topk=16", "stages.sparse.warmup_steps=1",
    "checkpoint.every_n_steps=1", "checkpoint.export=false",
]


def mount(path: Path, size: str, *options: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    opts = ",".join([f"size={size}", *options])
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], check=True)


def remount(path: Path, *options: str) -> None:
    subprocess.run(["mount", "-o", ",".join(["remount", *options]), str(path)], check=True)


def tree_hash(root: Path) -> dict[str, str]:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def cli(*args: str) -> tuple[int, str]:
    """`dsa-train ARGS` in this process: exit code and stderr."""
    from dsa_train.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
    return code, err.getvalue()


def used_bytes(mnt: Path) -> int:
    usage = os.statvfs(mnt)
    return (usage.f_blocks - usage.f_bfree) * usage.f_frsize


def shrink_after_step(step: int, mnt: Path, ckpts: Path, info: dict):
    """After the checkpoint of global step `step` is written, shrink the file system to what it
    holds and half a checkpoint (a disk filling up during the run)."""
    from dsa_train.trainer.checkpoint_manager import CheckpointManager

    original = CheckpointManager.save

    def save(self, state, *args, **kwargs):
        original(self, state, *args, **kwargs)
        if state.global_step == step and "fs_bytes" not in info:
            newest = dir_size(ckpts / f"step_{step:08d}")
            info.update(checkpoint_bytes=newest, fs_bytes=used_bytes(mnt) + newest // 2,
                        steps_before=sorted(p.name for p in ckpts.glob("step_*")))
            remount(mnt, f"size={info['fs_bytes']}")
            info["before"] = tree_hash(ckpts)

    CheckpointManager.save = save
    return lambda: setattr(CheckpointManager, "save", original)


def run_scenario(base: Path, scenario: str) -> dict:
    mnt = base / scenario
    run_dir = mnt / "run"
    ckpts = run_dir / "checkpoints"
    result: dict = {"scenario": scenario}
    if scenario in ("prune", "full"):
        mount(mnt, "400m")
        keep = "2" if scenario == "prune" else "0"
        restore = shrink_after_step(2, mnt, ckpts, result)
        try:
            code, err = cli(f"run_dir={run_dir}", *TINY, f"checkpoint.keep_last={keep}")
        finally:
            restore()
        result.update(code=code, stderr=err, steps=sorted(p.name for p in ckpts.glob("step_*")),
                      leftovers=sorted(p.name for p in ckpts.iterdir() if p.name.startswith(".")),
                      after=tree_hash(ckpts))
    elif scenario == "readonly":
        mount(mnt, "100m")
        run_dir.mkdir()
        (run_dir / "notes.txt").write_text("the user's file\n")
        remount(mnt, "ro")
        before = tree_hash(mnt)
        code, err = cli(f"run_dir={run_dir}", *TINY)
        result.update(code=code, stderr=err, before=before, after=tree_hash(mnt))
    elif scenario == "cache_ro":
        mount(mnt, "100m")
        remount(mnt, "ro")
        saved = os.environ["DSA_TRAIN_CACHE"]
        os.environ["DSA_TRAIN_CACHE"] = str(mnt / "cache")
        try:
            code, err = cli(f"run_dir={base / 'cache_ro_run'}", *TINY)
        finally:
            os.environ["DSA_TRAIN_CACHE"] = saved
        result.update(code=code, stderr=err, run_dir_made=(base / "cache_ro_run").exists())
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    return result


def main(argv: list[str]) -> int:
    base, scenarios = Path(argv[0]), argv[1:]
    os.environ.setdefault("DSA_TRAIN_CACHE", str(base / "cache"))
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for scenario in scenarios:
        print("RESULT " + json.dumps(run_scenario(base, scenario)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
