"""Memory bound of the dense warm-up indexer loss (issue 2): a one-layer, 16-head model runs the
eq. 3 loss forward and backward at T = 16384 within 3 GB of peak resident memory in total."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "indexer_loss_memory.py"


def run_child(seq_len: int) -> dict:
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--child", "--impl", "ours", "--seq-lens", str(seq_len)],
        capture_output=True, text=True, timeout=1500,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_warmup_indexer_loss_memory_small_T_is_bounded():
    row = run_child(2048)
    assert row["peak_rss_mb"] < 1024, row


# The function alone at T = 16384 (about 5 min on 2 cores) is covered by the model-path check below
# (the same loss inside one decoder layer, `test_model_stage_at_16k_within_3gb[warmup]`), so
# `make test` runs only the model path at 16K; this one stays for `pytest -m long`.
@pytest.mark.slow
@pytest.mark.long
def test_warmup_indexer_loss_at_16k_within_3gb():
    row = run_child(16384)
    assert row["peak_rss_mb"] < 3 * 1024, row


# ----------------------------------------------------------------------------- the model path
# One decoder layer of the shipped small_32k recipe (16 heads, MLA 192/128, 16-head indexer,
# bf16), one training micro-batch through Engine + forward_backward, two packed documents
# (benchmarks/model_memory.py). Issue 12: each stage <= 3 GB peak resident at T = 16384.
MODEL_BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "model_memory.py"


def run_model_child(stage: str, seq_len: int, topk: int | None = None) -> dict:
    cmd = [sys.executable, str(MODEL_BENCH), "--child", "--stages", stage, "--seq-lens", str(seq_len)]
    if topk is not None:
        cmd += ["--topk", str(topk)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_model_warmup_step_memory_small_T():
    """At T = 2048 one [16, T, T] fp32 tensor is 256 MB; the dense warm-up keeps none (the main
    attention runs forward-only with its lse, the KL builds its target chunk by chunk).
    Measured: 167 MB above the built model."""
    row = run_model_child("warmup", 2048)
    assert row["stage"] == "warmup" and row["heads"] == 16 and row["loss"] > 0
    assert row["extra_mb"] < 512, row


def test_model_sparse_step_memory_small_T():
    """Sparse stage (everything trains, LM loss + eq. 4): the chunked Functions' transients are
    bounded blocks, not O(T^2) (T = 2048, k = 2048, with the chunked attention Functions alone:
    405 MB above the built model)."""
    row = run_model_child("sparse", 1024, topk=128)
    assert row["stage"] == "sparse" and row["topk"] == 128 and row["loss"] > 0
    assert row["extra_mb"] < 768, row


# The warm-up at T = 16384 runs in `make test` (about 5 min in the fresh-clone suite). The sparse
# stage holds its 3 GB bound (measured 2577 MB peak, docs/kernels.md) but one run takes about
# 13.5 min on the loaded 2-core machine (7 CPU-minutes), so it is marked `long`, which
# `make test` deselects: `pytest -m long`.
@pytest.mark.slow
@pytest.mark.parametrize("stage", ["warmup", pytest.param("sparse", marks=pytest.mark.long)])
def test_model_stage_at_16k_within_3gb(stage):
    row = run_model_child(stage, 16384)
    assert row["peak_rss_mb"] < 3 * 1024, row
