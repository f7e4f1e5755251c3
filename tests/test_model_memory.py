"""Memory bound of the dense warm-up indexer loss (issue 2): a one-layer, 16-head model runs the
eq. 3 loss forward and backward at T = 16384 within 3 GB of peak resident memory in total."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.slow
def test_warmup_indexer_loss_at_16k_within_3gb():
    row = run_child(16384)
    assert row["peak_rss_mb"] < 3 * 1024, row
