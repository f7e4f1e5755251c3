"""The sm_90a compile gate: every kernel the dispatchers can launch, compiled at the 671B shapes
with the block sizes the launchers pick there (`dsa-train kernels report --arch sm_90a --json`,
Triton's compiler + its bundled ptxas, no GPU), must compile, not spill, fit in H100's 227 KB of
shared memory per block, and (attention kernels) use wgmma. The report runs once per session."""

import json
import os
import subprocess
import sys
import time

import pytest

from dsa_kernels.compile_report import SMEM_LIMIT, gate_failures, main as report_main
from dsa_kernels.registry import OPS

KEYS = ["op", "kernel", "config", "registers", "spill_bytes", "shared_bytes", "wgmma", "error"]
ATTENTION_OPS = {"sparse_mla_fwd", "sparse_mla_bwd", "dense_attention_fwd", "dense_attention_bwd"}
REQUIRED_OPS = set(OPS)  # every op of the report has registered kernels


@pytest.fixture(scope="module")
def sm90_report():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, do not interpret
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "dsa_train.cli", "kernels", "report", "--arch", "sm_90a", "--json"],
                          capture_output=True, text=True, env=env, timeout=900)
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    return proc, rows, time.perf_counter() - t0


def test_every_kernel_passes_the_sm90a_gate(sm90_report):
    proc, rows, seconds = sm90_report
    print(proc.stdout[-4000:], f"\nreport took {seconds:.0f} s")
    assert all(list(r) == KEYS for r in rows)
    ops = {r["op"] for r in rows}
    assert REQUIRED_OPS <= ops, f"missing ops: {REQUIRED_OPS - ops}"
    assert ops <= set(OPS)
    for r in rows:
        assert r["error"] is None, f"{r['op']} {r['kernel']} does not compile: {r['error']}"
        assert r["spill_bytes"] == 0, f"{r['op']} {r['kernel']} spills {r['spill_bytes']} B ({r['config']})"
        assert 0 < r["shared_bytes"] <= 227 * 1024, f"{r['op']} {r['kernel']}: {r['shared_bytes']} B shared"
        assert 0 < r["registers"] <= 255
        if r["op"] in ATTENTION_OPS:
            assert r["wgmma"] > 0, f"{r['op']} {r['kernel']} has no wgmma on sm_90a"
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_gate_rejects_bad_rows():
    ok = dict(zip(KEYS, ["sparse_mla_fwd", "k", "", 200, 0, 100_000, 8, None]))
    assert gate_failures(ok, 90, attention=True) == []
    assert gate_failures({**ok, "spill_bytes": 4}, 90, attention=True)
    assert gate_failures({**ok, "shared_bytes": SMEM_LIMIT[90] + 1}, 90, attention=True)
    assert gate_failures({**ok, "wgmma": 0}, 90, attention=True)
    assert gate_failures({**ok, "wgmma": 0}, 90, attention=False) == []
    assert gate_failures({**ok, "error": "CompilationError"}, 90, attention=False)


def test_report_bad_arguments_one_line(capsys):
    assert report_main(["report", "--op", "no_such_op"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no_such_op" in err[0] and "sparse_mla_fwd" in err[0]
    with pytest.raises(SystemExit):
        report_main(["report", "--arch", "sm_75"])
