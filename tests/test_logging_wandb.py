"""W&B: offline run files hold the logged metrics and config; resume keeps the run id."""

import shutil

import pytest

from dsa_train.config import LoggingConfig, WandbMode, load_recipe
from dsa_train.trainer.trainer import train
from dsa_train.checkpoint.training import list_checkpoints
from dsa_train.logging import WandbRun, find_run_file, read_config, read_history, resolve_mode


def short_run(run_dir, *extra):
    return load_recipe("demo", [
        f"run_dir={run_dir}", "~stages.pretrain", "logging.progress_bar=false", "logging.wandb_mode=offline",
        "data.seq_len=64", "data.micro_batch_size=2", "probe_batches=1", "checkpoint.export=false",
        "stages.warmup.steps=2", "stages.warmup.global_batch_size=2",
        "stages.sparse.steps=2", "stages.sparse.global_batch_size=2", "stages.sparse.topk=16",
        "stages.sparse.topk_recall_queries=4", "checkpoint.every_n_steps=1", "checkpoint.keep_last=0", *extra,
    ])


@pytest.fixture
def no_wandb_env(monkeypatch):
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.integration
def test_offline_run_files_contain_the_logged_metrics(tmp_path, no_wandb_env):
    result = train(short_run(tmp_path / "run"))
    run_file = find_run_file(tmp_path / "run" / "wandb")
    assert result.wandb_run_id in run_file.name
    rows = {row["_step"]: row for row in read_history(run_file) if "train/loss" in row}
    assert sorted(rows) == [1, 2, 3, 4]
    for logged in result.history:
        row = rows[logged["progress/global_step"]]
        for key in ("train/loss", "optim/lr", "optim/grad_norm", "perf/mfu", "perf/tokens_per_s"):
            assert row[key] == pytest.approx(logged[key]), key
    assert "train/indexer_kl_captured" in rows[1] and "train/lm_loss" not in rows[1]
    assert "train/lm_loss" in rows[4] and "train/topk_recall" in rows[4]
    assert any(key.startswith("train/indexer_kl/layer_") for key in rows[1])
    assert any(key.startswith("probe/warmup/") for row in read_history(run_file) for key in row)
    config = read_config(run_file)
    assert config["run_name"] == "demo" and config["stages"]["sparse"]["attention"] == "sparse"


@pytest.mark.integration
def test_resumed_run_continues_the_same_wandb_run(tmp_path, no_wandb_env):
    first = train(short_run(tmp_path / "run"))
    for path in list_checkpoints(tmp_path / "run/checkpoints")[2:]:
        shutil.rmtree(path)
    resumed = train(short_run(tmp_path / "run", "checkpoint.resume=true"))
    assert resumed.wandb_run_id == first.wandb_run_id
    assert [m["progress/global_step"] for m in resumed.history] == [3, 4]


def test_mode_resolution(monkeypatch, no_wandb_env):
    assert resolve_mode(WandbMode.auto) == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert resolve_mode(WandbMode.auto) == "online"
    assert resolve_mode(WandbMode.disabled) == "disabled"


def test_disabled_logs_nothing(tmp_path, no_wandb_env):
    run = WandbRun(LoggingConfig(wandb_mode=WandbMode.disabled, wandb_dir=str(tmp_path)), {})
    run.log({"a": 1.0}, step=1)
    run.finish()
    assert run.id is None and not list(tmp_path.iterdir())


@pytest.mark.integration
def test_failed_online_init_falls_back_to_offline(tmp_path, no_wandb_env, monkeypatch):
    # an unreachable server: the online init fails, training must not
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    cfg = LoggingConfig(wandb_mode=WandbMode.online, wandb_dir=str(tmp_path), project="p", run_name="r",
                        wandb_init_timeout_s=3)
    run = WandbRun(cfg, {"a": 1})
    run.log({"loss": 2.0}, step=1)
    run_id = run.id
    run.finish()
    assert run.mode == "offline"
    # the failed online attempt may leave a run file of its own (another id, no history)
    assert _history_once_written(find_run_file(tmp_path, run_id))[0]["loss"] == 2.0


def _history_once_written(run_file, timeout_s: float = 20.0) -> list[dict]:
    """The run file's history rows, polled: after a failed online init, W&B's service was seen
    (1 run in 3 on this machine) to write the offline run's history after `finish()` returned."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        rows = read_history(run_file)
        if rows or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


@pytest.mark.integration
def test_stale_run_in_a_shared_wandb_service_does_not_stop_training(tmp_path, no_wandb_env, monkeypatch):
    """A process that inherited WANDB_SERVICE (the launcher's W&B service) and was killed leaves
    its run open in that service; the restarted process asks for the same run id and W&B answers
    "run ID ... is in use". WandbRun retries with a service of its own and the run continues."""
    import os
    import signal
    import subprocess
    import sys

    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    wandb.setup()  # this process's service, shared with the children through WANDB_SERVICE
    try:
        assert os.environ.get("WANDB_SERVICE")
        killed = subprocess.run(
            [sys.executable, "-c", "import os, signal, wandb\n"
             f"wandb.init(mode='offline', dir={str(tmp_path)!r}, project='p', id='stale1')\n"
             "os.kill(os.getpid(), signal.SIGKILL)"],
            capture_output=True, text=True, timeout=120)
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
        resumed = subprocess.run(
            [sys.executable, "-c", "from dsa_train.config import LoggingConfig, WandbMode\n"
             "from dsa_train.logging import WandbRun\n"
             f"cfg = LoggingConfig(wandb_mode=WandbMode.offline, wandb_dir={str(tmp_path)!r}, project='p', run_name='r')\n"
             "run = WandbRun(cfg, {}, run_id='stale1')\n"
             "run.log({'loss': 1.5}, step=7)\n"
             "print('MODE', run.mode, run.id)\n"
             "run.finish()"],
            capture_output=True, text=True, timeout=120)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert "MODE offline stale1" in resumed.stdout, resumed.stdout + resumed.stderr[-2000:]
    finally:
        wandb.teardown()
