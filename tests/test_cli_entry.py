"""The `dsa-train` console script: Hydra app, recipe selection, errors, subcommands."""

import subprocess
import sys

import pytest

from dsa_train.cli import SUBCOMMANDS, hydra_argv, main


def dsa_train(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "dsa_train.cli", *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


def test_cfg_job_prints_the_default_demo_recipe(tmp_path):
    proc = dsa_train("--cfg", "job", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "run_name: demo" in out
    for stage in ("pretrain:", "warmup:", "sparse:"):
        assert f"  {stage}" in out
    assert not (tmp_path / "runs").exists()  # printing the config trains nothing


def test_recipe_shorthand_and_overrides(tmp_path):
    proc = dsa_train("recipe=v3.2_sparse", "stages.sparse.steps=7", "--cfg", "job", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "run_name: v3.2_sparse" in proc.stdout
    assert "lr: 7.3e-06" in proc.stdout and "steps: 7" in proc.stdout and "topk: 2048" in proc.stdout


def test_unknown_key_fails_at_startup_naming_it(tmp_path):
    proc = dsa_train("stages.sparse.topk_k=3", cwd=tmp_path)
    assert proc.returncode != 0
    assert "topk_k" in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_semantic_error_fails_at_startup_naming_the_key(tmp_path):
    proc = dsa_train("stages.sparse.global_batch_size=6", cwd=tmp_path)
    assert proc.returncode != 0
    assert "stages.sparse.global_batch_size" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_typo_in_a_yaml_recipe_fails_naming_the_key(tmp_path):
    (tmp_path / "mine.yaml").write_text("defaults:\n  - demo\n  - _self_\noptim:\n  weight_decya: 0.0\n")
    proc = dsa_train("--config-dir", str(tmp_path), "--config-name", "mine", "--cfg", "job", cwd=tmp_path)
    assert proc.returncode != 0
    assert "weight_decya" in proc.stderr


def test_recipe_shorthand_translates_to_config_name():
    assert hydra_argv(["recipe=small_32k", "seed=3"]) == ["--config-name", "small_32k", "seed=3"]


def test_prepare_data_dispatches_to_the_data_command(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["prepare-data", "--help"])
    assert exit_info.value.code == 0
    assert "usage" in capsys.readouterr().out.lower()


def test_checkpoint_tools_are_dispatched():
    assert {SUBCOMMANDS[name] for name in ("export", "inspect", "make-tiny-checkpoint")} == {"dsa_train.checkpoint.cli"}


def test_missing_mandatory_value_fails_naming_the_key(tmp_path):
    proc = dsa_train("recipe=v3.2_warmup", "data.sources=[x.parquet]", cwd=tmp_path)
    assert proc.returncode != 0
    assert "model.pretrained" in proc.stderr and "Traceback" not in proc.stderr
