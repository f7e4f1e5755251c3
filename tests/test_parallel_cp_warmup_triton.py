"""The dense warm-up under context parallelism on the Triton path (issue 32): CP 2, main model
frozen, whole layers asked to recompute; each rank's two query runs attend in the MHA form over the
locally up-projected gathered latent, and the KL runs the dense KL kernel at each run's position
offset over the gathered keys (interpreted on the CPU: DSA_KERNELS=triton, TRITON_INTERPRET=1 in the
ranks), against a single process on the PyTorch references: loss and indexer gradients."""

import pytest

from tests.helpers import launch_selftest


@pytest.mark.integration
@pytest.mark.slow
def test_context_parallel_2_dense_warmup_triton_kernels(tmp_path, monkeypatch):
    monkeypatch.setenv("DSA_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rc, results, log = launch_selftest(
        2, ["--cp", "2", "--zero", "1", "--seq-len", "64", "--attention", "dense", "--trainable", "indexer",
            "--recompute", "full", "--steps", "1", "--global-batch", "2", "--reference-kernels", "ref",
            "--indexer-loss-atol", "2e-6"],
        str(tmp_path / "r.jsonl"),
    )
    assert rc == 0, log
    assert len(results) == 1, results
    r = results[0]
    assert r["layout"]["cp"] == 2 and not r["failures"], r["failures"]
    assert r["worst"]["loss"] < 2e-4 and r["worst"]["grad"] < 1e-3, r["worst"]
