"""Bad input: each gives a clear error naming the problem and the fix (or a documented
behaviour), and nothing is lost. Cases tested elsewhere are listed in docs/reliability.md's
table; `test_every_referenced_test_exists` keeps that table honest."""

import math
import re
from pathlib import Path

import pytest

from dsa_train.config import ConfigError, load_recipe
from dsa_train import faults
from dsa_train.trainer.trainer import Trainer, train

REPO = Path(__file__).resolve().parents[1]


def tiny(run_dir, *extra):
    return load_recipe("demo", [
        f"run_dir={run_dir}", "~stages.pretrain", "logging.wandb_mode=disabled", "logging.progress_bar=false",
        "data.seq_len=64", "data.micro_batch_size=2", "probe_batches=0",
        "stages.warmup.steps=1", "stages.warmup.global_batch_size=2",
        "stages.sparse.steps=1", "stages.sparse.global_batch_size=2", "stages.sparse.topk=16",
        "checkpoint.export=false", *extra,
    ])


@pytest.mark.integration
def test_topk_not_below_the_sequence_length_warns_and_trains_as_dense(tmp_path):
    """Sparse with k >= T selects every key: a warning that names the fix, and the run goes on
    (the top-k slots past the causal prefix are -1, the loss stays finite)."""
    from dsa_train.trainer.trainer import TopkCoversSequence

    with pytest.warns(TopkCoversSequence, match=r"stages.sparse.topk: top-64 selection on 64-token sequences "
                                                r"selects every key, so sparse attention equals dense .* raise data.seq_len"):
        trainer = Trainer(tiny(tmp_path / "run", "stages.sparse.topk=64"))
    result = trainer.run()
    last = result.history[-1]
    assert last["progress/stage"] == 1  # the sparse stage ran
    assert last["train/topk_recall"] == pytest.approx(1.0)  # every key selected: all the dense mass
    assert math.isfinite(last["train/loss"]) and math.isfinite(last["train/lm_loss"]), last


@pytest.mark.integration
def test_sequence_longer_than_the_model_positions(tmp_path):
    with pytest.raises(ConfigError, match=r"data.seq_len: 64-token sequences are longer than the model's "
                                          r"max_position_embeddings=32; lower data.seq_len"):
        Trainer(tiny(tmp_path / "run", "+model.arch.max_position_embeddings=32"))


@pytest.mark.integration
def test_tokenizer_vocab_larger_than_the_model(tmp_path):
    with pytest.raises(ValueError, match=r"exceeds the model's vocab_size 100 .* Fix: .*data.tokenizer=<checkpoint dir>"):
        Trainer(tiny(tmp_path / "run", "+model.arch.vocab_size=100"))


@pytest.mark.integration
def test_parallel_sizes_the_single_process_trainer_cannot_run(tmp_path):
    # (sizes that do not divide the world size: tests/test_parallel_zero.py::test_sizes_validated_against_world)
    with pytest.raises(ConfigError, match=r"parallel.tensor_parallel=2: the single-process trainer runs one rank; set it to 1"):
        Trainer(tiny(tmp_path / "run", "parallel.tensor_parallel=2"))


@pytest.mark.integration
def test_resuming_a_checkpoint_of_another_model(tmp_path):
    train(tiny(tmp_path / "run", "stages.sparse.steps=2", "checkpoint.every_n_steps=1"))
    with pytest.raises(ConfigError, match=r"checkpoint.dir: .*step_00000003 was written for another model "
                                          r"\(.*hidden_size.*\); resume with the recipe that wrote it"):
        Trainer(tiny(tmp_path / "run", "stages.sparse.steps=3", "+model.arch.hidden_size=96"))
    # nothing lost: the checkpoints are still there and verify
    from dsa_train.checkpoint.training import list_checkpoints, verify_checkpoint

    assert [p.name for p in list_checkpoints(tmp_path / "run/checkpoints")] == ["step_00000002", "step_00000003"]
    for p in list_checkpoints(tmp_path / "run/checkpoints"):
        verify_checkpoint(p)


@pytest.mark.parametrize("value, message", [
    ("step=x", "step, rank and restart must be integers"),
    ("step=3,kind=explode", "kind='explode'"),
    ("kind=crash", "has no step=N"),
    ("step=3,when=now", "unknown key"),
    ("step=3,at=lunch", "at='lunch'"),
])
def test_malformed_fault_switch_is_an_error(monkeypatch, value, message):
    monkeypatch.setenv(faults.ENV, value)
    with pytest.raises(ValueError, match=re.escape(message)):
        faults.active()


def test_fault_switch_filters_rank_and_restart(monkeypatch):
    monkeypatch.setenv(faults.ENV, "rank=1,step=3,kind=sigkill; step=4,kind=nan,restart=*")
    monkeypatch.setenv("RANK", "0")
    assert [f.kind for f in faults.active()] == ["nan"]
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a restarted job does not fail again
    assert [f.kind for f in faults.active()] == ["nan"]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert [f.kind for f in faults.active()] == ["sigkill", "nan"]


@pytest.mark.parametrize("override, message", [
    ("checkpoint.resume=maybe", "checkpoint.resume: must be auto, true or false"),
    ("fault_tolerance.max_consecutive_nonfinite=0", "fault_tolerance.max_consecutive_nonfinite: must be >= 1"),
    ("fault_tolerance.preemption_signals=[SIGKILL]", "fault_tolerance.preemption_signals: 'SIGKILL' is not a signal"),
])
def test_reliability_settings_are_validated(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_recipe("demo", [override])


def test_every_referenced_test_exists():
    """The bad-input table in docs/reliability.md names tests as `tests/file.py::name`."""
    table = (REPO / "docs" / "reliability.md").read_text()
    refs = re.findall(r"`(tests/[\w/]+\.py)::(\w+)", table)
    assert len(refs) >= 12
    for path, name in refs:
        source = (REPO / path).read_text()
        assert re.search(rf"^def {name}\(", source, re.M), f"{path}::{name}"
