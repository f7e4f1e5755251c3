"""A core install (no `train` extra: no datasets / wandb / matplotlib, as on a cluster image set
up for `dsa-train gpu-check`) asked to train gets one line naming the missing package and the
extra to install, not a traceback."""

import subprocess
import sys

import pytest

from dsa_train.errors import DSATrainError
from dsa_train.runtime import require_train_extra

# run the CLI in a fresh interpreter in which `datasets` and `wandb` cannot be imported (None in
# sys.modules: importing one or a submodule raises ModuleNotFoundError, importlib.util.find_spec gives None)
BLOCKED = r"""
import sys
sys.modules["datasets"] = sys.modules["wandb"] = None
from dsa_train.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_require_train_extra_names_the_package_and_the_extra():
    require_train_extra("json")  # present: nothing happens
    with pytest.raises(DSATrainError) as err:
        require_train_extra("json", "no_such_package_dsa")
    msg = str(err.value)
    assert "\n" not in msg and "no_such_package_dsa" in msg and "json" not in msg.split("lacks")[0]
    assert 'dsa-train[train]' in msg and "docs/install.md" in msg


@pytest.mark.integration
def test_a_hub_source_without_datasets_is_one_line_naming_the_data_extra(tmp_path):
    """Local files and the bundled corpus train without `datasets` (dsa_train/data/sources.py reads
    them); a Hugging Face hub source needs it, and says so before anything runs."""
    proc = subprocess.run([sys.executable, "-c", BLOCKED, "profile=smoke", f"run_dir={tmp_path}/run",
                           "logging.wandb_mode=disabled", "data.sources=[some-owner/some-corpus]"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    err = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert any("datasets" in line and "dsa-train[data]" in line for line in err), proc.stderr[-2000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.integration
def test_wandb_logging_without_wandb_is_one_line_and_datasets_is_not_asked_for(tmp_path, monkeypatch):
    # the bundled corpus needs no `datasets`; offline W&B logging needs wandb: only wandb is named
    monkeypatch.delenv("WANDB_MODE", raising=False)
    proc = subprocess.run([sys.executable, "-c", BLOCKED, "profile=smoke", f"run_dir={tmp_path}/run",
                           "logging.wandb_mode=offline"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    err = [line for line in proc.stderr.splitlines() if "dsa-train[train]" in line]
    assert proc.returncode == 2 and len(err) == 1, proc.stderr[-2000:]
    assert "wandb" in err[0] and "datasets" not in err[0], err[0]
