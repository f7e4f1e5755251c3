"""Crash-safe training checkpoints: manifest, `latest` pointer, verification, fallback, pruning,
full disk, several ranks (engine/checkpoint.py)."""

import json
import logging
import threading

import pytest
import torch

from dsa_train.config import load_recipe
from dsa_train.engine import faults, train
from dsa_train.engine.checkpoint import (
    CheckpointSaveError,
    CorruptCheckpoint,
    TrainerState,
    find_resume_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_latest,
    read_manifest,
    save_checkpoint,
    verify_checkpoint,
)
from dsa_train.model import DSAForCausalLM, tiny_config


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return DSAForCausalLM(tiny_config(num_hidden_layers=1))


def save(directory, step, model, keep_last=2, **kw):
    engine = {"optimizer": {"step": step, "m": torch.full((3,), float(step))}}
    return save_checkpoint(directory, TrainerState(global_step=step, stage_step=step), model, engine,
                           {"epoch": 0, "batch_in_epoch": step}, {"torch": torch.get_rng_state()}, keep_last, **kw)


def test_layout_manifest_and_latest_pointer(tmp_path, model):
    path = save(tmp_path, 3, model)
    assert path.name == "step_00000003" and read_latest(tmp_path) == "step_00000003"
    manifest = read_manifest(path)
    assert set(manifest["files"]) == {"model.pt", "config.json", "engine.pt", "data.pt", "rng.pt", "trainer_state.json"}
    for name, entry in manifest["files"].items():
        assert (path / name).stat().st_size == entry["size"] and len(entry["sha256"]) == 64
    verify_checkpoint(path)
    loaded = load_checkpoint(path)
    assert loaded.state.global_step == 3 and loaded.data["batch_in_epoch"] == 3
    assert torch.equal(loaded.model["model.embed_tokens.weight"], model.state_dict()["model.embed_tokens.weight"])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_truncated_file_is_rejected_and_resume_falls_back(tmp_path, model):
    save(tmp_path, 2, model)
    newest = save(tmp_path, 4, model)
    data = (newest / "model.pt").read_bytes()
    (newest / "model.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpoint, match=r"model.pt has \d+ bytes, the manifest says \d+ \(truncated"):
        load_checkpoint(newest)
    path, rejected = find_resume_checkpoint(tmp_path)
    assert path.name == "step_00000002" and [p.name for p, _ in rejected] == ["step_00000004"]


def test_flipped_bytes_fail_the_checksum(tmp_path, model):
    path = save(tmp_path, 1, model)
    blob = bytearray((path / "engine.pt").read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (path / "engine.pt").write_bytes(bytes(blob))
    with pytest.raises(CorruptCheckpoint, match="engine.pt does not match its sha256"):
        verify_checkpoint(path)
    verify_checkpoint(path, checksums=False)  # same size: only the checksum sees it (documented)


def test_missing_file_and_missing_manifest(tmp_path, model):
    path = save(tmp_path, 1, model)
    (path / "rng.pt").unlink()
    with pytest.raises(CorruptCheckpoint, match="rng.pt is missing"):
        verify_checkpoint(path)
    (path / "manifest.json").write_text("{not json")
    with pytest.raises(CorruptCheckpoint, match="manifest.json is unreadable"):
        verify_checkpoint(path)


def test_keep_last_never_prunes_the_checkpoint_just_written(tmp_path, model):
    for step in (1, 2, 3, 4):
        save(tmp_path, step, model, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]
    save(tmp_path, 4, model, keep_last=1)  # the same step again replaces it in place
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000004"]
    verify_checkpoint(tmp_path / "step_00000004")


def test_full_disk_leaves_the_previous_checkpoint_and_a_clear_error(tmp_path, model, monkeypatch):
    save(tmp_path, 2, model, keep_last=1)
    monkeypatch.setenv(faults.ENV, "step=3,kind=enospc")
    with pytest.raises(CheckpointSaveError) as err:
        save(tmp_path, 3, model, keep_last=1)
    message = str(err.value)
    assert "No space left on device" in message and "step_00000002" in message and "Free space" in message
    assert [p.name for p in tmp_path.iterdir()] and not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002"] and read_latest(tmp_path) == "step_00000002"
    verify_checkpoint(tmp_path / "step_00000002")


def test_crash_mid_write_and_before_the_pointer(tmp_path, model, monkeypatch):
    save(tmp_path, 1, model)
    monkeypatch.setenv(faults.ENV, "step=2,kind=crash,at=checkpoint")
    with pytest.raises(faults.InjectedFault):
        save(tmp_path, 2, model)
    assert (tmp_path / ".tmp_step_00000002").is_dir()  # the partial write stays hidden
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001"]
    monkeypatch.setenv(faults.ENV, "step=3,kind=crash,at=commit")
    with pytest.raises(faults.InjectedFault):
        save(tmp_path, 3, model)
    assert not (tmp_path / ".tmp_step_00000002").exists()  # stale temporaries go with the next save
    # renamed but the pointer not yet moved: the checkpoint is complete and verifies, resume uses it
    assert read_latest(tmp_path) == "step_00000001"
    assert find_resume_checkpoint(tmp_path)[0].name == "step_00000003"


def test_two_ranks_write_one_checkpoint(tmp_path, model):
    barrier = threading.Barrier(2)
    errors = []

    def rank(r):
        try:
            save_checkpoint(tmp_path, TrainerState(global_step=5), model if r == 0 else None, {"shard": r},
                            {"batch_in_epoch": 5, "dp_rank": r}, {"rank": r}, 2, rank=r, world_size=2,
                            barrier=lambda: barrier.wait(timeout=30))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors
    path = tmp_path / "step_00000005"
    files = read_manifest(path)["files"]
    assert {"data.rank00001.pt", "rng.rank00001.pt", "engine.rank00001.pt", "data.pt", "model.pt"} <= set(files)
    assert read_manifest(path)["world_size"] == 2
    one = load_checkpoint(path, rank=1)
    assert one.data["dp_rank"] == 1 and one.engine == {"shard": 1} and one.rng == {"rank": 1}
    assert "model.embed_tokens.weight" in one.model  # the model is rank 0's
    with pytest.raises(CorruptCheckpoint, match="no data.rank00002.pt for rank 2"):
        load_checkpoint(path, rank=2)


def tiny_run(run_dir, *extra):
    return load_recipe("demo", [
        f"run_dir={run_dir}", "~stages.pretrain", "logging.wandb_mode=disabled", "logging.progress_bar=false",
        "data.seq_len=64", "data.micro_batch_size=2", "probe_batches=0", "deterministic=true",
        "stages.warmup.steps=2", "stages.warmup.global_batch_size=2",
        "stages.sparse.steps=2", "stages.sparse.global_batch_size=2", "stages.sparse.topk=16",
        "checkpoint.every_n_steps=1", "checkpoint.keep_last=3", "checkpoint.export=false", *extra,
    ])


def test_trainer_falls_back_past_a_corrupt_checkpoint_and_says_so(tmp_path, caplog):
    first = train(tiny_run(tmp_path / "run"))
    ckpts = tmp_path / "run/checkpoints"
    newest = ckpts / "step_00000004"
    data = (newest / "model.pt").read_bytes()
    (newest / "model.pt").write_bytes(data[:-100])  # truncated
    (ckpts / "step_00000003" / "trainer_state.json").write_text("{}")  # and the one before corrupt too
    with caplog.at_level(logging.WARNING, logger="dsa_train.engine.trainer"):
        resumed = train(tiny_run(tmp_path / "run"))  # checkpoint.resume: auto (the default)
    log = caplog.text
    assert "rejecting" in log and "step_00000004" in log and "truncated" in log
    assert "falling back to" in log and "step_00000002" in log
    assert [m["progress/global_step"] for m in resumed.history] == [3, 4]
    assert [m["train/loss"] for m in resumed.history] == [m["train/loss"] for m in first.history[2:]]
    assert (ckpts / "corrupt_step_00000004").is_dir() and (ckpts / "corrupt_step_00000003").is_dir()
    assert read_latest(ckpts) == "step_00000004"
    verify_checkpoint(ckpts / "step_00000004")


def test_resume_false_refuses_to_overwrite_existing_checkpoints(tmp_path):
    from dsa_train.config import ConfigError
    from dsa_train.engine import Trainer

    cfg = tiny_run(tmp_path / "run", "stages.sparse.steps=1", "stages.warmup.steps=1")
    train(cfg)
    with pytest.raises(ConfigError, match=r"checkpoint.resume=false but .* already holds checkpoints .* new run_dir"):
        Trainer(tiny_run(tmp_path / "run", "checkpoint.resume=false"))


def test_trainer_full_disk_stops_with_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    monkeypatch.setenv(faults.ENV, "step=3,kind=enospc")
    with pytest.raises(CheckpointSaveError, match="step_00000002"):
        train(tiny_run(tmp_path / "run"))
    ckpts = tmp_path / "run/checkpoints"
    assert [p.name for p in list_checkpoints(ckpts)] == ["step_00000001", "step_00000002"]
    monkeypatch.delenv(faults.ENV)
    resumed = train(tiny_run(tmp_path / "run"))  # space freed: the same command resumes
    assert [m["progress/global_step"] for m in resumed.history] == [3, 4]
    state = json.loads((ckpts / "step_00000004" / "trainer_state.json").read_text())
    assert state["global_step"] == 4 and state["stage_index"] == 2
