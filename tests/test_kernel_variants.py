"""benchmarks/kernel_variants.py (the launch-variant sweep behind the tuned sparse-MLA / top-k
defaults, docs/kernels.md "Measured on a GPU"): its CPU smoke run under the interpreter. Every
variant kind runs, compiles, agrees with the first variant of its kind and is written to the JSON;
without a GPU and without --small it refuses in one line."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "kernel_variants.py"


def _module():
    spec = importlib.util.spec_from_file_location("kernel_variants", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_small_sweep_runs_every_kind_and_agrees(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "variants.json"
    module = _module()
    assert module.main([str(out), "--small", "--variants", "2"]) == 0
    rows = json.loads(out.read_text())
    candidates = [name for name, _ in module.BWD_INTERLEAVED]
    assert [r["kind"] for r in rows] == ["fwd", "fwd"] + ["bwd"] * (2 + len(candidates)) + ["topk", "topk"]
    assert not [r for r in rows if "status" in r], rows  # no variant raised
    fwd, bwd, topk = rows[1], rows[3], rows[-1]
    assert fwd["warps"] == 8 and fwd["err_vs_first"] < 1e-5
    assert bwd["stages"] == 2 and bwd["err_vs_first"] < 1e-5
    # the interleaved backward's configs run and agree with the default
    cand = {r["name"]: r for r in rows if r["kind"] == "bwd" and r["name"] in candidates}
    assert sorted(cand) == sorted(candidates) and all(r["err_vs_first"] < 1e-5 for r in cand.values()), cand
    assert topk["block"] == 1024 and topk["same_sets_as_first"] is True


def test_refuses_without_a_gpu(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _module().main([str(tmp_path / "x.json")]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
