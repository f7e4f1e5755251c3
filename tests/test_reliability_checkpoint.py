"""Crash-safe training checkpoints: manifest, `latest` pointer, verification, fallback, pruning,
full disk, byte-range checksums, the old format refused (checkpoint/training.py). Several ranks and
layouts: tests/test_checkpoint_sharded.py."""

import json
import logging
import threading

import pytest
import torch

from dsa_train.config import load_recipe
from dsa_train import faults
from dsa_train.trainer.trainer import train
from dsa_train.checkpoint.training import (
    CheckpointSaveError,
    CorruptCheckpoint,
    OldFormatCheckpoint,
    TrainerState,
    find_resume_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_latest,
    read_manifest,
    read_tensors,
    save_checkpoint,
    verify_checkpoint,
)
from dsa_train.checkpoint.sharded_state import GlobalPieces, model_pieces
from dsa_train.model import DSAForCausalLM, tiny_config


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return DSAForCausalLM(tiny_config(num_hidden_layers=1))


def save(directory, step, model, keep_last=2, **kw):
    tensors = model_pieces(model)
    tensors["optim/exp_avg/m"] = GlobalPieces((3,), torch.float32, [((0,), torch.full((3,), float(step)))])
    return save_checkpoint(directory, TrainerState(global_step=step, stage_step=step), tensors,
                           {"epoch": 0, "batch_in_epoch": step}, {"torch": torch.get_rng_state()}, keep_last,
                           config_json=model.config.to_hf_dict(), optimizer={"adam_step": step}, **kw)


def test_layout_manifest_and_latest_pointer(tmp_path, model):
    path = save(tmp_path, 3, model)
    assert path.name == "step_00000003" and read_latest(tmp_path) == "step_00000003"
    manifest = read_manifest(path)
    assert set(manifest["files"]) == {"state/__0_0.distcp", "state/.metadata", "config.json", "optimizer.json",
                                      "data.pt", "rng.pt", "trainer_state.json"}
    for name, entry in manifest["files"].items():
        assert (path / name).stat().st_size == entry["size"]
        if name.endswith(".distcp"):  # one sha256 per written chunk (byte range), checked as it is read
            assert len(entry["regions"]) == len(model.state_dict()) + 1
            assert all(len(h) == 64 for h in entry["regions"].values())
        else:
            assert len(entry["sha256"]) == 64
    verify_checkpoint(path)
    loaded = load_checkpoint(path)
    assert loaded.state.global_step == 3 and loaded.data["batch_in_epoch"] == 3 and loaded.optimizer["adam_step"] == 3
    assert torch.equal(read_tensors(path)["model.embed_tokens.weight"], model.state_dict()["model.embed_tokens.weight"])
    assert torch.equal(read_tensors(path, prefix="optim/exp_avg/")["m"], torch.full((3,), 3.0))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_truncated_file_is_rejected_and_resume_falls_back(tmp_path, model):
    save(tmp_path, 2, model)
    newest = save(tmp_path, 4, model)
    shard = newest / "state/__0_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpoint, match=r"__0_0.distcp has \d+ bytes, the manifest says \d+ \(truncated"):
        load_checkpoint(newest)
    path, rejected = find_resume_checkpoint(tmp_path)
    assert path.name == "step_00000002" and [p.name for p, _ in rejected] == ["step_00000004"]


def test_flipped_bytes_fail_the_checksum(tmp_path, model):
    path = save(tmp_path, 1, model)
    blob = bytearray((path / "data.pt").read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (path / "data.pt").write_bytes(bytes(blob))
    with pytest.raises(CorruptCheckpoint, match="data.pt does not match its sha256"):
        verify_checkpoint(path)
    verify_checkpoint(path, checksums=False)  # same size: only the checksum sees it (documented)


def test_a_flipped_byte_in_the_tensors_fails_the_range_that_holds_it(tmp_path, model):
    path = save(tmp_path, 1, model)
    shard = path / "state/__0_0.distcp"
    blob = bytearray(shard.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    shard.write_bytes(bytes(blob))
    verify_checkpoint(path)  # sizes only: the tensor files' byte ranges are checked as they are read
    with pytest.raises(CorruptCheckpoint, match=r"state/__0_0.distcp bytes \d+\+\d+ \(model/.*\) do not match their sha256"):
        read_tensors(path)
    assert "m" in read_tensors(path, prefix="optim/exp_avg/")  # a range that is intact reads


def test_missing_file_and_missing_manifest(tmp_path, model):
    path = save(tmp_path, 1, model)
    (path / "rng.pt").unlink()
    with pytest.raises(CorruptCheckpoint, match="rng.pt is missing"):
        verify_checkpoint(path)
    (path / "manifest.json").write_text("{not json")


def test_a_checkpoint_of_the_old_per_rank_format_is_refused_in_one_line(tmp_path, model):
    old = tmp_path / "step_00000007"
    old.mkdir()
    torch.save(model.state_dict(), old / "model.pt")
    (old / "trainer_state.json").write_text(json.dumps({"global_step": 7}))
    with pytest.raises(OldFormatCheckpoint, match=r"per-rank format .*dsa-train export") as err:
        find_resume_checkpoint(tmp_path)
    assert "\n" not in str(err.value)


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
    # an exception mid-write removes its temporary folder (issue 30); a killed process leaves it,
    # hidden from resume, and the next save removes it
    assert not (tmp_path / ".tmp_step_00000002").exists()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001"]
    (tmp_path / ".tmp_step_00000002").mkdir()  # what a SIGKILL mid-write leaves
    monkeypatch.setenv(faults.ENV, "step=3,kind=crash,at=commit")
    with pytest.raises(faults.InjectedFault):
        save(tmp_path, 3, model)
    assert not (tmp_path / ".tmp_step_00000002").exists()  # stale temporaries go with the next save
    # renamed but the pointer not yet moved: the checkpoint is complete and verifies, resume uses it
    assert read_latest(tmp_path) == "step_00000001"
    assert find_resume_checkpoint(tmp_path)[0].name == "step_00000003"


def tiny_run(run_dir, *extra):
    return load_recipe("demo", [
        f"run_dir={run_dir}", "~stages.pretrain", "logging.wandb_mode=disabled", "logging.progress_bar=false",
        "data.seq_len=64", "data.micro_batch_size=2", "probe_batches=0", "deterministic=true",
        "stages.warmup.steps=2", "stages.warmup.global_batch_size=2",
        "stages.sparse.steps=2", "stages.sparse.global_batch_size=2", "stages.sparse.topk=16",
        "checkpoint.every_n_steps=1", "checkpoint.keep_last=3", "checkpoint.export=false", *extra,
    ])


@pytest.mark.integration
def test_trainer_falls_back_past_a_corrupt_checkpoint_and_says_so(tmp_path, caplog):
    first = train(tiny_run(tmp_path / "run"))
    ckpts = tmp_path / "run/checkpoints"
    newest = ckpts / "step_00000004"
    data = (newest / "state/__0_0.distcp").read_bytes()
    (newest / "state/__0_0.distcp").write_bytes(data[:-100])  # truncated
    (ckpts / "step_00000003" / "trainer_state.json").write_text("{}")  # and the one before corrupt too
    with caplog.at_level(logging.WARNING, logger="dsa_train.trainer.checkpoint_manager"):
        resumed = train(tiny_run(tmp_path / "run"))  # checkpoint.resume: auto (the default)
    log = caplog.text
    assert "rejecting" in log and "step_00000004" in log and "truncated" in log
    assert "falling back to" in log and "step_00000002" in log
    assert [m["progress/global_step"] for m in resumed.history] == [3, 4]
    assert [m["train/loss"] for m in resumed.history] == [m["train/loss"] for m in first.history[2:]]
    assert (ckpts / "corrupt_step_00000004").is_dir() and (ckpts / "corrupt_step_00000003").is_dir()
    assert read_latest(ckpts) == "step_00000004"
    verify_checkpoint(ckpts / "step_00000004")


@pytest.mark.integration
def test_resume_false_refuses_to_overwrite_existing_checkpoints(tmp_path):
    from dsa_train.config import ConfigError
    from dsa_train.trainer.trainer import Trainer

    cfg = tiny_run(tmp_path / "run", "stages.sparse.steps=1", "stages.warmup.steps=1")
    train(cfg)
    with pytest.raises(ConfigError, match=r"checkpoint.resume=false but .* already holds checkpoints .* new run_dir"):
        Trainer(tiny_run(tmp_path / "run", "checkpoint.resume=false"))


@pytest.mark.integration
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


@pytest.mark.integration
def test_async_save_commits_after_the_write_and_resumes_exactly(tmp_path):
    """checkpoint.async_save: the tensors are written in the background; every step_* that exists
    is complete and verifies, and a resume from one continues exactly."""
    import shutil

    first = train(tiny_run(tmp_path / "run", "checkpoint.async_save=true"))
    ckpts = tmp_path / "run/checkpoints"
    assert [p.name for p in list_checkpoints(ckpts)] == ["step_00000002", "step_00000003", "step_00000004"]
    for path in list_checkpoints(ckpts):
        verify_checkpoint(path)
    assert read_latest(ckpts) == "step_00000004" and not list(ckpts.glob(".tmp_*"))
    shutil.rmtree(ckpts / "step_00000004")
    resumed = train(tiny_run(tmp_path / "run", "checkpoint.async_save=true"))
    assert [m["progress/global_step"] for m in resumed.history] == [4]
    assert resumed.history[0]["train/loss"] == first.history[3]["train/loss"]
