"""Reliability II (issue 13): every failure one clear line, no silent resume, nothing lost on
Ctrl-C. One or more tests per class; docs/reliability.md's bad-input table names them."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dsa_train.config import load_recipe
from dsa_train.checkpoint.training import read_latest, verify_checkpoint
from tests.reliability_helpers import REPO, TINY
from tests.reliability_helpers import run as dsa_train


def tiny(run_dir, *extra):
    return load_recipe("demo", [f"run_dir={run_dir}", *TINY, *extra])


def cli(*args, env_extra=None, cwd=None, timeout=300):
    env = {k: v for k, v in os.environ.items() if k not in ("DSA_FAULT", "RANK", "TORCHELASTIC_RESTART_COUNT")}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "dsa_train.cli", *args], env=env, cwd=cwd or REPO,
                          capture_output=True, text=True, timeout=timeout)


def assert_one_line(proc, *expected):
    """Exit 2, no traceback, the last stderr line is `dsa-train: ...` holding `expected`."""
    err = proc.stderr
    assert proc.returncode == 2, err[-3000:]
    assert "Traceback" not in err and "Error executing job" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("dsa-train"), err[-3000:]
    for text in expected:
        assert text in last, last
    return last


def write_bad_jsonl(path: Path) -> Path:
    path.write_text('{"text": "a fine first document"}\n{"text": "broken\n{"text": "third"}\n')
    return path


# ------------------------------------------------------------------ 1. one line, no traceback
@pytest.mark.integration
def test_project_errors_leave_every_command_as_one_line(tmp_path, capsys):
    """Training (a data file that is not JSON lines, a model.pretrained that does not exist) and
    the checkpoint subcommands: exit 2 with one `dsa-train: ...` line naming the problem."""
    bad = write_bad_jsonl(tmp_path / "bad.jsonl")
    proc = cli(f"run_dir={tmp_path / 'a'}", *TINY, f"data.sources=[{bad}]")  # the console script, end to end
    assert_one_line(proc, f"{bad}:2: not a JSON line")
    proc = dsa_train(capsys, f"run_dir={tmp_path / 'b'}", *TINY, f"model.pretrained={tmp_path / 'nowhere'}")
    assert_one_line(proc, str(tmp_path / "nowhere"))
    assert_one_line(dsa_train(capsys, "inspect", str(tmp_path / "nowhere")), str(tmp_path / "nowhere"))
    assert_one_line(dsa_train(capsys, "export", str(tmp_path / "nowhere"), str(tmp_path / "out")), str(tmp_path / "nowhere"))


def test_only_project_errors_lose_their_traceback():
    """A DSATrainError becomes its line and exit 2; any other exception is a bug and propagates."""
    from dsa_train.config import ConfigError
    from dsa_train.data import DataSourceError
    from dsa_train.checkpoint.training import CheckpointSaveError, CorruptCheckpoint
    from dsa_train.checkpoint.errors import CheckpointError
    from dsa_train.errors import DSATrainError, run_reporting

    for cls in (ConfigError, DataSourceError, CheckpointSaveError, CorruptCheckpoint, CheckpointError):
        assert issubclass(cls, DSATrainError)

        def fail(cls=cls):
            raise cls("a problem")

        assert run_reporting(fail) == 2
    with pytest.raises(ZeroDivisionError):
        run_reporting(lambda: 1 / 0)


@pytest.mark.slow
@pytest.mark.integration
def test_torchrun_does_not_restart_an_error_a_restart_cannot_fix(tmp_path):
    """`dsa-train launch torchrun --max-restarts 2` with a data file that is not JSON lines: the
    restarted workers exit at once (before loading anything), the launch ends with the rank's one
    line and exit 2, no torchrun traceback."""
    from tests.helpers import free_port

    bad = write_bad_jsonl(tmp_path / "bad.jsonl")
    proc = cli("launch", "torchrun", "--nproc-per-node", "2", "--max-restarts", "2", "--master-port", str(free_port()),
               f"run_dir={tmp_path / 'run'}", *TINY, "parallel=zero2", "data.micro_batch_size=1", f"data.sources=[{bad}]",
               env_extra={"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "DSA_TRAIN_BACKEND": "gloo"})
    last = assert_one_line(proc, f"{bad}:2: not a JSON line")
    assert "not restarting" not in last  # the launcher reports the original failure
    lines = proc.stderr.splitlines()
    # one line per restart (local rank 0), which loads nothing: the data error itself comes from attempt 0 only
    assert sum(line.startswith("dsa-train: not restarting after:") for line in lines) == 2, proc.stderr[-3000:]
    assert sum(line.startswith("dsa-train: data source") for line in lines) <= 2 + 1, proc.stderr[-3000:]


# ------------------------------------------------------------------ 5. Ctrl-C
@pytest.mark.integration
def test_ctrl_c_checkpoints_at_the_step_boundary_and_resumes(tmp_path, capsys, monkeypatch):
    """SIGINT during global step 3 (the fault switch sends it, as Ctrl-C would): the step ends, a
    checkpoint of it is written, exit 130 with one line; the same command resumes from it."""
    run_dir = tmp_path / "run"
    monkeypatch.setenv("DSA_FAULT", "step=3,kind=sigint")
    before = signal.getsignal(signal.SIGINT)  # default_int_handler; SIG_IGN under nohup / `cmd &`
    proc = dsa_train(capsys, f"run_dir={run_dir}", *TINY, "checkpoint.every_n_steps=0")
    both = proc.stdout + proc.stderr
    assert proc.returncode == 130, both[-3000:]
    assert "Traceback" not in both and "KeyboardInterrupt" not in both, both[-3000:]
    assert "interrupted by Ctrl-C (SIGINT) at global step 3: checkpoint written" in both
    assert read_latest(run_dir / "checkpoints") == "step_00000003"
    verify_checkpoint(run_dir / "checkpoints" / "step_00000003")
    assert signal.getsignal(signal.SIGINT) is before  # the caller's handler restored
    monkeypatch.delenv("DSA_FAULT")
    proc = dsa_train(capsys, f"run_dir={run_dir}", *TINY, "checkpoint.every_n_steps=0")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "step_00000003 (stage 1, step 1)" in proc.stdout + proc.stderr
    assert read_latest(run_dir / "checkpoints") == "step_00000004"


@pytest.mark.integration
def test_second_ctrl_c_stops_at_once(tmp_path, capsys, monkeypatch):
    run_dir = tmp_path / "run"
    monkeypatch.setenv("DSA_FAULT", "step=3,kind=sigint;step=3,kind=sigint,at=mid_step")
    before = signal.getsignal(signal.SIGINT)
    proc = dsa_train(capsys, f"run_dir={run_dir}", *TINY)
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "stopped by a second Ctrl-C before the checkpoint" in proc.stderr
    assert read_latest(run_dir / "checkpoints") == "step_00000002"  # step 3 was not finished
    assert signal.getsignal(signal.SIGINT) is before


# ------------------------------------------------------------------ 6. one run per run_dir
def _write_lock(run_dir: Path, **holder) -> Path:
    from dsa_train.trainer.run_lock import LOCK_NAME

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / LOCK_NAME).write_text(json.dumps(holder))
    return run_dir / LOCK_NAME


@pytest.mark.integration
def test_a_second_run_on_a_run_dir_is_refused_naming_the_holder(tmp_path):
    from dsa_train.trainer.trainer import Trainer
    from dsa_train.trainer.run_lock import RunDirLocked

    holder = subprocess.Popen(["sleep", "60"])  # a live process on this host holds the run
    try:
        lock = _write_lock(tmp_path / "run", host=socket.gethostname(), pid=holder.pid, started="today")
        with pytest.raises(RunDirLocked, match=rf"in use by another run \({socket.gethostname()} pid {holder.pid}.*"
                                               rf"use another run_dir; if that run is gone, delete {lock}"):
            Trainer(tiny(tmp_path / "run"))
        assert json.loads(lock.read_text())["pid"] == holder.pid  # the holder's lock is untouched
    finally:
        holder.kill()
        holder.wait()
    # another host's lock cannot be checked from here: refused too
    _write_lock(tmp_path / "run", host="node-other", pid=1, started="today", job="slurm:1")
    with pytest.raises(RunDirLocked, match="node-other pid 1"):
        Trainer(tiny(tmp_path / "run"))


@pytest.mark.integration
def test_a_stale_lock_is_recovered(tmp_path, monkeypatch, caplog):
    from dsa_train.trainer.trainer import train
    from dsa_train.trainer.run_lock import LOCK_NAME

    dead = subprocess.Popen(["true"])
    dead.wait()
    _write_lock(tmp_path / "run", host=socket.gethostname(), pid=dead.pid, started="yesterday")
    with caplog.at_level("WARNING"):
        train(tiny(tmp_path / "run", "stages.sparse.steps=1", "stages.warmup.steps=1"))
    assert f"its process {dead.pid} on this host is gone" in caplog.text
    assert not (tmp_path / "run" / LOCK_NAME).exists()  # released at the end
    # a restarted job (same Slurm job id) takes over its own lock from any node
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    _write_lock(tmp_path / "run2", host="node-7", pid=12345, started="earlier", job="slurm:777")
    with caplog.at_level("WARNING"):
        train(tiny(tmp_path / "run2", "stages.sparse.steps=1", "stages.warmup.steps=1"))
    assert "it belongs to an earlier attempt of this job (slurm:777)" in caplog.text
    assert not (tmp_path / "run2" / LOCK_NAME).exists()


# ------------------------------------------------------------------ 7. data errors
def test_data_errors_name_the_file_and_line(tmp_path):
    from dsa_train.data import DataSourceError, load_documents
    from dsa_train.data.prepare import prepare_data

    bad = write_bad_jsonl(tmp_path / "bad.jsonl")
    with pytest.raises(DataSourceError, match=rf"{bad}:2: not a JSON line .* fix or delete that line"):
        load_documents([str(bad)], cache_dir=str(tmp_path / "hf"))
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataSourceError, match=rf"{latin}:2: bytes that are not UTF-8"):
        prepare_data([str(latin)], None, tmp_path / "p1", 16, hf_cache_dir=str(tmp_path / "hf"), log=False)
    txt = tmp_path / "docs.txt"
    txt.write_bytes(b"one line\n\xff\xfe broken\n")
    with pytest.raises(DataSourceError, match=rf"{txt}:2: bytes that are not UTF-8"):
        prepare_data([str(txt)], None, tmp_path / "p2", 16, hf_cache_dir=str(tmp_path / "hf"), log=False)


def test_records_without_the_text_field_are_counted_and_logged(tmp_path, caplog):
    from dsa_train.data.prepare import prepare_data

    src = tmp_path / "mixed.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in [
        {"text": "the first document has some words"}, {"body": "no text here"}, {"title": "nor here"},
        {"text": "the last document"}]))
    with caplog.at_level("WARNING"):
        out = prepare_data([str(src)], None, tmp_path / "p", 8, hf_cache_dir=str(tmp_path / "hf"), log=False)
    assert "2 record(s) had no 'text' field (or null) and were skipped (2 documents used)" in caplog.text
    index = json.loads((out / "index.json").read_text())
    assert index["n_records_without_text_skipped"] == 2 and index["n_documents"] == 2


# ------------------------------------------------------------------ 2. config.json value types
def test_hf_config_values_of_the_wrong_type_name_the_field(tmp_path, capsys):
    from dsa_train.checkpoint.tiny import make_tiny_checkpoint
    from dsa_train.model.config import DSAConfig, ModelConfigError

    path = tmp_path / "hf"
    make_tiny_checkpoint(path, seed=0)
    cfg = json.loads((path / "config.json").read_text())
    cfg["hidden_size"] = str(cfg["hidden_size"])
    cfg["rope_scaling"] = {**(cfg.get("rope_scaling") or {"type": "yarn"}), "factor": "40"}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match=rf'{path / "config.json"}: config.json has values of the wrong type: '
                                               rf'hidden_size is "{cfg["hidden_size"]}" \(str\), expected an integer; '
                                               r'rope_scaling.factor is "40" \(str\), expected a number'):
        DSAConfig.from_pretrained(path)
    # the user's path: inspect says the same in one line
    last = assert_one_line(dsa_train(capsys, "inspect", str(path)), "hidden_size is", "expected an integer")
    assert "TypeError" not in last


# ------------------------------------------------------------------ 3. integrity
def _trained_run(tmp_path):
    from dsa_train.trainer.trainer import train

    run_dir = tmp_path / "run"
    train(tiny(run_dir, "stages.sparse.steps=1", "stages.warmup.steps=1"))
    return run_dir, run_dir / "checkpoints" / "step_00000002"


@pytest.mark.integration
def test_a_checkpoint_without_manifest_is_not_resumed_or_exported(tmp_path, capsys):
    """Corrupt weights and no manifest: resume and export refuse (nothing moved), saying how to
    proceed; with checkpoint.verify_checksums=false the user takes the risk explicitly."""
    from dsa_train.trainer.trainer import Trainer
    from dsa_train.checkpoint.training import UnverifiedCheckpoint

    run_dir, last = _trained_run(tmp_path)
    (last / "manifest.json").unlink()
    model = last / "state/__0_0.distcp"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a flipped byte in the weights: torch.load would not notice
    model.write_bytes(bytes(data))
    with pytest.raises(UnverifiedCheckpoint, match=r"step_00000002 has no manifest.json, so its files cannot be "
                                                   r"verified.* checkpoint.verify_checksums=false"):
        Trainer(tiny(run_dir, "stages.sparse.steps=2", "stages.warmup.steps=1"))
    assert last.is_dir()  # not moved aside: it may be fine
    assert_one_line(dsa_train(capsys, "export", str(last), str(tmp_path / "out")), "has no manifest.json")
    assert not (tmp_path / "out" / "config.json").exists()
    # the explicit override: trusted as it is
    assert dsa_train(capsys, "export", str(last), str(tmp_path / "out"), "--no-verify-checksums").returncode == 0


@pytest.mark.integration
def test_export_verifies_the_training_checkpoint(tmp_path, capsys):
    run_dir, last = _trained_run(tmp_path)
    model = last / "state/__0_0.distcp"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF
    model.write_bytes(bytes(data))
    assert_one_line(dsa_train(capsys, "export", str(run_dir), str(tmp_path / "out")),
                    "state/__0_0.distcp bytes", "do not match their sha256", "export an earlier step_* directory")


def test_an_index_pointing_outside_the_checkpoint_is_refused(tmp_path):
    from dsa_train.checkpoint import CheckpointError
    from dsa_train.checkpoint.inspection import inspect_checkpoint
    from dsa_train.checkpoint.tiny import make_tiny_checkpoint

    path = tmp_path / "hf"
    make_tiny_checkpoint(path, seed=0)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    name, shard = next(iter(index["weight_map"].items()))
    (tmp_path / "elsewhere.safetensors").write_bytes((path / shard).read_bytes())
    index["weight_map"][name] = "../elsewhere.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"maps tensor {name} to '../elsewhere.safetensors', outside the "
                                              rf"checkpoint directory {path}; refusing to open it"):
        inspect_checkpoint(path)
    index["weight_map"][name] = str(tmp_path / "elsewhere.safetensors")  # absolute
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        dsa_train_from_pretrained(path)


def dsa_train_from_pretrained(path):
    import dsa_train

    return dsa_train.from_pretrained(path)


def test_inspect_says_it_reads_headers_and_check_values_finds_nan(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    from dsa_train.checkpoint.tiny import make_tiny_checkpoint

    path = tmp_path / "hf"
    make_tiny_checkpoint(path, seed=0)
    proc = dsa_train(capsys, "inspect", str(path))
    assert proc.returncode == 0 and "values:         not read: names, shapes and dtypes come from the headers; " \
                                   "--check-values reads every tensor" in proc.stdout
    assert "all" in dsa_train(capsys, "inspect", str(path), "--check-values").stdout
    shard = sorted(path.glob("model-*.safetensors"))[0]
    tensors = load_file(str(shard))
    name = next(n for n, t in tensors.items() if t.dtype == __import__("torch").bfloat16 and t.numel() > 4)
    tensors[name].view(-1)[:3] = float("nan")
    save_file(tensors, str(shard), metadata={"format": "pt"})
    assert dsa_train(capsys, "inspect", str(path)).returncode == 0  # headers only: cannot see it
    proc = dsa_train(capsys, "inspect", str(path), "--check-values")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"loads, but BAD VALUES: 1 tensors hold NaN/inf: {name} (3 NaN, 0 inf" in proc.stdout


# ------------------------------------------------------------------ 9. values that make no sense together
@pytest.mark.parametrize("override, message", [
    ("stages.warmup.min_lr_ratio=0.1", r"stages.warmup.min_lr_ratio: 0.1 has no effect with stages.warmup.decay=constant"),
    ("stages.warmup.topk=8", r"stages.warmup.topk: top-8 selection has no effect in a dense stage"),
])
def test_values_that_make_no_sense_together_are_refused_at_start_up(tmp_path, override, message):
    from dsa_train.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        tiny(tmp_path / "run", override)


@pytest.mark.integration
def test_doubtful_values_are_reported_at_start_up(tmp_path, caplog):
    """Allowed, but said in the log before training: a warm-up longer than its stage (the demo
    recipe's 5-step sparse warm-up in a 2-step smoke run), a log interval longer than a stage."""
    from dsa_train.trainer.trainer import Trainer

    with caplog.at_level("WARNING"):
        Trainer(tiny(tmp_path / "run", "stages.sparse.warmup_steps=5", "logging.log_every=3"))
    assert ("stages.sparse.warmup_steps: 5 warm-up steps are longer than the stage (stages.sparse.steps=2): the lr "
            "never reaches stages.sparse.lr=0.0003 (at most 0.00012)") in caplog.text
    assert "logging.log_every: 3 is more than stages.warmup.steps=2: no step of stage warmup is logged" in caplog.text


# ------------------------------------------------------------------ 8. full disk, read-only directory
@pytest.mark.integration
def test_full_disk_prunes_what_keep_last_allows_and_saves(tmp_path, monkeypatch, caplog):
    """Out of space while saving step 4 with keep_last=2 (steps 2 and 3 on disk): the save prunes
    what it would have pruned after committing (step 2, never the newest, step 3) and tries again."""
    from dsa_train import faults
    from dsa_train.trainer.trainer import train
    from dsa_train.checkpoint.training import list_checkpoints

    run_dir = tmp_path / "run"
    monkeypatch.setenv(faults.ENV, "step=4,kind=enospc")
    with caplog.at_level("WARNING"):
        result = train(tiny(run_dir, "checkpoint.keep_last=2"))
    assert result.history[-1]["progress/global_step"] == 4
    assert "failed (No space left on device" in caplog.text
    assert "pruned step_00000002 to make room (checkpoint.keep_last=2), trying again" in caplog.text
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step_00000003", "step_00000004"]
    verify_checkpoint(run_dir / "checkpoints" / "step_00000004")


@pytest.mark.integration
def test_read_only_checkpoint_dir_is_a_permission_problem(tmp_path, monkeypatch, capsys):
    from dsa_train import faults

    monkeypatch.setenv(faults.ENV, "step=2,kind=erofs")
    proc = dsa_train(capsys, f"run_dir={tmp_path / 'run'}", *TINY)
    last = assert_one_line(proc, "Read-only file system", "is not writable (a permission problem, not a full disk)",
                           "step_00000001", "make the directory writable")
    assert "Free space" not in last and "keep_last" not in last


# ------------------------------------------------------------------ 4. resume with a changed recipe
@pytest.fixture(scope="module")
def stopped_in_sparse_once(tmp_path_factory):
    """A run stopped by a crash at global step 4: its newest checkpoint is step 3, one step into
    the sparse stage (warm-up 2 steps, sparse 2). Trained once for the module."""
    from dsa_train import faults
    from dsa_train.trainer.trainer import train

    run_dir = tmp_path_factory.mktemp("stopped") / "run"
    os.environ[faults.ENV] = "step=4,kind=crash"
    try:
        with pytest.raises(faults.InjectedFault):
            train(tiny(run_dir))
    finally:
        del os.environ[faults.ENV]
    assert read_latest(run_dir / "checkpoints") == "step_00000003"
    return run_dir


@pytest.fixture
def stopped_in_sparse(stopped_in_sparse_once, tmp_path):
    """A copy of that run for one test (the run_dir path is part of the recipe: kept the same)."""
    import shutil

    backup = tmp_path / "backup"
    shutil.copytree(stopped_in_sparse_once, backup)
    yield stopped_in_sparse_once
    shutil.rmtree(stopped_in_sparse_once)
    shutil.copytree(backup, stopped_in_sparse_once)


@pytest.mark.integration
def test_resume_applies_a_longer_stage_and_says_so(stopped_in_sparse, caplog):
    from dsa_train.trainer.trainer import train

    with caplog.at_level("WARNING"):
        result = train(tiny(stopped_in_sparse, "stages.sparse.steps=3", "logging.log_every=2"))
    assert "resume: stages.sparse.steps 2 -> 3: extending the stage in progress" in caplog.text
    assert "resume: logging.log_every: 1 (checkpoint) -> 2" in caplog.text
    assert [m["progress/global_step"] for m in result.history] == [4, 5]


@pytest.mark.parametrize("override, message", [
    ("stages.sparse.lr=0.01", r"stage 'sparse' is in progress \(step 1\): stages.sparse.lr: 0.0003 \(checkpoint\) -> 0.01"),
    ("~stages.warmup", r"stages: the checkpoint finished \['warmup'\] and is in stage 'sparse' of \['warmup', 'sparse'\]; "
                       r"this recipe has \['sparse'\]"),
    ("stages.warmup.steps=3", r"stage 'warmup' is finished, it cannot change: stages.warmup.steps: 2 \(checkpoint\) -> 3 "
                              r"\(a finished stage's checkpoint keeps no optimizer state .* add a stage after it\)"),
    ("optim.weight_decay=0.5", r"optim.weight_decay: 0.1 \(checkpoint\) -> 0.5"),
])
@pytest.mark.integration
def test_resume_refuses_other_recipe_changes_naming_the_key(stopped_in_sparse, override, message):
    from dsa_train.trainer.trainer import Trainer
    from dsa_train.trainer.recipe_change import RecipeChanged

    with pytest.raises(RecipeChanged, match=message + r".* start a new run under another run_dir"):
        Trainer(tiny(stopped_in_sparse, override))
    assert read_latest(stopped_in_sparse / "checkpoints") == "step_00000003"  # nothing moved


@pytest.mark.integration
def test_a_finished_run_says_it_is_finished(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert dsa_train(capsys, f"run_dir={run_dir}", *TINY).returncode == 0
    proc = dsa_train(capsys, f"run_dir={run_dir}", *TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "this run is already finished: all 2 stages (warmup, sparse) done at global step 4" in proc.stdout
    assert "steps" not in proc.stdout.split("already finished")[0]  # no summary table claiming steps
