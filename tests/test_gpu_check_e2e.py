"""`dsa-train gpu-check`'s end-to-end and NCCL steps (dsa_train/gpucheck/e2e.py).

On the CPU (`--small`): the real trainer runs both stages of the tiny model three times (reference,
SIGKILLed as step 7 starts, resumed from step 5) and the resumed losses must equal the
uninterrupted run's bit for bit; the 2-rank EP2 launch runs on gloo. On a GPU (`-m gpu`): the same checks at small_32k's
shape (2 layers, T = 32768) with the Triton kernels, and NCCL where there are >= 2 GPUs."""

import math

import pytest

from dsa_train.gpucheck import e2e
from dsa_train.gpucheck.core import SECTIONS, Options, Outcome


def _check(opts, name):
    (check,) = [c for c in e2e.checks(opts) if c.name == name]
    return check


def test_checks_are_named_in_their_sections_with_their_shapes(tmp_path):
    for device, small, seq in (("cpu", True, "T=64"), ("cuda", False, "T=32768")):
        checks = e2e.checks(Options(device=device, small=small, out=tmp_path))
        assert [(c.name, c.section) for c in checks] == [("end-to-end.grouped_experts", "end-to-end"),
                                                        ("end-to-end.train_kill_resume", "end-to-end"),
                                                        ("end-to-end.throughput", "end-to-end"),
                                                        ("nccl.ep2", "nccl")]
        assert all(c.section in SECTIONS for c in checks)
        checks = checks[1:]
        assert seq in checks[0].shapes and "SIGKILL at step 7" in checks[0].shapes
        assert seq in checks[1].shapes and "deterministic=false" in checks[1].shapes
    assert "Triton kernels" in checks[0].shapes and "small_32k cut to 2 layers" in checks[0].shapes
    assert "warm-up 5 + sparse 8 steps" in checks[1].shapes and "torch.profiler on steps (5, 13)" in checks[1].shapes
    assert "T=8192" in checks[2].shapes and "NCCL" in checks[2].shapes
    grouped = e2e.checks(Options(device="cuda", small=False, out=tmp_path))[0]
    assert "32 experts" in grouped.shapes and "bf16" in grouped.shapes and "131072 routed rows" in grouped.shapes


def test_grouped_experts_check_passes_on_the_cpu_and_fails_on_wrong_gemms(tmp_path, monkeypatch):
    """end-to-end.grouped_experts (the CPU form: fp32, exact) and a grouped path that computes
    wrong (its output doubled) or raises: one failing line each."""
    import dsa_train.model.grouped_experts as ge

    opts = Options(device="cpu", small=True, out=tmp_path)
    out = e2e.run_grouped_experts(opts)
    assert out.status == "pass", out.summary
    assert out.metrics["path"] == "grouped" and all(v["grouped"] <= 1e-6 for v in out.metrics["errors"].values())
    original = ge.grouped_expert_mlp
    monkeypatch.setattr(ge, "grouped_expert_mlp", lambda *a, **k: 2 * original(*a, **k))
    out = e2e.run_grouped_experts(opts)
    assert out.status == "fail" and out.summary.startswith("FAILED out, dx") and "\n" not in out.summary

    def broken(*a, **k):
        raise RuntimeError("grouped_mm: mat_b strides must be aligned\nmore")

    monkeypatch.setattr(ge, "grouped_expert_mlp", broken)
    out = e2e.run_grouped_experts(opts)
    assert out.status == "fail" and "mat_b strides must be aligned" in out.summary and "\n" not in out.summary
    assert "parallel.grouped_experts=false" in out.summary


def test_throughput_profile_rows_and_report_table():
    table = """# global step 3: 0.2 s wall

## by self device time
-------------  ------------
Name           Self CUDA %
-------------  ------------
sparse_mla_fwd  40.1%  4.0ms
aten::mm        20.0%  2.0ms
-------------  ------------
Self CPU time total: 1ms

## by self CPU time
Name  Self CPU %
other  1%
"""
    assert e2e.top_rows(table, 5) == ["sparse_mla_fwd 40.1% 4.0ms", "aten::mm 20.0% 2.0ms"]
    stage = {"tokens_per_s": 10.0, "plan_tokens_per_s": 20.0, "mfu": 0.1, "plan_mfu": 0.35, "step_time_s": 1.0,
             "plan_step_s": 0.5, "peak_memory_gib": 1.0, "peak_memory_kind": "allocated", "plan_gib": 2.0}
    md = "\n".join(e2e.markdown_lines({"name": "end-to-end.throughput", "metrics": {
        "layout": "L", "deterministic": False, "stages": {"sparse": stage},
        "profiles": {"11": ["sparse_mla_fwd 40.1% 4.0ms"]}, "profiled_by": "self device time"}}))
    assert "steady state" in md and "deterministic=false" in md and "| sparse | 10 | 20 | 10.0% | 35.0% |" in md
    assert "global step 11" in md and "sparse_mla_fwd 40.1% 4.0ms" in md


def test_throughput_host_overhead_from_the_profile_calls(tmp_path):
    """end-to-end.throughput's host counts come from every profiler event (the calls section of
    logging/profile.py's table), not from the 30 rows of its tables."""
    import torch

    from dsa_train.logging.profile import profile_path, profiled

    x = torch.randn(16, 16)
    with profiled(1, [1], tmp_path, torch.device("cpu")):
        for _ in range(3):
            float((x @ x).sum())
    table = profile_path(tmp_path, 1, 0, ".txt").read_text()
    h = e2e.host_overhead(table)
    assert h["aten::mm"] == 3 and h["host_reads"] == 3 and h["kernel_launches"] == 0 and h["syncs"] == 0
    assert h["events"] > 6 and h["self_cpu_ms"] > 0
    fake = table.split("## calls")[0] + "## calls of every event (name, calls, self CPU us, self device us)\n" + \
        "cudaLaunchKernel\t100\t500.0\t0.0\ncuLaunchKernelEx\t5\t50.0\t0.0\ncudaStreamSynchronize\t7\t70.0\t0.0\n" + \
        "aten::_grouped_mm\t9\t90.0\t2000.0\n"
    h = e2e.host_overhead(fake)
    assert (h["kernel_launches"], h["syncs"], h["aten::_grouped_mm"], h["self_device_ms"]) == (105, 7, 9, 2.0)
    md = "\n".join(e2e.markdown_lines({"name": "end-to-end.throughput", "metrics": {
        "layout": "L", "deterministic": False, "stages": {}, "host_overhead": {"13": h}}}))
    assert "| 13 | 105 | 7 | 0 | 0 | 0 | 9 | 0 |" in md


def test_the_gpu_runs_are_valid_recipes_that_fit_the_gpu(tmp_path):
    """The CUDA variants' overrides, composed and checked here on the CPU as the trainer will
    (everything but the CUDA device), and planned for their layouts."""
    from dsa_train.config import load_recipe
    from dsa_train.plan.estimate import make_plan, parse_opts

    opts = Options(device="cuda", out=tmp_path)
    for layout, world, steps in ((e2e.single_layout(opts), 1, (3, 4, 2)), (e2e.nccl_layout(opts), 2, (1, 2, 0))):
        cfg = load_recipe(e2e.RECIPE, layout.overrides(tmp_path / "run", *steps))
        assert cfg.model.arch["num_hidden_layers"] == 2 and cfg.model.dtype.value == "bfloat16"
        assert cfg.data.seq_len == layout.seq_len and cfg.deterministic and cfg.logging.wandb_mode.value == "disabled"
        assert list(cfg.stages) == ["warmup", "sparse"] and cfg.stages["sparse"].topk == 2048 < cfg.data.seq_len
        plan = make_plan(cfg, parse_opts([])[0], world=world)
        assert plan["layout"]["zero"] == 2 and plan["layout"]["ep"] == world and plan["fits"]
    assert e2e.single_layout(opts).seq_len == 32768 and e2e.nccl_layout(opts).seq_len == 8192


def test_a_missing_package_is_one_failing_line_naming_it_and_the_wheelhouse(tmp_path, monkeypatch):
    monkeypatch.setitem(e2e.REQUIRED, "no_such_module_dsa_gpucheck", "no-such-dist")
    monkeypatch.setitem(e2e.REQUIRED, "no_such_parent.child", "no-such-parent")
    opts = Options(device="cpu", small=True, out=tmp_path)
    for name in ("end-to-end.train_kill_resume", "nccl.ep2"):
        out = _check(opts, name).run(opts)
        assert out.status == "fail" and "\n" not in out.summary
        assert "no-such-dist, no-such-parent" in out.summary and "docs/install.md" in out.summary
        assert "'dsa-train'" in out.summary and "--no-index" in out.summary
    assert not (tmp_path / "end-to-end").exists()  # nothing ran


def test_one_gpu_skips_nccl(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    out = _check(Options(device="cuda", out=tmp_path), "nccl.ep2").run(Options(device="cuda", out=tmp_path))
    assert (out.status, out.summary) == ("skip", "one GPU: NCCL not exercised")


def test_compare_reports_any_bit_of_difference():
    ref = {6: {k: 1.0 for k in e2e.COMPARED}, 7: {k: 2.0 for k in e2e.COMPARED}}
    assert e2e.compare(ref, {6: dict(ref[6]), 7: dict(ref[7])}) == []
    got = {6: dict(ref[6]), 7: {**ref[7], "train/loss": math.nextafter(2.0, 3.0), "optim/grad_norm": None}}
    diffs = e2e.compare(ref, got)
    assert [(d["step"], d["key"]) for d in diffs] == [(7, "train/loss"), (7, "optim/grad_norm")]


def _rows(steps, value=lambda step, key: float(step)):
    return {s: {k: value(s, k) for k in e2e.COMPARED} for s in steps}


def test_judge_resume_bitwise_replay_and_continuation():
    first = e2e.RESUME_STEP + 1
    everything = range(1, e2e.KILL_STEP + 1)
    ref, killed, resumed = _rows(everything), _rows(range(1, e2e.KILL_STEP)), _rows(range(first, e2e.KILL_STEP + 1))
    status, verdict, details = e2e.judge_resume(ref, killed, resumed)
    assert status == "pass" and "bitwise equal to the uninterrupted run" in verdict
    assert details["reproducible"] and details["replay_equal"] and details["equal"]

    # reproducible runs: any resumed value off by one ulp fails, the gradient norm included
    off = {**resumed, e2e.KILL_STEP: {**resumed[e2e.KILL_STEP], "optim/grad_norm": math.nextafter(7.0, 8.0)}}
    status, verdict, _ = e2e.judge_resume(ref, killed, off)
    assert status == "fail" and "optim/grad_norm" in verdict

    # runs that differ before the kill (atomics): the replay alone decides, and the verdict says so
    noisy = {s: {k: v * (1 + 1e-7) if s > 1 and k != "optim/lr" else v for k, v in row.items()} for s, row in killed.items()}
    replayed = {**resumed, first: dict(noisy[first])}
    status, verdict, details = e2e.judge_resume(ref, noisy, replayed)
    assert status == "pass" and "NOT reproducible here" in verdict and not details["reproducible"]
    assert 0 < details["run_to_run_max_rel_diff"] < 1e-6
    # ... and a replay that is not the killed run's step fails whatever the noise
    wrong = {**replayed, first: {**replayed[first], "train/lm_loss": math.nextafter(noisy[first]["train/lm_loss"], 0)}}
    status, verdict, _ = e2e.judge_resume(ref, noisy, wrong)
    assert status == "fail" and "replayed step differs" in verdict and "train/lm_loss" in verdict


def test_no_time_left_fails_without_starting_a_run(tmp_path):
    opts = Options(device="cpu", small=True, out=tmp_path, deadline=0.0)
    out = _check(opts, "end-to-end.train_kill_resume").run(opts)
    assert out.status == "fail" and "no time left" in out.summary
    assert not list((tmp_path / "end-to-end").glob("*.log"))


def _assert_train_kill_resume(out: Outcome, device: str):
    assert out.status == "pass", out.summary
    m = out.metrics
    resume = m["resume"]
    assert resume["replay_equal"] and resume["replay_differences"] == []
    assert resume["resumed_from"] == "step_00000005" and resume["first_resumed_step"] == 6
    assert resume["fault"] == "step=7,kind=sigkill,at=step" and set(resume["losses"]) == {"6", "7"}
    assert all(math.isfinite(v["resumed"]) for v in resume["losses"].values())
    if device == "cpu":  # reproducible: the continuation is bitwise too
        assert resume["reproducible"] and resume["equal"] and resume["differences"] == []
        assert all(v["reference"] == v["resumed"] for v in resume["losses"].values())
    assert set(m["stages"]) == {"warmup", "sparse"}
    for stage in m["stages"].values():
        assert stage["tokens_per_s"] > 0 and stage["step_time_s"] > 0 and stage["peak_memory_gib"] > 0
        assert stage["mfu"] is None or stage["mfu"] > 0
        assert stage["plan_gib"] > 0 and stage["plan_tokens_per_s"] > 0 and 0 < stage["plan_mfu"] <= m["plan"]["assumed_mfu"]
        assert stage["peak_memory_kind"] == ("allocated" if device == "cuda" else "RSS")
    assert m["plan"]["layout"]["zero"] == 2 and m["plan"]["layout"]["world"] == 1
    assert "bitwise equal" in out.summary and "plan" in out.summary
    assert out.summary.startswith("SIGKILL at step 7, resumed from step_00000005: ")


# The CPU runs of train_kill_resume and nccl.ep2 run from the built wheel in
# tests/test_install_offline.py (the GPU session's rehearsal), which checks their outcomes with
# `assert_small_cpu_outcomes` below: one run of each, not two.
def assert_small_cpu_outcomes(report: dict, logs_root) -> None:
    """What the CPU runs of the end-to-end checks must show (report: gpu-check's report.json)."""
    outcomes = {c["name"]: Outcome(c["status"], c["summary"], c["metrics"]) for c in report["checks"]}
    out = outcomes["end-to-end.train_kill_resume"]
    _assert_train_kill_resume(out, "cpu")
    assert out.metrics["seq_len"] == 64 and "PyTorch reference kernels" in out.metrics["layout"]
    logs = logs_root / "end-to-end"
    assert {p.name for p in logs.glob("*.log")} == {"reference.log", "killed.log", "resumed.log"}
    assert "resumed from" in (logs / "resumed.log").read_text()
    assert not (logs / "reference" / "checkpoints").exists()  # deleted after a pass
    md = "\n".join(e2e.markdown_lines({"metrics": out.metrics}))
    assert "| warmup | " in md and "| sparse | " in md and "replay bitwise yes" in md
    assert f"| 7 | {out.metrics['resume']['losses']['7']['reference']!r} | — |" in md
    ep2 = outcomes["nccl.ep2"]
    assert ep2.status == "pass", ep2.summary
    assert ep2.summary.startswith("gloo stand-in (CPU, NCCL not exercised)")
    assert ep2.metrics["backend"] == "gloo" and len(ep2.metrics["losses"]) == 3
    assert all(math.isfinite(v) for v in ep2.metrics["losses"])
    assert all(v > 0 for v in ep2.metrics["tokens_per_s"].values())
    tp = outcomes["end-to-end.throughput"]
    assert tp.status == "pass", tp.summary
    assert set(tp.metrics["profiles"]) == {"3", "5"} and all(tp.metrics["profiles"].values())
    # host counts of the profiled steps (the GPU session reads launches and synchronizations there)
    assert set(tp.metrics["host_overhead"]) == {"3", "5"}
    assert all(h["events"] > 0 and h["aten::_grouped_mm"] > 0 for h in tp.metrics["host_overhead"].values())
    assert "kernel launches" in tp.summary


@pytest.mark.gpu
def test_cuda_train_kill_resume_and_nccl(tmp_path):
    import torch

    opts = Options(device="cuda", small=False, out=tmp_path)
    out = _check(opts, "end-to-end.train_kill_resume").run(opts)
    _assert_train_kill_resume(out, "cuda")
    assert out.metrics["seq_len"] == 32768 and "Triton kernels" in out.metrics["layout"]
    nccl = _check(opts, "nccl.ep2").run(opts)
    if torch.cuda.device_count() < 2:
        assert nccl.status == "skip" and nccl.summary == "one GPU: NCCL not exercised"
    else:
        assert nccl.status == "pass", nccl.summary
        assert nccl.metrics["backend"] == "nccl"
