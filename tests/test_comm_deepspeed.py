"""The plan's data-parallel gradient reduction (and ZeRO-1's parameter all-gather) against what a
real 2-rank DeepSpeed step issues: the demo recipe (fp32, data.seq_len=64, its sparse stage) at DP 2
on the CPU (gloo), ZeRO-0 and ZeRO-1, in fp32 and bf16, every collective recorded by
`tests/deepspeed_comm_record.py`. The plan modelled both as a `reduce` of each bucket to its
partition's owner (and the EP 1 routed experts as a second group); DeepSpeed 0.19 and the trainer
all-reduce every bucket over DP x CP, and in bf16 at ZeRO-0 DeepSpeed's BF16_Optimizer all-reduces
its whole flat gradient buffers (the parameters without a gradient too) (docs/distributed.md,
"Communication")."""

import json
import os
import subprocess
import sys
from collections import defaultdict

import pytest

from dsa_train.plan.estimate import main as plan_main
from tests.helpers import free_port

pytestmark = pytest.mark.integration

RECIPE = ["--config-name", "demo", "parallel.data_parallel=-1", "data.seq_len=64"]
DATA_PARALLEL_KINDS = ("gradient_reduction", "parameter_all_gather")
SCALAR_BYTES = 1024  # the step's metric sums, token counts, norms and overflow flags: a few bytes each


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def recorded(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("comm") / "comm.json"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "-m", "tests.deepspeed_comm_record", "--zero", "0,1", "--out", str(out), "--", *RECIPE,
           f"model.dtype={request.param}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return {**json.loads(out.read_text()), "dtype": request.param}


def planned_rows(capsys, zero: int, stage: str, dtype: str) -> list[dict]:
    assert plan_main([*RECIPE, "--world", "2", f"parallel.zero_stage={zero}", f"model.dtype={dtype}", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    (s,) = [s for s in plan["stages"] if s["stage"] == stage]
    return s["communication"]


@pytest.mark.parametrize("zero", [0, 1])
def test_plan_gradient_reduction_matches_a_real_deepspeed_step(recorded, capsys, zero):
    assert recorded["layout"]["dense_dp"] == 2 and recorded["micro_batches"] == 1
    calls = recorded["zero"][str(zero)]
    real: dict = defaultdict(lambda: {"calls": 0, "bytes": 0})
    for c in calls:  # the bucket-sized collectives: gradients and parameters, not the step's scalars
        if c["payload_bytes"] > SCALAR_BYTES:
            row = real[f"{c['op']} {c['group']} {c['phase']}"]
            row["calls"] += 1
            row["bytes"] += c["payload_bytes"]
            assert c["dtype"] == recorded["dtype"], c  # ZeRO-0/1 reduce in the model dtype
    planned: dict = defaultdict(lambda: {"calls": 0, "bytes": 0, "kinds": []})
    for r in planned_rows(capsys, zero, recorded["stage"], recorded["dtype"]):
        if r["kind"].startswith(DATA_PARALLEL_KINDS):
            row = planned[f"{r['op']} {r['group']} {r['phase']}"]
            row["calls"] += r["calls"]
            row["bytes"] += r["payload_bytes"]
            row["kinds"].append(r["kind"])
    assert set(planned) == set(real), (dict(planned), dict(real))
    gradients = {"all_reduce dense_dp step"}  # once per step at ZeRO-0 and ZeRO-1, the whole bucket to every rank
    assert {k for k, r in planned.items() if any(x.startswith("gradient_reduction") for x in r["kinds"])} == gradients
    for key in planned:
        assert abs(real[key]["bytes"] / planned[key]["bytes"] - 1) < 0.2, (key, planned[key], real[key])
        # within DeepSpeed's bucket granularity (ZeRO-1 gathers each of its two param groups apart)
        assert planned[key]["calls"] <= real[key]["calls"] <= planned[key]["calls"] + 2, (key, planned[key], real[key])
    if zero == 0:
        assert set(real) == gradients  # no ZeRO partition to gather
