"""Reliability III (issue 30), class 2: disk errors as they really surface, on a real small file
system -- a tmpfs that tests/full_disk_driver.py mounts in a private mount namespace (`unshare
--mount`; as a user without root, `unshare --user --map-root-user --mount`), so the kernel itself
answers ENOSPC and EROFS and nothing is left mounted after the test. No injected OSError.

* the disk fills up during a run: the save fails inside torch's writer (DCP raises a
  CheckpointException, a BaseException, around `RuntimeError: ... unexpected pos`), is classified as
  out of space by errno and free space, prunes what checkpoint.keep_last allows and saves; the run
  finishes (exit 0) and no `.tmp_step_*` is left;
* nothing may be pruned (keep_last=0): one line naming the full disk, exit 2, the previous
  checkpoints byte-identical, no temporary folder;
* a read-only run directory, a read-only data cache: one line, exit 2, nothing changed.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def namespace_prefix() -> list[str]:
    return ["unshare", "--mount", "--propagation", "private"] if os.geteuid() == 0 else [
        "unshare", "--user", "--map-root-user", "--mount", "--propagation", "private"]


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    base = tmp_path_factory.mktemp("disk")
    env = {k: v for k, v in os.environ.items() if k not in ("DSA_FAULT", "RANK", "TORCHELASTIC_RESTART_COUNT")}
    proc = subprocess.run([*namespace_prefix(), sys.executable, str(REPO / "tests" / "full_disk_driver.py"), str(base),
                           "prune", "full", "readonly", "cache_ro"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            found = json.loads(line[len("RESULT "):])
            results[found["scenario"]] = found
    results["log"] = proc.stdout
    return results


def assert_one_line(result: dict, *expected: str, code: int = 2) -> str:
    err = result["stderr"]
    assert result["code"] == code, err[-3000:]
    assert "Traceback" not in err and "HYDRA_FULL_ERROR" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("dsa-train: "), err[-3000:]
    for text in expected:
        assert text in last, last
    return last


def test_a_disk_filling_up_prunes_and_the_run_finishes(scenarios):
    r = scenarios["prune"]
    assert r["code"] == 0, r["stderr"][-3000:]
    assert r["steps_before"] == ["step_00000001", "step_00000002"]
    # each mid-stage save after the disk shrank needed the prune; the stage's last checkpoint is smaller
    assert r["steps"] == ["step_00000007", "step_00000008"], r
    assert r["leftovers"] == []
    log = scenarios["log"]
    assert log.count("failed (No space left on device") >= 3, log[-3000:]
    assert "pruned step_00000001 to make room (checkpoint.keep_last=2), trying again" in log
    assert "Traceback" not in r["stderr"]


def test_a_full_disk_with_nothing_to_prune_is_one_line_and_keeps_every_checkpoint(scenarios):
    r = scenarios["full"]
    last = assert_one_line(r, "saving checkpoint", "step_00000003 failed", "No space left on device",
                           "Nothing was deleted", "the newest complete checkpoint is still", "step_00000002",
                           "Free space under")
    assert "unexpected pos" not in last
    assert r["steps"] == ["step_00000001", "step_00000002"]
    assert r["leftovers"] == []  # no .tmp_step_00000003
    assert r["after"] == r["before"]


def test_a_read_only_run_dir_is_one_line_and_changes_nothing(scenarios):
    r = scenarios["readonly"]
    assert_one_line(r, "cannot write to", "Read-only file system", "a permission problem, not a full disk")
    assert r["after"] == r["before"]


def test_a_read_only_data_cache_is_one_line(scenarios):
    r = scenarios["cache_ro"]
    assert_one_line(r, "the data cache", "cannot be written", "Read-only file system", "DSA_TRAIN_CACHE")
    assert not r["run_dir_made"]
