"""The recipe's `eval` group (dsa_train/eval/in_training.py, docs/eval.md "In a training run"): the
evaluation of `dsa-train eval` run by the trainer at stage ends and every N steps, on held-out rows."""

import json
import subprocess
import sys

import pytest

from dsa_train.config import ConfigError, load_recipe
from dsa_train.trainer.trainer import Trainer

SHRUNK = [  # the demo's three stages, a few steps each on 64-token sequences
    "data.seq_len=64", "data.micro_batch_size=1", "probe_batches=0", "checkpoint.every_n_steps=0",
    "checkpoint.export=false", "logging.wandb_mode=disabled", "logging.progress_bar=false",
    "stages.pretrain.steps=3", "stages.pretrain.global_batch_size=1", "stages.pretrain.warmup_steps=0",
    "stages.warmup.steps=1", "stages.warmup.global_batch_size=1",
    "stages.sparse.steps=2", "stages.sparse.global_batch_size=1", "stages.sparse.warmup_steps=0",
    "stages.sparse.topk=16", "stages.sparse.topk_recall_queries=0",
]


def eval_records(run_dir):
    """global step -> the eval/ values logged at it (metrics.jsonl)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        evaluated = {k: v for k, v in record.get("metrics", {}).items() if k.startswith("eval/")}
        if "step" in record and evaluated:
            out.setdefault(int(record["step"]), {}).update(evaluated)
    return out


@pytest.mark.integration
def test_eval_group_runs_at_stage_ends_and_every_n_steps_on_held_out_rows(tmp_path, capsys):
    cfg = load_recipe("demo", [f"run_dir={tmp_path}/run", *SHRUNK, "eval=stage_end", "eval.every_n_steps=2",
                               "eval.num_sequences=2"])
    trainer = Trainer(cfg)
    rows = len(trainer.loader.dataset)
    # the last two rows of the packed stream are never visited by training, in any epoch
    assert trainer.loader.held_out_rows == [rows - 2, rows - 1]
    assert trainer.loader.sampler.num_sequences == rows - 2
    assert all(int(r) < rows - 2 for epoch in range(3) for r in trainer.loader.sampler.epoch_batches(epoch).ravel())
    result = trainer.run()

    evals = eval_records(tmp_path / "run")
    # pretrain: step 2 (every 2 steps) and its end at 3; warm-up end 4; sparse end 6 (its step 2 is its end)
    assert sorted(evals) == [2, 3, 4, 6]
    last = evals[6]
    assert last["eval/topk"] == 16 and last["eval/sequences"] == 2
    for mode in ("dense", "sparse", "oracle"):
        # the buckets [0,16) [16,32) [32,64) hold every token: their token-weighted mean is the overall loss
        assert {f"eval/{mode}/loss_pos{lo}-{hi}" for lo, hi in ((0, 16), (16, 32), (32, 64))} <= set(last)
    # up to position k every mode reads every key
    assert last["eval/sparse/loss_pos0-16"] == pytest.approx(last["eval/dense/loss_pos0-16"], abs=1e-5)
    assert last["eval/sparse_minus_dense"] == pytest.approx(last["eval/sparse/loss"] - last["eval/dense/loss"])
    layers = cfg.model.arch.get("num_hidden_layers") or trainer.model.config.num_hidden_layers
    for i in range(layers):
        assert 0.0 < last[f"eval/layer{i}/topk_recall"] <= last[f"eval/layer{i}/oracle_recall"] + 1e-6 <= 1.0 + 1e-6
    # each stage's end is kept in the run summary (checkpointed with the trainer state)
    assert set(result.summary) == {"pretrain", "warmup", "sparse"}
    assert result.summary["sparse"]["eval"]["dense/loss"] == pytest.approx(last["eval/dense/loss"])
    out = capsys.readouterr().out
    assert "sparse vs dense LM loss by position" in out and "end of stage sparse" in out
    table = out[out.index("sparse vs dense LM loss by position"):]
    assert "[0,16)" in table and "[32,64)" in table and "sparse - dense" in table

    from dsa_train.logging.report import report

    text, plots = report(tmp_path / "run")
    assert "held-out eval at step 6" in text
    assert (tmp_path / "run" / "report" / "eval.png") in plots


@pytest.mark.integration
def test_eval_group_is_off_by_default_and_training_reads_every_row(tmp_path):
    cfg = load_recipe("small_32k")
    assert cfg.eval.enabled is False
    trainer = Trainer(load_recipe("demo", [f"run_dir={tmp_path}/run", *SHRUNK, "eval=none"]))
    assert trainer.evaluation is None
    assert trainer.loader.sampler.num_sequences == len(trainer.loader.dataset)
    trainer.release_run_lock()


@pytest.mark.parametrize("override, key", [("eval.every_n_steps=-1", "eval.every_n_steps"),
                                           ("eval.num_sequences=0", "eval.num_sequences"),
                                           ("eval.topk=64", "eval.topk"),
                                           ("data.streaming=true", "eval.enabled")])
def test_bad_eval_values_fail_naming_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_recipe("demo", ["eval=stage_end", "data.seq_len=64", override])
    assert str(err.value).startswith(key) and "\n" not in str(err.value)


@pytest.mark.integration
def test_a_typo_in_eval_fails_at_startup_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "dsa_train.cli", "eval.enabeld=true"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "enabeld" in lines[0], proc.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
@pytest.mark.integration
def test_eval_group_under_two_ranks_expert_parallel_matches_one_process(tmp_path):
    """EP 2 x ZeRO-2 (the 2-rank demo layout): the model is sharded, so rank 0 evaluates a copy built
    from the gathered state; its numbers equal a one-process run of the same recipe (training agrees
    to ~1e-4 between the two, docs/distributed.md)."""
    import os

    from tests.helpers import free_port

    common = [*SHRUNK, "eval=stage_end", "stages.pretrain.steps=2", "stages.sparse.steps=1"]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "DSA_STRICT_DEVICES": "1"}
    env.pop("DSA_FAULT", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "-m", "dsa_train.launch.rank", "--config-name", "demo", *common, "parallel=zero2",
           "parallel.expert_parallel=2", "stages.pretrain.global_batch_size=2", "stages.warmup.global_batch_size=2",
           "stages.sparse.global_batch_size=2", f"run_dir={tmp_path}/two"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "sparse vs dense LM loss by position" in proc.stdout
    two = eval_records(tmp_path / "two")
    assert sorted(two) == [2, 3, 4]  # the three stage ends, logged once (rank 0)

    one_cfg = load_recipe("demo", [f"run_dir={tmp_path}/one", *common, "stages.pretrain.global_batch_size=2",
                                   "stages.warmup.global_batch_size=2", "stages.sparse.global_batch_size=2"])
    Trainer(one_cfg).run()
    one = eval_records(tmp_path / "one")
    for step in (2, 3, 4):
        for key in ("eval/dense/loss", "eval/sparse/loss", "eval/oracle/loss", "eval/layers/topk_recall"):
            assert two[step][key] == pytest.approx(one[step][key], abs=2e-3), (step, key)


def test_repro_small_recipe_composes_validates_and_is_the_documented_setup():
    """recipes/repro_small.yaml (docs/repro_small.md): dense pre-training at T >= 1024, the warm-up,
    the sparse stage with T/k >= 8, the eval group on; it passes the start-up checks of this machine."""
    from dsa_train.config import compose_recipe, to_train_config
    from dsa_train.stage import Stage

    cfg = to_train_config(compose_recipe("repro_small"), check_environment=True, world_size=1)
    stages = {name: Stage.of(name, s) for name, s in cfg.stages.items()}
    assert [(n, s.attention, s.kind.name) for n, s in stages.items()] == [
        ("pretrain", "dense", "all"), ("warmup", "dense", "indexer"), ("sparse", "sparse", "all")]
    seq_len, topk = cfg.data.seq_len, cfg.stages["sparse"].topk
    assert seq_len >= 1024 and seq_len // topk >= 8
    assert cfg.eval.enabled and cfg.eval.num_sequences >= 2 and cfg.device.value == "cpu"
    assert cfg.data.sources == ["bundled"]
