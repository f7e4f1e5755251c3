"""The autotuner (`dsa_kernels.autotune`): the default off the GPU, the fastest config timed once per
(kernel, GPU, Triton, shapes) and cached on disk, and every config of a space in the compile gate
(sparse MLA forward / backward, the top-k select)."""

from __future__ import annotations

import json

import pytest
import torch
import triton

from dsa_kernels import autotune
from dsa_kernels._triton_common import planning_for
from dsa_kernels.ops.indexer_topk.kernel import select_config_space
from dsa_kernels.ops.sparse_mla.kernel import BWD_CONFIG_SPACE, FWD_CONFIG_SPACE, bwd_config_space, fwd_config_space
from dsa_kernels.registry import cases

CANDIDATES = [("a", "launch-a"), ("b", "launch-b"), ("c", "launch-c")]
TIMES = {"launch-a": 3.0, "launch-b": 1.0, "launch-c": 2.0}


class Bench:
    def __init__(self, times=None):
        self.calls, self.times = [], {**TIMES, **(times or {})}

    def __call__(self, launch):
        self.calls.append(launch)
        return self.times[launch]


def _pick(kernel, key, candidates, **kw):
    """autotune.pick over (name, launch) pairs: the launch of a name is looked up (planned)."""
    return autotune.pick(kernel, key, [n for n, _ in candidates], dict(candidates).__getitem__, **kw)


@pytest.fixture(autouse=True)
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DSA_AUTOTUNE_CACHE", str(tmp_path / "autotune.json"))
    monkeypatch.delenv("DSA_AUTOTUNE", raising=False)
    monkeypatch.setattr(autotune, "_MEMORY", {})
    return tmp_path / "autotune.json"


def test_off_the_gpu_the_default_without_timing():
    bench = Bench()
    assert _pick("k", (1,), CANDIDATES, on_gpu=False, bench=bench) == ("a", "launch-a")
    assert bench.calls == []


def test_fastest_timed_once_then_read_from_the_cache(fresh_cache, monkeypatch):
    bench = Bench()
    assert _pick("k", (1, 2), CANDIDATES, on_gpu=True, device_id="H100 sm_90", bench=bench) == ("b", "launch-b")
    assert sorted(bench.calls) == ["launch-a", "launch-b", "launch-c"]
    stored = json.loads(fresh_cache.read_text())
    (entry,) = stored
    assert stored[entry] == "b" and entry.startswith("k|H100 sm_90|triton ")
    assert autotune.choices("k") == {entry: "b"} and autotune.choices("other") == {}
    # a new process (empty memory) reads the file: no timing
    monkeypatch.setattr(autotune, "_MEMORY", {})
    again = Bench()
    assert _pick("k", (1, 2), CANDIDATES, on_gpu=True, device_id="H100 sm_90", bench=again)[0] == "b"
    assert again.calls == []
    # another shape or GPU is timed on its own
    other = Bench()
    _pick("k", (1, 3), CANDIDATES, on_gpu=True, device_id="H100 sm_90", bench=other)
    assert len(other.calls) == 3


def test_a_cached_name_outside_the_space_is_timed_again(fresh_cache):
    import triton

    fresh_cache.write_text(json.dumps({f"k|GPU|triton {triton.__version__}|1": "gone"}))
    bench = Bench()
    assert _pick("k", (1,), CANDIDATES, on_gpu=True, device_id="GPU", bench=bench)[0] == "b"
    assert len(bench.calls) == 3


def test_a_space_that_gains_a_config_is_timed_again(monkeypatch):
    """A choice made without a config (say an opt-in Gluon kernel) does not hide it once it joins the
    space: the entry names the space, so the larger space is timed; the smaller one keeps its choice."""
    bench = Bench()
    assert _pick("k", (1,), CANDIDATES[:2], on_gpu=True, device_id="GPU", bench=bench)[0] == "b"
    monkeypatch.setattr(autotune, "_MEMORY", {})  # a later process, reading the file
    more = Bench({"launch-c": 0.5})
    assert _pick("k", (1,), CANDIDATES, on_gpu=True, device_id="GPU", bench=more)[0] == "c"
    assert sorted(more.calls) == ["launch-a", "launch-b", "launch-c"]
    again = Bench()
    assert _pick("k", (1,), CANDIDATES[:2], on_gpu=True, device_id="GPU", bench=again)[0] == "b"
    assert again.calls == []


def test_a_config_that_disagrees_is_never_timed_nor_chosen():
    """verify(name) is asked once per timing for every config but the default; one that disagrees
    with the default is left out with a warning, the rest are timed as usual."""
    bench, asked = Bench(), []

    def verify(name):
        asked.append(name)
        return name != "b"  # the fastest one computes something else

    with pytest.warns(RuntimeWarning, match="config b disagrees with the default"):
        name, _ = _pick("k", (1,), CANDIDATES, on_gpu=True, device_id="GPU", bench=bench, verify=verify)
    assert name == "c" and asked == ["b", "c"]
    assert sorted(bench.calls) == ["launch-a", "launch-c"]
    again = Bench()  # remembered: neither verified nor timed again
    assert _pick("k", (1,), CANDIDATES, on_gpu=True, device_id="GPU", bench=again, verify=verify)[0] == "c"
    assert again.calls == [] and asked == ["b", "c"]


def test_deterministic_mode_runs_the_default():
    import torch

    bench = Bench()
    torch.use_deterministic_algorithms(True)
    try:
        assert _pick("k", (1,), CANDIDATES, on_gpu=True, device_id="GPU", bench=bench)[0] == "a"
    finally:
        torch.use_deterministic_algorithms(False)
    assert bench.calls == []


def test_switch_off_and_bad_value(monkeypatch):
    monkeypatch.setenv("DSA_AUTOTUNE", "0")
    bench = Bench()
    assert _pick("k", (1,), CANDIDATES, on_gpu=True, device_id="GPU", bench=bench)[0] == "a"
    assert bench.calls == []
    monkeypatch.setenv("DSA_AUTOTUNE", "maybe")
    with pytest.raises(ValueError, match="DSA_AUTOTUNE must be 1 or 0"):
        _pick("k", (1,), CANDIDATES, on_gpu=True, device_id="GPU", bench=bench)


@pytest.mark.parametrize("capability", sorted(FWD_CONFIG_SPACE))
def test_every_forward_config_is_in_the_compile_gate(capability):
    """The registry (what `dsa-train kernels report` / the gate compiles) holds one sparse-MLA forward
    case per config of the architecture's space, with that config's key tile and stages."""
    with planning_for(capability):
        built = [c for c in cases(["sparse_mla_fwd"]) if not c.config.startswith("CP ")]
    got = {(c.launch.args["BLOCK_K"], c.launch.num_stages) for c in built}
    assert got == {(block_k, stages) for _, block_k, stages in fwd_config_space(capability)}


def test_forward_space_follows_the_triton_version():
    """Hopper's space depends on the Triton that compiles it: 3.6 (torch 2.11's) holds 32-key tiles
    without spill and ran them 1.55x faster on an H200 than 16-key ones (docs/kernels.md); 3.9
    spills at 32 keys and keeps 16. Blackwell's space is the same for both."""
    triton_cfgs = lambda version: [c for c in fwd_config_space(90, version) if not c[0].startswith("gluon")]  # noqa: E731
    assert {bk for _, bk, _ in triton_cfgs("3.6.0")} == {32}
    assert {bk for _, bk, _ in triton_cfgs("3.9.0")} == {16}
    assert fwd_config_space(100, "3.6.0") == fwd_config_space(100, "3.9.0") == FWD_CONFIG_SPACE[100]
    assert fwd_config_space(90) == fwd_config_space(90, triton.__version__)


@pytest.mark.parametrize("capability", sorted(BWD_CONFIG_SPACE))
def test_every_backward_config_is_in_the_compile_gate(capability):
    """One atomic sparse-MLA backward case per config of the architecture's space: the split kernel
    (the default) and, on Hopper, the interleaved one at its keys per tile and stages."""
    with planning_for(capability):
        built = [c for c in cases(["sparse_mla_bwd"])
                 if not c.config.startswith("CP ") and "DETERMINISTIC=True" not in c.config]
    got = {(c.kernel_name, c.launch.args["BLOCK_K"] if c.launch.args["BLOCK_K"] != 16 or "SPLIT" not in c.launch.args
            else None, c.launch.num_stages) for c in built}
    kernels = {"split": "_sparse_mla_bwd_kernel", "interleaved": "_sparse_mla_bwd_interleaved_kernel",
               "gluon": "_sparse_mla_bwd_gluon_kernel"}
    want = {(kernels[schedule], bk, st) for _, schedule, bk, st in bwd_config_space(capability)}
    assert got == want
    assert bwd_config_space(capability)[0][1] == "split"  # the measured kernel stays the default


def test_backward_space_follows_the_triton_version():
    """Under Triton 3.6 Hopper's backward space adds the split kernel at 32 keys x 3 stages (478 vs
    709-727 ms on an H200; its spill is listed in the gate's ALLOWED_SPILLS); 3.9 and sm_100 do not."""
    from dsa_kernels import compile_report

    triton_cfgs = lambda version: [c for c in bwd_config_space(90, version) if c[1] != "gluon"]  # noqa: E731
    extra = set(triton_cfgs("3.6.0")) - set(triton_cfgs("3.9.0"))
    assert extra == {("split-k32-s3", "split", 32, 3)}
    assert tuple(triton_cfgs("3.9.0")) == BWD_CONFIG_SPACE[90]
    assert bwd_config_space(100, "3.6.0") == bwd_config_space(100, "3.9.0") == BWD_CONFIG_SPACE[100]
    assert any(k[0] == "_sparse_mla_bwd_kernel" and k[1].startswith("autotune config split-k32-s3")
               and k[2:] == ("3.6", 90) for k in compile_report.ALLOWED_SPILLS)


@pytest.mark.parametrize("capability", [90, 100])
def test_every_select_config_is_in_the_compile_gate(capability):
    """The top-k select: one case per config of its space and score dtype (fp32, bf16), each at
    the config's score block and warps."""
    with planning_for(capability):
        built = cases(["indexer_topk"])
    got = sorted((c.launch.args["BLOCK"], c.launch.num_warps, str(c.launch.args["S"].dtype)) for c in built
                 if c.kernel_name == "_radix_topk_kernel")
    # and the composite path's key kernel (its other candidate, torch.topk, is not a Triton kernel)
    assert sorted(str(c.launch.args["S"].dtype) for c in built if c.kernel_name == "_composite_keys_kernel") == [
        "torch.bfloat16", "torch.float32"]
    want = sorted((block, warps, str(dtype)) for _, block, warps in select_config_space(capability)
                  for dtype in (torch.float32, torch.bfloat16))
    assert got == want
    assert select_config_space(capability)[0] == ("b4096-w8", 4096, 8)  # the measured default
