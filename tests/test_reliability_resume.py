"""Killed, preempted and NaN runs resume onto the uninterrupted run's loss curve, bitwise
(deterministic mode). Runs are subprocesses of tests/reliability_driver.py; faults come from the
DSA_FAULT switch (dsa_train/faults.py)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dsa_train.checkpoint.training import list_checkpoints, read_latest, verify_checkpoint

DRIVER = Path(__file__).with_name("reliability_driver.py")
REPO = Path(__file__).resolve().parents[1]

# global steps: warm-up 1 2 3 (checkpoints 2, 3 = stage end), sparse 4 5 6 (checkpoints 5, 6)
OVERRIDES = [
    "~stages.pretrain", "logging.wandb_mode=disabled", "logging.progress_bar=false",
    "data.seq_len=96", "data.micro_batch_size=2", "probe_batches=1", "deterministic=true",
    "stages.warmup.steps=3", "stages.warmup.global_batch_size=4",
    "stages.sparse.steps=3", "stages.sparse.global_batch_size=4", "stages.sparse.warmup_steps=1",
    "stages.sparse.topk=16", "checkpoint.every_n_steps=2", "checkpoint.keep_last=2", "checkpoint.export=false",
]
COMPARED = ("train/loss", "train/lm_loss", "train/indexer_loss", "optim/grad_norm", "optim/lr")


def run(run_dir: Path, fault: str | None = None, *extra: str, timeout=300):
    env = {k: v for k, v in os.environ.items() if k not in ("DSA_FAULT", "RANK", "TORCHELASTIC_RESTART_COUNT")}
    if fault:
        env["DSA_FAULT"] = fault
    out = run_dir.parent / f"{run_dir.name}-{time.monotonic_ns()}.json"
    proc = subprocess.run(
        [sys.executable, str(DRIVER), str(out), "demo", f"run_dir={run_dir}", *OVERRIDES, *extra],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout,
    )
    history = json.loads(out.read_text())["history"] if out.exists() else None
    return proc, history


def final_model(run_dir: Path) -> dict:
    from dsa_train.checkpoint.training import read_tensors

    return read_tensors(run_dir / "checkpoints" / "step_00000006")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    proc, history = run(run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [m["progress/global_step"] for m in history] == [1, 2, 3, 4, 5, 6]
    return history, final_model(run_dir)


def assert_continues(reference, history, first_step):
    ref_history, _ = reference
    assert [m["progress/global_step"] for m in history] == list(range(first_step, 7))
    for m in history:
        ref = ref_history[m["progress/global_step"] - 1]
        for key in COMPARED:
            if key in ref:
                assert m[key] == ref[key], (m["progress/global_step"], key, m[key], ref[key])


def assert_same_weights(reference, run_dir):
    _, ref_model = reference
    model = final_model(run_dir)
    assert model.keys() == ref_model.keys()
    for name, value in model.items():
        assert torch.equal(value, ref_model[name]), name


@pytest.mark.slow  # two subprocess runs; ~15 s each unloaded
@pytest.mark.parametrize("fault, resumes_at, after_kill", [
    ("step=3,kind=sigkill,at=mid_step", 3, "step_00000002"),  # after backward, before the update
    ("step=5,kind=sigkill,at=checkpoint", 4, "step_00000003"),  # half-written checkpoint
    ("step=3,kind=sigkill,at=commit", 4, "step_00000002"),  # renamed, `latest` not yet moved
], ids=["mid_step", "mid_checkpoint_write", "before_latest_pointer"])
@pytest.mark.integration
def test_sigkill_then_resume_matches_the_uninterrupted_run(reference, tmp_path, fault, resumes_at, after_kill):
    run_dir = tmp_path / "run"
    proc, _ = run(run_dir, fault)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    ckpts = run_dir / "checkpoints"
    assert read_latest(ckpts) == after_kill
    if "checkpoint" in fault:
        assert (ckpts / ".tmp_step_00000005").is_dir() and not (ckpts / "step_00000005").exists()
    for path in list_checkpoints(ckpts):
        verify_checkpoint(path)

    proc, history = run(run_dir)  # the same command again: checkpoint.resume=auto
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_continues(reference, history, resumes_at)
    assert_same_weights(reference, run_dir)
    assert not [p for p in ckpts.iterdir() if p.name.startswith(".")]


@pytest.mark.slow
@pytest.mark.parametrize("kind, step, saved", [("sigterm", 4, 4), ("sigusr1", 3, 3)])
@pytest.mark.integration
def test_preemption_signal_checkpoints_exits_75_and_resumes(reference, tmp_path, kind, step, saved):
    """The signal arrives during step N; the step finishes, a checkpoint of it is written
    (for N = 3 it is the stage-end checkpoint) and the run exits with 75."""
    run_dir = tmp_path / "run"
    proc, history = run(run_dir, f"step={step},kind={kind}")
    assert proc.returncode == 75, proc.stderr[-3000:]
    assert "preempted by SIG" in proc.stderr and "Traceback" not in proc.stderr
    assert [m["progress/global_step"] for m in history] == list(range(1, saved + 1))
    ckpts = run_dir / "checkpoints"
    assert read_latest(ckpts) == f"step_{saved:08d}"
    verify_checkpoint(ckpts / f"step_{saved:08d}")

    proc, history = run(run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_continues(reference, history, saved + 1)
    assert_same_weights(reference, run_dir)


@pytest.mark.integration
def test_external_sigterm_to_the_cli(tmp_path):
    """A real SIGTERM from outside to `dsa-train` (python -m dsa_train.cli) mid-run."""
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "DSA_FAULT"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsa_train.cli", f"run_dir={run_dir}", *OVERRIDES,
         "stages.sparse.steps=500", "checkpoint.every_n_steps=1000"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "checkpoints" / "step_00000003").is_dir():  # warm-up end: sparse stage running
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, err[-3000:]
    latest = read_latest(run_dir / "checkpoints")
    state = json.loads((run_dir / "checkpoints" / latest / "trainer_state.json").read_text())
    assert 3 <= state["global_step"] < 503 and state["stage_index"] == 1  # at or after the warm-up's end
    assert f"preempted by SIGTERM at global step {state['global_step']}" in out + err
    assert "Traceback" not in out + err


@pytest.mark.integration
def test_nan_skip_policy_skips_and_counts(reference, tmp_path):
    run_dir = tmp_path / "run"
    proc, history = run(run_dir, "step=2,kind=nan", "checkpoint.every_n_steps=1", "checkpoint.keep_last=0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "non-finite loss, gradients at global step 2: update skipped" in proc.stderr
    assert [m["train/nonfinite_skipped"] for m in history] == [0, 1, 1, 1, 1, 1]
    assert history[0]["train/loss"] == reference[0][0]["train/loss"]
    assert history[1]["optim/grad_norm"] != history[1]["optim/grad_norm"]  # NaN: no update
    from dsa_train.checkpoint.training import read_tensors

    one = read_tensors(run_dir / "checkpoints/step_00000001")
    two = read_tensors(run_dir / "checkpoints/step_00000002")
    assert all(torch.equal(one[k], two[k]) for k in one)  # the skipped step changed nothing
    assert all(m["train/loss"] == m["train/loss"] for m in history[2:])  # finite afterwards


@pytest.mark.integration
def test_nan_stop_policy_checkpoints_the_state_before_the_step(reference, tmp_path):
    run_dir = tmp_path / "run"
    proc, _ = run(run_dir, "step=5,kind=nan", "fault_tolerance.nonfinite=stop")
    assert proc.returncode == 1
    assert "non-finite loss, gradients at global step 5: stopping (fault_tolerance.nonfinite=stop)" in proc.stderr
    ckpts = run_dir / "checkpoints"
    assert read_latest(ckpts) == "step_00000004"
    # resuming (here without the fault) reproduces the uninterrupted run from the bad step on
    proc, history = run(run_dir, None, "fault_tolerance.nonfinite=stop")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_continues(reference, history, 5)


@pytest.mark.integration
def test_too_many_consecutive_nonfinite_steps_stop(tmp_path):
    run_dir = tmp_path / "run"
    proc, _ = run(run_dir, "step=4,kind=nan;step=5,kind=nan", "fault_tolerance.max_consecutive_nonfinite=1")
    assert proc.returncode == 1
    assert "2 non-finite steps in a row (fault_tolerance.max_consecutive_nonfinite=1)" in proc.stderr
    state = json.loads((run_dir / "checkpoints/step_00000004/trainer_state.json").read_text())
    assert state["nonfinite_skipped"] == 1 and state["nonfinite_consecutive"] == 1


def test_torchrun_restart_after_a_preemption_exits_75_at_once(tmp_path, monkeypatch):
    """Slurm preemption with torchrun --max-restarts: the preempted ranks (exit 75) leave a marker
    for the allocation; torchrun's restart of the workers finds it and exits 75 before any work,
    so the job ends and the batch script requeues it. A requeued job is a new allocation."""
    from dsa_train.signals import Preempted, exit_if_preempted_earlier, mark_preempted

    for var in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(var, raising=False)
    mark_preempted(tmp_path)  # outside Slurm: no marker, nothing to do
    assert not list(tmp_path.glob(".preempted-*"))

    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    exit_if_preempted_earlier(tmp_path)  # nothing preempted yet
    mark_preempted(tmp_path)
    assert (tmp_path / ".preempted-4242.0").exists()
    exit_if_preempted_earlier(tmp_path)  # first attempt of a job (no torchrun restart): runs
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.raises(Preempted) as err:
        exit_if_preempted_earlier(tmp_path)
    assert err.value.code == 75 and "allocation (4242.0) was preempted" in str(err.value)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # requeued: a new allocation trains
    exit_if_preempted_earlier(tmp_path)
