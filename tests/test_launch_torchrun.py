"""Launchers on this machine: two torchrun agents forming a two-node job (c10d rendezvous on
127.0.0.1) train the tiny demo recipe; `dsa-train launch torchrun` on one node; the sbatch
generator (--dry-run)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsa_train.config.overrides import split_recipe_args
from dsa_train.launch.launcher import render_sbatch
from tests.helpers import free_port


# the demo recipe (tiny DeepSeek-V3.2-shaped model, bundled corpus), a few steps per stage
TINY = [
    "data.seq_len=64", "data.micro_batch_size=1", "probe_batches=1", "logging.wandb_mode=disabled",
    "logging.progress_bar=false", "stages.pretrain.warmup_steps=1", "stages.sparse.warmup_steps=1",
    "stages.sparse.topk=16", "checkpoint.every_n_steps=0",
    *[f"stages.{s}.{k}={v}" for s in ("pretrain", "warmup", "sparse") for k, v in (("steps", 2), ("global_batch_size", 2))],
]


def _env():
    return {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "DSA_TRAIN_BACKEND": "gloo"}


def _check_run(run_dir, logs):
    assert (run_dir / "export" / "model.safetensors").is_file(), logs
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_")), logs


@pytest.mark.slow
@pytest.mark.integration
def test_two_torchrun_agents_form_a_two_node_job(tmp_path):
    port = free_port()
    run_dir = tmp_path / "run"
    agents = []
    script = Path(__file__).resolve().parents[1] / "launch" / "torchrun.sh"
    env = {**_env(), "NNODES": "2", "NPROC_PER_NODE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "RUN_ID": "two-node-test", "PYTHON": sys.executable}
    for node in range(2):  # two agents = two "nodes", rendezvous at 127.0.0.1
        cmd = ["bash", str(script), "--config-name", "demo", *TINY, "parallel=zero2", f"run_dir={run_dir}"]
        agents.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    for a in agents:
        out, _ = a.communicate(timeout=420)
        logs.append(out)
    tail = "\n".join(log[-3000:] for log in logs)
    assert [a.returncode for a in agents] == [0, 0], tail
    joined = "\n".join(logs)
    assert "rank 0/2: tp 0/1 cp 0/1 dp 0/2" in joined and "rank 1/2: tp 0/1 cp 0/1 dp 1/2" in joined, tail
    _check_run(run_dir, tail)


@pytest.mark.slow
@pytest.mark.integration
def test_launch_torchrun_cli_one_node_expert_parallel(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "dsa_train.cli", "launch", "torchrun", "--nproc-per-node", "2",
           "--master-port", str(free_port()), "--config-name", "demo", *TINY, "parallel=zero2",
           "parallel.expert_parallel=2", f"run_dir={run_dir}"]
    out = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=420)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    _check_run(run_dir, out.stderr[-3000:])


@pytest.mark.integration
def test_sbatch_dry_run_from_cluster_group(tmp_path):
    script, path = render_sbatch(
        "v3.2_sparse", ["data.sources=[/data/x.parquet]", f"run_dir={tmp_path}/r"], python="python"
    )
    assert path == tmp_path / "r" / "launch" / "v3.2_sparse.sbatch"
    # the sparse stage's 128-node layout (cluster/v3_671b_sparse, which fits 80 GB by `dsa-train plan`)
    assert "#SBATCH --nodes=128" in script and "#SBATCH --gpus-per-node=8" in script
    assert "--nnodes=128 --nproc_per_node=8" in script
    # a crashed rank restarts the workers in place; restarts need a fresh rendezvous store
    assert "--max_restarts=3" in script and "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in script
    assert "--rdzv_endpoint=$MASTER_ADDR:" in script and "getent ahostsv4" in script  # rendezvous by IP
    assert f"run_dir={tmp_path}/r" in script and f"--output={tmp_path}/r/slurm-%j.out" in script
    assert 'TRITON_CACHE_DIR="${TMPDIR:-/tmp}/dsa-triton-$SLURM_JOB_ID-$SLURMD_NODENAME"' in script
    assert "#SBATCH --signal=B:USR1@" in script and "trap forward USR1" in script and 'kill -USR1 "$SRUN_PID"' in script
    assert 'trap "" USR1' in script and "scontrol requeue" in script and "#SBATCH --open-mode=append" in script
    bad = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert bad.returncode == 0, bad.stderr
    warmup, _ = render_sbatch("v3.2_warmup", ["model.pretrained=/ckpt/v3.1", "data.sources=[/data/x.parquet]", f"run_dir={tmp_path}/w"], python="python")
    assert "#SBATCH --nodes=16" in warmup and "--nnodes=16 --nproc_per_node=8" in warmup
    # the step asks for the task's CPUs itself (Slurm >= 22.05 does not pass --cpus-per-task to srun),
    # OMP threads = those CPUs over the node's ranks, the open-files limit raised, no interface forced
    assert "#SBATCH --cpus-per-task=64" in script and "srun --kill-on-bad-exit=1 --ntasks-per-node=1 --cpus-per-task=64 " in script
    assert "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}" in script and 'ulimit -n "$(ulimit -Hn)"' in script
    assert "SOCKET_IFNAME=" not in script
    tuned, _ = render_sbatch("v3.2_sparse", ["data.sources=[/data/x.parquet]", f"run_dir={tmp_path}/r", "cluster.open_files=65536",
                                             "cluster.nccl_socket_ifname=ib0", "cluster.gloo_socket_ifname='^docker,lo'"], python="python")
    assert "export NCCL_SOCKET_IFNAME=ib0\n" in tuned and "export GLOO_SOCKET_IFNAME='^docker,lo'\n" in tuned
    assert "ulimit -n 65536 ||" in tuned
    bad = subprocess.run(["bash", "-n"], input=tuned, text=True, capture_output=True)
    assert bad.returncode == 0, bad.stderr


@pytest.mark.integration
def test_sbatch_refuses_bad_cluster_network_and_cpu_values():
    for override, key in (("cluster.gloo_socket_ifname=eth0 lo", "cluster.gloo_socket_ifname"),
                          ("cluster.open_files=10", "cluster.open_files"),
                          ("cluster.cpus_per_task=4", "cluster.cpus_per_task")):
        out = subprocess.run([sys.executable, "-m", "dsa_train.cli", "launch", "slurm", "--dry-run", "--config-name", "demo",
                              "parallel=zero2", "cluster.gpus_per_node=8", override], capture_output=True, text=True, timeout=120)
        lines = [line for line in out.stderr.splitlines() if line.strip()]
        assert out.returncode == 2 and len(lines) == 1 and key in lines[0], out.stderr


@pytest.mark.integration
def test_sbatch_names_a_missing_recipe_value_and_its_fix():
    out = subprocess.run([sys.executable, "-m", "dsa_train.cli", "launch", "slurm", "--config-name", "v3.2_warmup",
                          "--dry-run"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "model.pretrained has no value" in out.stderr and "model.pretrained=" in out.stderr


def test_sbatch_rejects_layout_that_does_not_fit():
    from dsa_train.config import ConfigError

    with pytest.raises(ConfigError, match="expert_parallel"):
        render_sbatch("demo", ["parallel=zero2", "parallel.expert_parallel=3", "cluster.gpus_per_node=2"])


def test_split_recipe_args():
    assert split_recipe_args(["--config-name", "demo", "a=1"]) == ("demo", ["a=1"])
    assert split_recipe_args(["recipe=v3.2_sparse", "b=2"]) == ("v3.2_sparse", ["b=2"])


@pytest.mark.parametrize("log_all", [None, "1"])
def test_ranks_other_than_0_log_errors_and_rank_local_warnings_only_unless_asked(monkeypatch, tmp_path, log_all):
    """A warning every rank would give is logged once per job (rank 0), not once per rank; a warning
    only one rank can give (its own I/O: the preemption marker it could not write) was hidden on the
    other ranks with it, and is now shown, prefixed with the rank. DSA_LOG_ALL_RANKS=1 keeps every
    warning of every rank (dsa_train/launch/rank.py, dsa_train/runtime.py)."""
    import io
    import logging
    import warnings

    from dsa_train import cli
    from dsa_train.launch import rank
    from dsa_train.signals import mark_preempted
    import dsa_train.trainer.trainer as trainer_module

    seen = {}
    monkeypatch.setattr(cli, "run_hydra", lambda argv, fn: seen.update(argv=argv, fn=fn) or 0)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("DS_ACCELERATOR", os.environ.get("DS_ACCELERATOR", "cpu"))  # main() sets it: restored after
    if log_all is None:
        monkeypatch.delenv("DSA_LOG_ALL_RANKS", raising=False)
    else:
        monkeypatch.setenv("DSA_LOG_ALL_RANKS", log_all)
    monkeypatch.setenv("WANDB_SERVICE", os.environ.get("WANDB_SERVICE", ""))  # main() pops it: restored after
    with warnings.catch_warnings():  # rank 3 silences Python warnings process-wide (unless asked not to)
        rank.main(["--config-name", "demo"])
        shown = not any(action == "ignore" and message is None and category is Warning and module is None
                        for action, message, category, module, _ in warnings.filters)  # no catch-all ignore
    assert "hydra.job_logging.root.level=WARNING" in seen["argv"]
    assert shown == bool(log_all)  # Python warnings follow the same switch

    # the rank's task, in the logging Hydra configured (a root handler at WARNING), training replaced
    # by a shared warning, a rank-local one (the real code path: the marker's folder is a file) and an error
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    not_a_folder = tmp_path / "run"
    not_a_folder.write_text("a file where the run directory should be")

    def train(cfg, distributed):
        logging.getLogger("dsa_train.trainer.trainer").warning("a warning every rank gives")
        mark_preempted(not_a_folder)
        logging.getLogger("dsa_train.trainer.trainer").error("an error")

    monkeypatch.setattr(trainer_module, "train", train)
    root, stream = logging.getLogger(), io.StringIO()
    handler = logging.StreamHandler(stream)
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    try:
        seen["fn"](type("Cfg", (), {"run_dir": str(tmp_path / "elsewhere")})())
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        for h in root.handlers:  # pytest's own capture handlers got the filter too
            h.filters = [f for f in h.filters if type(f).__name__ != "OtherRanksLogFilter"]
    lines = stream.getvalue().splitlines()
    assert f"rank 3: could not write the preemption marker {not_a_folder}/.preempted-77.0" in lines[-2 if log_all else 0]
    assert lines[-1] == "an error"
    assert ("a warning every rank gives" in lines) == bool(log_all) and len(lines) == (3 if log_all else 2), lines

    monkeypatch.setenv("RANK", "0")
    seen.clear()
    with warnings.catch_warnings():
        rank.main(["--config-name", "demo"])
    assert not any(a.startswith("hydra.job_logging.root.level") for a in seen["argv"])  # rank 0: the recipe's


def test_the_other_ranks_filter_passes_errors_and_rank_local_warnings_only(monkeypatch):
    """The filter alone, and the rank prefix: none in a one-process run (no WORLD_SIZE above 1)."""
    import io
    import logging

    from dsa_train.runtime import OtherRanksLogFilter, warn_rank_local

    log = logging.getLogger("test_the_other_ranks_filter")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(OtherRanksLogFilter())
    log.addHandler(handler)
    log.propagate = False
    try:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
        log.info("info")
        log.warning("shared %s", "warning")
        warn_rank_local(log, "local %d%%", 5)
        monkeypatch.setenv("WORLD_SIZE", "8")
        monkeypatch.setenv("RANK", "5")
        warn_rank_local(log, "local %s", "again")
        log.critical("critical")
    finally:
        log.removeHandler(handler)
        log.propagate = True
    assert stream.getvalue().splitlines() == ["local 5%", "rank 5: local again", "critical"]
