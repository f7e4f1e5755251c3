"""Rank failure under torchrun: the fault switch crashes rank 1 mid-run, torchrun (--max-restarts 1)
restarts the job, which resumes from the last checkpoint on its own (checkpoint.resume=auto)
and ends with the same final loss as a run without the fault. Distributed path:
`python -m dsa_train.launch.rank` (DeepSpeed data parallel on megatron-core groups, gloo, 2 ranks)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsa_train.checkpoint.training import list_checkpoints, read_latest, read_manifest, verify_checkpoint


from dsa_train.launch.launcher import RESTART_ENV  # noqa: E402
from tests.helpers import free_port  # noqa: E402

pytestmark = pytest.mark.integration

# global steps: warm-up 1 2 3, sparse 4 5 6; a checkpoint after every step. DeepSpeed data
# parallel without ZeRO partitioning: ZeRO-2's default buckets (5e8 elements) hold GBs per rank
# per stage on the CPU, more than this 2-rank test needs.
TINY = [
    "~stages.pretrain", "data.seq_len=64", "data.micro_batch_size=1", "probe_batches=0",
    "logging.wandb_mode=offline", "logging.progress_bar=false", "stages.sparse.warmup_steps=1",
    "stages.sparse.topk=16", "checkpoint.every_n_steps=1", "checkpoint.keep_last=2", "checkpoint.export=false",
    "deterministic=true", "parallel=zero2", "parallel.zero_stage=0",
    *[f"stages.{s}.{k}={v}" for s in ("warmup", "sparse") for k, v in (("steps", 3), ("global_batch_size", 2))],
]


def torchrun(run_dir: Path, fault: str | None):
    env = {k: v for k, v in os.environ.items() if k not in ("DSA_FAULT", "WANDB_API_KEY", "WANDB_MODE")}  # WANDB_SERVICE stays
    env.update({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "DSA_TRAIN_BACKEND": "gloo"})
    # what the launchers export: a fresh rendezvous store per attempt (docs/reliability.md)
    env.update(RESTART_ENV)
    if fault:
        env["DSA_FAULT"] = fault
    # every rank's output also goes to a file per attempt (logs/<run id>/attempt_N/<rank>/), so a
    # failure shows the rank that caused it, not only rank 0's side of a broken connection
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
           "--log-dir", str(run_dir.parent / "logs"), "--redirects", "3", "--tee", "3", "--max-restarts", "1", "--rdzv-backend", "c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
           "-m", "dsa_train.launch.rank", "--config-name", "demo", *TINY, f"run_dir={run_dir}"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540, cwd=run_dir.parent)


def rank_logs(run_dir: Path, chars: int = 2500) -> str:
    """The tail of every rank's stderr in every attempt, for an assertion message."""
    parts = []
    for f in sorted((run_dir.parent / "logs").rglob("stderr.log")):
        parts.append(f"--- {f.relative_to(run_dir.parent)}\n{f.read_text(errors='replace')[-chars:]}")
    return "\n".join(parts)


def loss_by_step(run_dir: Path) -> tuple[dict[int, float], set[str]]:
    """train/loss per global step over every W&B offline run file (one per attempt), and the ids of
    the runs that logged them."""
    from dsa_train.logging import read_history

    losses, ids = {}, set()
    for run_file in sorted((run_dir / "wandb").rglob("run-*.wandb")):
        for row in read_history(run_file):
            if "train/loss" in row:
                losses[row["_step"]] = row["train/loss"]
                ids.add(run_file.stem.split("-")[-1])
    return losses, ids


@pytest.fixture
def shared_wandb_service(monkeypatch):
    """A W&B service in this process, inherited by torchrun and its workers through WANDB_SERVICE
    (as after any in-process W&B run in a launcher or a test session). A killed rank 0 leaves its
    run open there; the restarted rank 0 must not trip over it ("run ID ... is in use")."""
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    wandb.setup()
    assert os.environ.get("WANDB_SERVICE")
    yield
    wandb.teardown()


@pytest.mark.slow
def test_crashed_rank_restarts_from_the_last_checkpoint_with_the_same_final_loss(tmp_path, shared_wandb_service):
    clean = tmp_path / "clean" / "run"
    clean.parent.mkdir()
    proc = torchrun(clean, None)
    assert proc.returncode == 0, proc.stdout[-2000:] + rank_logs(clean)
    reference, _ = loss_by_step(clean)
    assert sorted(reference) == [1, 2, 3, 4, 5, 6]

    faulty = tmp_path / "faulty" / "run"
    faulty.parent.mkdir()
    proc = torchrun(faulty, "rank=1,step=5,kind=crash,at=mid_step")
    logs = proc.stdout[-2000:] + rank_logs(faulty)
    assert proc.returncode == 0, logs
    assert "injected crash on rank 1 at mid_step of step 5" in proc.stdout + proc.stderr, logs
    both = proc.stdout + proc.stderr
    assert "resumed from" in both and "checkpoints/step_00000004 (stage 1, step 1)" in both, logs  # the restart resumed
    losses, run_ids = loss_by_step(faulty)
    assert len(run_ids) == 1  # the restarted attempt continued the same W&B run
    assert losses[6] == reference[6]  # the same final loss
    assert all(losses[s] == reference[s] for s in reference)

    ckpts = faulty / "checkpoints"
    assert read_latest(ckpts) == "step_00000006"
    for path in list_checkpoints(ckpts):
        verify_checkpoint(path)
    assert read_manifest(ckpts / "step_00000006")["world_size"] == 2
