"""The `dsa-train` console script: Hydra app, recipe selection, errors, subcommands."""

import subprocess
import sys

import pytest

from dsa_train.cli import SUBCOMMANDS, hydra_argv, main


def dsa_train(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "dsa_train.cli", *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


@pytest.mark.integration
def test_cfg_job_prints_the_default_demo_recipe(tmp_path):
    proc = dsa_train("--cfg", "job", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "run_name: demo" in out
    for stage in ("pretrain:", "warmup:", "sparse:"):
        assert f"  {stage}" in out
    assert not (tmp_path / "runs").exists()  # printing the config trains nothing


@pytest.mark.integration
def test_recipe_shorthand_and_overrides(tmp_path):
    proc = dsa_train("recipe=v3.2_sparse", "stages.sparse.steps=7", "--cfg", "job", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "run_name: v3.2_sparse" in proc.stdout
    assert "lr: 7.3e-06" in proc.stdout and "steps: 7" in proc.stdout and "topk: 2048" in proc.stdout


@pytest.mark.integration
def test_unknown_key_fails_at_startup_naming_it(tmp_path):
    proc = dsa_train("stages.sparse.topk_k=3", cwd=tmp_path)
    assert proc.returncode != 0
    assert "topk_k" in proc.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.integration
def test_semantic_error_fails_at_startup_naming_the_key(tmp_path):
    proc = dsa_train("stages.sparse.global_batch_size=6", cwd=tmp_path)
    assert proc.returncode != 0
    assert "stages.sparse.global_batch_size" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.integration
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


def help_argv(name: str) -> list[str]:
    """`launch` takes its launcher first (`launch torchrun --help`); every other command `NAME --help`."""
    return [name, "torchrun", "--help"] if name == "launch" else [name, "--help"]


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_every_listed_subcommand_runs_and_answers_help(name, capsys):
    argv = help_argv(name)
    try:
        code = main(argv)
    except SystemExit as exit_info:  # argparse exits after printing its help
        code = exit_info.code
    assert code in (0, None), capsys.readouterr().err
    usage = capsys.readouterr().out
    # the command reached its own tool (the checkpoint tools share a module: each names itself)
    assert usage.startswith("usage: dsa-train " + " ".join(argv[:-1])), usage[:200]


def test_launch_help_prints_its_launchers(capsys):
    assert main(["launch", "--help"]) == 0
    out = capsys.readouterr().out
    assert "dsa-train launch torchrun" in out and "dsa-train launch slurm" in out


def test_help_lists_every_subcommand_with_a_description(capsys):
    assert main(["--help"]) == 0
    lines = capsys.readouterr().out.splitlines()
    listed = lines[lines.index("subcommands:") + 1 :]
    listed = {line.split()[0]: line.split(None, 1)[1:] for line in listed[: listed.index("")]}
    assert set(listed) == set(SUBCOMMANDS)
    assert all(description for description in listed.values()), listed


@pytest.mark.integration
def test_unknown_command_fails_naming_it(tmp_path):
    proc = dsa_train("frobnicate", cwd=tmp_path)
    assert proc.returncode != 0
    assert "frobnicate" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.integration
def test_missing_mandatory_value_fails_naming_the_key(tmp_path):
    proc = dsa_train("recipe=v3.2_warmup", "data.sources=[x.parquet]", cwd=tmp_path)
    assert proc.returncode != 0
    assert "model.pretrained" in proc.stderr and "Traceback" not in proc.stderr
