"""The plan's compute parts against the matmuls a traced rank runs (`dsa-train plan --trace`:
FlopCounterMode over the traced step, aten's FLOP formulas plus the grouped expert GEMMs'). The
parts the plan times by FLOPs alone (projections, MLPs and experts, LM head, absorption, the
indexer's projections and Hadamard rotation) must be what the CUDA path issues on that rank for one
micro-batch -- under tensor parallelism (split heads, dense MLPs and shared experts, the router and
routed experts on each TP rank's share of the tokens; the indexer and LM head whole on every TP
rank), context parallelism and full recompute, and
with the row-chunked MLP's backward recompute (TP 1). Custom ops (the Triton kernels, library
attention) count no aten FLOPs: the warm-up's library attention is the one difference (its keys'
up-projections under context parallelism are counted: the op declares them)."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def _trace(*overrides: str) -> dict:
    """The demo recipe's largest stage (of warm-up and sparse: the pre-training stage left out) traced."""
    cmd = [sys.executable, "-m", "dsa_train.cli", "plan", "--trace", "--json", "--world", "2", "--config-name", "demo",
           "parallel=zero2", "data.seq_len=64", "model.dtype=bfloat16", "device=cuda", "~stages.pretrain", *overrides]
    out = subprocess.run(cmd, env={**os.environ, "DS_ACCELERATOR": "cpu"}, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("layout", [
    ("parallel.data_parallel=2",),  # TP 1: the dense MLP / shared experts row-chunked
    ("parallel.tensor_parallel=2", "parallel.recompute=full"),
    ("parallel.context_parallel=2",),
])
def test_sparse_stage_matmuls_are_the_plans(layout):
    t = _trace(*layout)
    assert t["stage"] == "sparse" and t["kernels"] == "cuda"
    traced, planned = sum(t["traced_matmul_flops"].values()), sum(t["planned_matmul_flops"].values())
    assert "aten._grouped_mm" in t["traced_matmul_flops"]  # the routed experts are counted
    assert abs(traced / planned - 1) < 1e-6, (t["layout"], t["traced_matmul_flops"], t["planned_matmul_flops"])


@pytest.mark.parametrize("layout", [("parallel.tensor_parallel=2",), ("parallel.context_parallel=2",)])
def test_warmup_matmuls_are_the_plans_but_the_library_attention(layout):
    """Under CP the keys' up-projections run inside the library attention's custom op
    (`mla_attention_rows`, which declares them: `dsa_kernels.chunk_ops.MATMUL_FLOPS`)."""
    t = _trace("~stages.sparse", *layout)
    assert t["stage"] == "warmup" and (t["layout"]["tp"], t["layout"]["cp"]) != (1, 1)
    if t["layout"]["cp"] > 1:
        assert t["traced_matmul_flops"]["dsa_kernels::mla_attention_rows"] > 0
    planned = t["planned_matmul_flops"]
    traced = sum(t["traced_matmul_flops"].values())
    assert planned["attention"] > 0
    assert abs(traced / (sum(planned.values()) - planned["attention"]) - 1) < 1e-6, (t["traced_matmul_flops"], planned)
