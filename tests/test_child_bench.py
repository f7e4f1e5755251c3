"""The kernel-candidate benchmarks' harness (benchmarks/child_bench.py), through the scripts that use
it: without a CUDA GPU a full run measures nothing and says so (exit 2, the reason in the JSON);
`--small` smoke runs on the CPU are in the op's own tests (integration tier)."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize("script", ["gluon_sparse_mla.py", "gluon_index_scores.py"])
def test_a_benchmark_without_a_gpu_says_so(tmp_path, monkeypatch, script):
    spec = importlib.util.spec_from_file_location(script.removesuffix(".py"), BENCHMARKS / script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "r.json"
    assert mod.main([str(out)]) == 2
    result = json.loads(out.read_text())
    assert "no CUDA GPU" in result["status"] and result["rows"] == []
    assert not (tmp_path / "r.json.rows").exists()  # no child started
