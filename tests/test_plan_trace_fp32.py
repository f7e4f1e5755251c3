"""`dsa-train plan --trace` of the demo recipe as shipped (fp32, the CPU path): the routed experts'
grouped GEMMs run in fp32 on the CPU, but torch's meta function for `_grouped_mm` takes bf16 only,
so the trace crashed on every fp32 recipe with MoE layers (the trace tests all set bf16). And its
ZeRO-0 step kept an fp32 master copy of fp32 parameters, which neither engine makes."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def test_trace_of_the_shipped_fp32_demo_runs_its_grouped_experts():
    cmd = [sys.executable, "-m", "dsa_train.cli", "plan", "--trace", "--json", "--world", "2",
           "parallel.data_parallel=-1", "data.seq_len=64"]
    out = subprocess.run(cmd, env={**os.environ, "DS_ACCELERATOR": "cpu"}, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    t = json.loads(out.stdout.strip().splitlines()[-1])
    assert t["kernels"] == "cpu" and t["traced_matmul_flops"]["aten._grouped_mm"] > 0
    assert t["traced"]["parameters"] == pytest.approx(t["planned"]["parameters"], rel=0.02)  # fp32: 4 B a parameter
    # ZeRO-0 in fp32: the AdamW moments only (no fp32 master copy of fp32 parameters), as the plan says
    # (the maxima over the step: the moments and the update's temporary, which the plan takes over every
    # trainable parameter and the step forms for those with a gradient)
    assert t["layout"]["zero"] == 0
    assert 0.8 * t["planned_max"]["optimizer"] <= t["traced_max"]["optimizer"] <= t["planned_max"]["optimizer"], t
