"""`dsa-train plan`: parameter counts match the model, the 671B recipes' layouts fit 80 GB GPUs by
the plan, and the plan's per-rank memory matches the measured peak of a CPU run within 20%."""

import json
import os
import subprocess
import sys

import pytest

from dsa_train.parallel.plan import count_params, main as plan_main
from tests.helpers import free_port


@pytest.mark.parametrize("overrides", [{}, {"q_lora_rank": None, "num_nextn_predict_layers": 0, "n_shared_experts": 2}])
def test_param_count_matches_model(overrides):
    from dsa_train.model import DSAForCausalLM, tiny_config

    cfg = tiny_config(**overrides)
    model = DSAForCausalLM(cfg)
    assert count_params(cfg).total == sum(p.numel() for p in model.parameters())


def test_671b_parameter_count():
    from dsa_train.model.config import DSAConfig

    n = count_params(DSAConfig())
    assert 684e9 < n.total < 687e9  # 671B + the 14B multi-token-prediction layer (HF: "685B")


@pytest.mark.parametrize("args", [
    ["--config-name", "v3.2_warmup"],
    ["--config-name", "v3.2_sparse", "parallel=v3_671b_sparse", "cluster=v3_671b_sparse"],
])
def test_671b_layouts_fit_80gb(args, capsys):
    assert plan_main([*args, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] and plan["peak_gib"] < 0.9 * 80, plan


def test_plan_rejects_layout_that_does_not_divide(capsys):
    assert plan_main(["--config-name", "v3.2_warmup", "parallel.expert_parallel=3"]) == 2
    assert "expert_parallel=3" in capsys.readouterr().err


def _memcheck(tmp_path, args):
    out = tmp_path / "mem.json"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "-m", "dsa_train.testing.memcheck", *args, "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc for VmHWM")
def test_plan_matches_measured_peak_zero2(tmp_path):
    r = _memcheck(tmp_path, ["--zero", "2", "--seq-len", "1024"])
    assert r["planned"]["activations"] > 0.15 * r["planned_gib"]  # not just model state
    assert 0.8 <= r["ratio"] <= 1.2, r


@pytest.mark.slow
def test_plan_matches_measured_peak_expert_parallel(tmp_path):
    r = _memcheck(tmp_path, ["--zero", "2", "--ep", "2", "--seq-len", "1024"])
    # Measured 0.87 (both ranks) since the plan counts the optimizer step's temporaries in their own
    # phase (they never coexist with the activations) and the CPU sparse kernels are memory-bounded
    # (was 0.79-0.81, with a loosened lower bound of 0.75).
    assert 0.8 <= r["ratio"] <= 1.2, r
