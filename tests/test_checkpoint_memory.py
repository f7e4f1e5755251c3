"""Loading a multi-shard checkpoint peaks at about the model plus one shard, not twice the model.

Each measurement runs in a fresh process (benchmarks/checkpoint_load_memory.py): the growth of
the peak resident set (VmHWM: ru_maxrss would include pytest's own, inherited through fork)
over the process's peak before loading."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "checkpoint_load_memory.py"


def run(*args) -> dict:
    out = subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]) if out.stdout.strip() else {}


def test_streaming_load_peaks_at_model_plus_one_shard(tmp_path):
    run("make", tmp_path)
    ours = run("load", tmp_path)
    naive = run("naive", tmp_path)
    model, shard = ours["model_mb"], ours["largest_shard_mb"]
    assert ours["shards"] >= 8 and model > 300
    assert ours["peak_growth_mb"] <= model + shard + 30, ours
    assert naive["peak_growth_mb"] >= 1.8 * model, naive  # the measurement sees a second copy
