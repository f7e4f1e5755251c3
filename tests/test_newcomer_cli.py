"""The console script guides a new user: --help, unknown keys with suggestions, every problem of a
recipe at once, and a launcher that checks the recipe before starting any worker."""

import subprocess
import sys

import pytest

from dsa_train.cli import SUBCOMMANDS, main
from dsa_train.config import ConfigError, recipes_dir
from dsa_train.config.recipes import compose_recipe, to_train_config


def test_help_lists_subcommands_recipes_and_profiles(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "Hydra" not in out.split("Hydra's own options")[0]  # not Hydra's banner
    lines = out.splitlines()
    shipped = [p.stem for p in recipes_dir().glob("*.yaml") if p.stem != "base"]
    for name in [*SUBCOMMANDS, *shipped, "smoke"]:
        line = next((line for line in lines if line.strip().startswith(name + " ")), None)
        assert line is not None and len(line.split(None, 1)[1]) > 10, f"{name} has no one-line description"


@pytest.mark.parametrize("override", ["stages.sparse.stepz=5", "+stages.sparse.stepz=5"])
def test_unknown_key_gets_did_you_mean(override, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main([override])
    assert exit_info.value.code != 0
    assert "dsa-train: stages.sparse.stepz: no such key (did you mean stages.sparse.steps?)" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_unknown_profile_gets_did_you_mean(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        main(["--config-name", "v3.2_warmup", "profile=smok"])
    assert "did you mean smoke?" in capsys.readouterr().err


def test_every_problem_of_the_671b_warmup_recipe_is_reported_at_once():
    """What took a newcomer five attempts: one run lists them all."""
    with pytest.raises(ConfigError) as err:
        to_train_config(compose_recipe("v3.2_warmup"), check_environment=True, world_size=1)
    text = str(err.value)
    for key in ("model.pretrained", "data.sources", "parallel.context_parallel", "parallel.expert_parallel"):
        assert key in text, key
    if "cuda" not in text:  # the device check only fails without a GPU
        import torch

        assert torch.cuda.is_available()


@pytest.mark.integration
def test_launcher_side_config_error_exits_once_without_starting_workers(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "dsa_train.cli", "launch", "torchrun", "--nproc-per-node", "2",
         "stages.sparse.global_batch_size=6"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("dsa-train")]
    assert len(errors) == 1 and "stages.sparse.global_batch_size" in proc.stderr, proc.stderr
    assert "ChildFailedError" not in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()  # no rank started


def test_sbatch_of_the_warmup_recipe_asks_for_cpus_and_memory_and_warns_of_node_local_paths(tmp_path, capsys):
    from dsa_train.launch.launcher import render_sbatch

    script, _ = render_sbatch("v3.2_warmup", ["model.pretrained=/tmp/V3.1-Terminus", "data.sources=[/data/a.jsonl]"],
                              workdir="/shared/project")
    assert "#SBATCH --cpus-per-task=64" in script and "#SBATCH --mem=0" in script
    assert "OMP_NUM_THREADS:-8}" in script  # 64 cores over 8 ranks per node
    warnings = capsys.readouterr().err
    assert "model.pretrained=/tmp/V3.1-Terminus is on a node-local path" in warnings
    assert "run_dir" not in warnings  # /shared/project/runs/... is not node-local
