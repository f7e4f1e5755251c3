"""gpu-check's warm-up checks (issue 32) in their CPU form (`--device cpu --small`, the Triton
interpreter): `speed.warmup_layer` runs its whole body and reports the layer step against SDPA's
forward; `correctness.warmup_attention*` pass, and fail on a wrong lse."""

import os
import subprocess
import sys

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

from dsa_train.gpucheck import correctness, speed  # noqa: E402
from dsa_train.gpucheck.core import Options  # noqa: E402

OPTS = Options(device="cpu", small=True)


def test_warmup_layer_speed_cpu_form(monkeypatch):
    monkeypatch.setenv("DSA_KERNELS", "triton")
    out = speed.warmup_layer_speed(OPTS)
    assert out.status == "info", out.summary
    rows = {(r["pass"], r["impl"]) for r in out.metrics["timings"] if r.get("ms")}
    assert {("attention fwd", "ours"), ("kl fwd", "ours"), ("kl bwd", "ours"), ("layer step", "ours"),
            ("attention fwd", "PyTorch SDPA")} <= rows
    assert out.metrics["step_over_sdpa_fwd"] > 0 and "SDPA fwd" in out.summary
    # issue 32 item 5: the fused KL timed beside the split one, and agreeing with it
    assert {("kl fwd+bwd", "ours"), ("kl fwd+bwd", "fused"), ("layer step", "fused")} <= rows
    fused = out.metrics["fused_vs_split"]
    assert fused["agree"] and fused["ours_impl"] == "split", fused
    assert set(fused["relative_difference"]) == {"kl", "dq_I", "dk_I", "dw"}
    assert max(fused["relative_difference"].values()) < 1e-4  # fp32 under the interpreter
    assert out.metrics["fused_step_over_sdpa_fwd"] > 0 and "fused" in out.summary
    assert "layer_memory_fused" in out.metrics and "layer_memory_fused_keep" in out.metrics


@pytest.mark.integration
def test_warmup_checks_are_listed():
    names = {c.name for c in speed.checks(Options())} | {c.name for c in correctness.checks(Options())}
    assert {"speed.warmup_layer", "correctness.warmup_attention.T4096", "correctness.warmup_attention.cp.T16384",
            "correctness.dense_indexer_kl.cp.T16384"} <= names
    proc = subprocess.run([sys.executable, "-m", "dsa_train.cli", "gpu-check", "--dry-run"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "speed.warmup_layer" in proc.stdout and "vs SDPA" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.parametrize("cp", [False, True])
def test_warmup_attention_check_passes_and_fails_on_a_wrong_lse(monkeypatch, cp):
    T = 64 if not cp else 128
    assert correctness.warmup_attention_check(T, cp=cp)(OPTS).status == "pass"
    from dsa_kernels.ops.dense_attention import library

    real = library._rows_reference if cp else library.dense_attention_fwd_ref

    def off(*args, **kwargs):
        out, lse = real(*args, **kwargs)
        return out, lse + 1e-2

    monkeypatch.setattr(library, "_rows_reference" if cp else "dense_attention_fwd_ref", off)
    bad = correctness.warmup_attention_check(T, cp=cp)(OPTS)
    assert bad.status == "fail" and "lse" in bad.summary, bad.summary


def test_dense_kl_cp_check_cpu_form(monkeypatch):
    monkeypatch.setenv("DSA_KERNELS", "triton")
    out = correctness.dense_kl_cp_check(128)(OPTS)
    assert out.status == "pass", out.summary
    assert set(out.metrics["outputs"]) == {"kl", "kl_uniform", "dq_I", "dw", "dk_I"}
