"""`dsa-train gpu-check`: the command itself on the CPU (dry run, the --small run under the Triton
interpreter, failures as one line, no GPU -> exit 2, no heavy imports), and on a GPU the very
same checks as tests (`pytest -m gpu`: one implementation, two entry points)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from dsa_train.gpucheck import runner
from dsa_train.gpucheck.core import SECTIONS, Check, Options, Outcome
from dsa_train.gpucheck.correctness import compare
from dsa_train.gpucheck.inputs import DIMS_SMALL, doc_lengths, doc_start_of, topk_lists

KERNEL_SECTIONS = ["environment", "compile", "correctness", "speed"]
CORRECTNESS_OPS = ["sparse_mla", "index_scores_bf16", "index_scores_fp8", "indexer_topk", "sparse_indexer_kl",
                   "dense_indexer_kl", "dense_attention"]


def _gpu_checks():
    try:
        return runner.collect(Options(device="cuda"))
    except Exception as err:  # collection must not hide a broken check list: one failing param
        return [Check("collect", "environment", "", lambda o, e=err: Outcome("fail", f"collect: {e}"))]


# ----------------------------------------------------------------------------- GPU: the checks as tests
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run dsa-train gpu-check there")
@pytest.mark.parametrize("check", _gpu_checks(), ids=lambda c: c.name)
def test_gpu_check(check, tmp_path):
    outcome = check.run(Options(device="cuda", out=tmp_path))
    if outcome.status == "skip":
        pytest.skip(outcome.summary)
    assert outcome.status in ("pass", "info"), f"{check.name}: {outcome.summary}"


# ----------------------------------------------------------------------------- CPU: the command
def test_dry_run_lists_every_check_with_shapes(capsys):
    assert runner.main(["--dry-run"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    rows = [ln.split(None, 2) for ln in lines[:-1]]
    assert "nothing was run" in lines[-1]
    sections = [r[0] for r in rows]
    assert sections == sorted(sections, key=SECTIONS.index)  # in section order
    assert set(SECTIONS) <= set(sections), set(SECTIONS) - set(sections)
    names = [r[1] for r in rows]
    assert len(names) == len(set(names))
    assert all(len(r) == 3 and r[2].strip() for r in rows)  # every check has its shapes
    for op in CORRECTNESS_OPS:
        for T in (4096, 32768, 131072):
            assert f"correctness.{op}.T{T}" in names, (op, T)
    for op in ("sparse_mla", "indexer_topk", "sparse_indexer_kl"):
        assert f"correctness.{op}.cp.T131072" in names
    shapes = {r[1]: r[2] for r in rows}
    assert "H=128 D=576 D_V=512 k=2048" in shapes["correctness.sparse_mla.T131072"]
    assert "H_I=64 d_I=128" in shapes["correctness.indexer_topk.T4096"]
    assert {n.split(".")[1] for n in names if n.startswith("speed.")} >= {
        "sparse_mla", "indexer_topk", "sparse_indexer_kl", "dense_indexer_kl", "dense_attention"}


def test_cuda_without_a_gpu_is_one_line_and_exit_2(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(runner, "_cuda_available", lambda: False)
    assert runner.main(["--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--device cpu --small" in err and "--dry-run" in err
    assert not (tmp_path / "r").exists()


def test_cpu_needs_small_and_unknown_only_is_refused(capsys):
    assert runner.main(["--device", "cpu"]) == 2
    assert "--small" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="matches no check"):
        runner.main(["--dry-run", "--only", "bogus"])


def test_failing_check_is_one_line_and_the_rest_still_run(monkeypatch, tmp_path):
    import dsa_train.gpucheck.environment as env

    def broken(opts):
        raise RuntimeError("simulated failure\nsecond line of the message")

    monkeypatch.setattr(env, "_versions_check", broken)
    opts = Options(device="cpu", small=True, out=tmp_path)
    checks = runner.select(runner.collect(opts), ["environment.machine", "environment.versions"])
    checks.append(Check("speed.after", "speed", "x", lambda o: Outcome("pass", "ran after the failure")))
    lines = []
    results = runner.run_checks(checks, opts, echo=lambda s, **_: lines.append(s))
    assert [r["status"] for r in results] == ["info", "fail", "pass"]
    assert len(lines) == 3 and all("\n" not in ln for ln in lines)
    assert "fail" in lines[1] and "RuntimeError: simulated failure" in lines[1] and "second line" not in lines[1]
    report = runner.write_reports(results, opts, "test", 0.0, 1.0)
    assert report["exit_code"] == 1
    data = json.loads((tmp_path / "report.json").read_text())
    assert any("broken" in ln for ln in data["checks"][1]["traceback"])
    assert "| environment.versions | fail |" in (tmp_path / "report.md").read_text()


def test_deadline_skips_what_no_longer_fits(tmp_path):
    opts = Options(device="cpu", small=True, out=tmp_path, deadline=0.0)  # already past
    res = runner.run_checks([Check("speed.x", "speed", "x", lambda o: Outcome("pass", "ran"))], opts,
                            echo=lambda *a, **k: None)
    assert res[0]["status"] == "skip" and "budget" in res[0]["summary"]


def test_compare_catches_errors_and_nonfinite_mismatches():
    ref = torch.randn(64, 8)
    assert compare(ref.bfloat16(), ref, 2.0**-6)["ok"]
    bad = ref.clone()
    bad[3, 4] += 0.1 * ref.abs().max()
    assert not compare(bad, ref, 2.0**-6)["ok"]
    ref[0] = float("-inf")  # an empty row's lse
    assert compare(ref.clone(), ref, 1e-6)["ok"]
    got = ref.clone()
    got[0, 0] = 0.0
    assert not compare(got, ref, 1e-6)["ok"]
    got = ref.clone()
    got[5, 5] = float("nan")
    assert not compare(got, ref, 1e-6)["ok"]


def test_compare_in_chunks_equals_compare_whole():
    """`compare` streams in chunks (no full-size copies at T = 128K): any chunk size gives the
    whole-tensor figures, and an error or a non-finite mismatch in a late chunk is still caught."""
    ref = torch.randn(37, 11)
    ref[2] = float("-inf")
    got = (ref + 0.01 * torch.randn_like(ref)).bfloat16()
    got[2] = float("-inf")
    whole = compare(got, ref, 2.0**-5, chunk=ref.numel())
    finite = torch.isfinite(ref)
    g, r = got.float()[finite], ref[finite]
    assert whole["err"] == pytest.approx(float((g - r).abs().max() / r.abs().max()), rel=1e-6)
    assert whole["rel_l2"] == pytest.approx(float((g.double() - r.double()).norm() / r.double().norm()), rel=1e-9)
    for chunk in (1, 7, 100):
        part = compare(got, ref, 2.0**-5, chunk=chunk)
        assert part["ok"] == whole["ok"]
        for key in ("err", "rel_l2", "scale"):
            assert part[key] == pytest.approx(whole[key], rel=1e-9), (chunk, key)
    late = got.clone()
    late[-1, -1] = 5.0  # past the first chunks
    assert not compare(late, ref, 2.0**-5, chunk=16)["ok"]
    late = got.clone()
    late[2, 10] = 0.0  # a non-finite reference entry not matched, in the third chunk
    assert compare(late, ref, 2.0**-5, chunk=16).get("note") == "non-finite entries differ"


def test_topk_lists_are_what_the_indexer_returns():
    T, K = 96, DIMS_SMALL.K
    ds = doc_start_of(doc_lengths(T), "cpu")
    pos = torch.arange(T)
    idx = topk_lists(ds, pos, K, seed=3, empty_rows=(7,))[0]
    assert idx.shape == (T, K) and idx.dtype == torch.int32
    for t in range(T):
        row = idx[t]
        valid = row[row >= 0]
        n = 0 if t == 7 else min(K, t - int(ds[0, t]) + 1)
        assert valid.numel() == n and bool((row[:n] >= 0).all())  # -1 only as the tail
        assert valid.unique().numel() == n  # distinct keys
        if n:
            assert int(valid.min()) >= int(ds[0, t]) and int(valid.max()) <= t


@pytest.mark.slow  # 37 s on an idle 2-core machine (the interpreter), ~100 s under heavy load
@pytest.mark.integration
def test_cpu_small_run_writes_both_reports_and_every_kernel_check_passes(tmp_path):
    """The command end to end on the CPU: tiny shapes, Triton interpreter, kernel sections (the
    end-to-end and NCCL sections are tests/test_gpu_check_e2e.py's)."""
    out = tmp_path / "report"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "DSA_KERNELS")}
    proc = subprocess.run([sys.executable, "-m", "dsa_train.gpucheck.runner", "--device", "cpu", "--small",
                           "--out", str(out), "--only", *KERNEL_SECTIONS],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    md = (out / "report.md").read_text()
    checks = report["checks"]
    assert {c["section"] for c in checks} == set(KERNEL_SECTIONS)
    corr = [c for c in checks if c["section"] == "correctness"]
    # + the 3 CP checks, the warm-up's 2 attention checks, the dense KL at CP offsets and the kernel
    # custom ops' fakes (issue 32)
    assert len(corr) == len(CORRECTNESS_OPS) * len(DIMS_SMALL.seq_lens) + 7
    assert "correctness.custom_op_fakes" in {c["name"] for c in corr}
    assert all(c["status"] == "pass" for c in corr), [(c["name"], c["summary"]) for c in corr if c["status"] != "pass"]
    for c in corr:  # each compared output within its tolerance, and not trivially (errors were measured)
        for name, o in c["metrics"].get("outputs", {}).items():
            assert o["ok"] and o["err"] <= o["tol"], (c["name"], name)
    speed = [c for c in checks if c["section"] == "speed"]
    assert speed and all(c["status"] == "info" and "not a speed" in c["summary"] for c in speed)
    assert not any("tflops" in t for c in speed for t in c["metrics"]["timings"])
    assert report["exit_code"] == 0 and report["machine"]["name"] in md
    assert "## Correctness" in md and "## Speed" in md and "interpreter" in md.lower()
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("[")]
    assert len(lines) == len(checks)  # one progress line per check


BLOCKER = textwrap.dedent("""
    import importlib.abc, sys
    BLOCKED = ("wandb", "datasets", "hydra", "deepspeed", "megatron")
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"blocked for the test: {name}")
            return None
    sys.meta_path.insert(0, Block())
    from dsa_train.cli import main
    code = main(["gpu-check", "--dry-run"])
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    print("HEAVY", heavy)
    raise SystemExit(code)
""")


@pytest.mark.integration
def test_command_imports_nothing_heavy():
    """The cluster image may lack W&B, datasets, Hydra, DeepSpeed and megatron-core: the command's
    modules import none of them (the checks that need DeepSpeed import it when they run)."""
    proc = subprocess.run([sys.executable, "-c", BLOCKER], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "HEAVY []" in proc.stdout and "correctness.sparse_mla.T4096" in proc.stdout


def _select_needs(opts, only):
    """What the runner records for `--only ONLY`: each selected check's section and seconds."""
    from dsa_train.gpucheck.budget import check_need_s
    from dsa_train.gpucheck.runner import collect, select

    checks = select(collect(opts), only)
    opts.selected_sections = tuple(sorted({c.section for c in checks}))
    opts.selected_needs = {c.name: (c.section, check_need_s(c)) for c in checks}
    return checks


def test_kernel_checks_leave_time_for_the_later_checks():
    import time

    from dsa_train.gpucheck.budget import skip_reason

    opts = Options(device="cuda", deadline=time.monotonic() + 200)
    _select_needs(opts, ["correctness", "speed", "end-to-end"])
    assert "kept for the later sections" in skip_reason(opts, "correctness", 10)  # speed + e2e > 190 s
    _select_needs(opts, ["correctness"])  # --only correctness: nothing to keep time for
    assert skip_reason(opts, "correctness", 10) is None
    assert "needs ~300 s" in skip_reason(opts, "correctness", 300)
    assert skip_reason(Options(device="cpu", small=True, deadline=time.monotonic() + 1), "speed", 300) is None


def test_time_is_kept_per_selected_check_not_per_section(monkeypatch):
    """`--only correctness.X speed.Y` keeps back speed.Y's estimate, not the whole speed section's
    (which once made a small budget skip the correctness check that was asked for)."""
    import time

    from dsa_train.gpucheck.budget import check_need_s, reserve_after, skip_reason

    opts = Options(device="cuda", deadline=time.monotonic() + 120)
    checks = _select_needs(opts, ["correctness.sparse_mla.T4096", "speed.indexer_topk"])
    (topk,) = [c for c in checks if c.name == "speed.indexer_topk"]
    assert reserve_after(opts, "correctness") == check_need_s(topk) > 0
    assert skip_reason(opts, "correctness", 30) is None
    _select_needs(opts, ["correctness.sparse_mla.T4096", "speed"])
    everything = sum(need for sec, need in opts.selected_needs.values() if sec == "speed")
    assert reserve_after(opts, "correctness") == everything > check_need_s(topk)


def test_no_time_is_kept_for_training_runs_that_cannot_start(monkeypatch):
    """Without the trainer's packages (an image checked with the core wheelhouse) the end-to-end
    and NCCL checks fail in one line at once: the kernel checks keep no time for them."""
    import time

    from dsa_train.gpucheck import e2e
    from dsa_train.gpucheck.budget import reserve_after

    opts = Options(device="cuda", deadline=time.monotonic() + 600)
    _select_needs(opts, ["correctness", "speed", "end-to-end"])
    speed = sum(need for sec, need in opts.selected_needs.values() if sec == "speed")
    training = sum(need for sec, need in opts.selected_needs.values() if sec == "end-to-end")
    assert training == e2e.run_grouped_experts.need_s + e2e.run_train_kill_resume.need_s + e2e.run_throughput.need_s
    monkeypatch.setattr(e2e, "missing_packages", lambda: [])
    assert reserve_after(opts, "correctness") == speed + training
    monkeypatch.setattr(e2e, "missing_packages", lambda: ["deepspeed"])
    assert reserve_after(opts, "correctness") == speed
    assert reserve_after(opts, "speed") == 0.0


def test_sparse_mla_at_128k_runs_at_the_largest_t_the_gpu_holds(monkeypatch):
    from dsa_train.gpucheck.correctness import largest_fitting_T
    from dsa_train.gpucheck.inputs import DIMS_671B

    opts = Options(device="cuda")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (60 * 2**30, 80 * 2**30))  # an H100 after start-up
    T, note = largest_fitting_T(131072, DIMS_671B, opts)
    assert 65536 < T < 131072 and T % 8192 == 0 and "largest that fits" in note
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (135 * 2**30, 141 * 2**30))  # an H200
    assert largest_fitting_T(131072, DIMS_671B, opts) == (131072, "")


def test_unwritable_out_is_one_line_before_any_check(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # as the re-run process has it: no re-run here
    monkeypatch.setenv("DSA_KERNELS", "triton")
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setattr(runner, "collect", lambda opts: pytest.fail("checks collected before the --out check"))
    assert runner.main(["--device", "cpu", "--small", "--out", str(blocker / "sub")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--out" in err


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward scales the gradient (a kernel with a wrong backward)."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


def test_correctness_checks_fail_on_a_wrong_kernel(monkeypatch):
    """The checks can fail: a sparse MLA whose dkv is 10% off, and a top-k with one wrong slot."""
    import dsa_kernels as K
    from dsa_train.gpucheck import correctness

    opts = Options(device="cpu", small=True)

    def wrong_backward(q, kv, idx, scale, d_v):
        return K.sparse_mla_ref(q, _ScaleGrad.apply(kv, 1.1), idx, scale, d_v)

    monkeypatch.setattr(K, "sparse_mla", wrong_backward)
    out = correctness.sparse_mla_check(64)(opts)
    assert out.status == "fail" and out.summary.startswith("FAILED dkv:"), out.summary
    assert out.metrics["outputs"]["out"]["ok"] and out.metrics["outputs"]["dq"]["ok"]

    def one_wrong_slot(q, k, w, ds, topk, query_positions=None):
        idx, val = K.indexer_topk_ref(q, k, w, ds, topk)
        idx[0, 50, 3] = -1
        return idx, val

    monkeypatch.setattr(K, "indexer_topk", one_wrong_slot)
    out = correctness.topk_check(64)(opts)
    assert out.status == "fail" and out.metrics["grid"]["rows_index_mismatch"] == 1, out.summary
    assert out.metrics["random"]["rows_set_mismatch"] == 1


def test_topk_check_fails_on_a_wrong_composite_path(monkeypatch):
    """correctness.indexer_topk runs each select path forced: a composite path that breaks one tie
    the wrong way fails the check even when the entry point (the radix select here) is right."""
    from dsa_kernels.ops.indexer_topk import composite
    from dsa_train.gpucheck import correctness

    real = composite.topk_composite

    def one_swapped_tie(scores, topk, key_offset=0, **kw):
        idx, val = real(scores, topk, key_offset, **kw)
        if idx.shape[1] > 50:  # a whole chunk (not the fix-ties path's few redone rows)
            idx[0, 50, [0, 1]] = idx[0, 50, [1, 0]]  # row 50's first two slots exchanged
        return idx, val

    monkeypatch.setattr(composite, "topk_composite", one_swapped_tie)
    out = correctness.topk_check(64)(Options(device="cpu", small=True))
    assert out.status == "fail", out.summary
    paths = out.metrics["paths"]
    assert paths["grid"]["entry"]["rows_index_mismatch"] == 0
    assert paths["grid"]["composite"]["rows_index_mismatch"] == 1
    assert not paths["paths_equal_random"] and "composite" in out.summary


def test_speed_table_counts_tflops_and_anchors_as_on_a_gpu(tmp_path):
    """The GPU branch of the speed report, with made-up timings: TFLOPS from the FLOP count,
    baselines as time / ours, the anchors as ours / anchor, all in report.md."""
    from dsa_train.gpucheck.speed import ANCHORS, Table

    opts = Options(device="cuda", out=tmp_path)
    table = Table(opts, "fwd 2*pairs*H*(D+D_V)")
    table.add("fwd", "ours", 10.0, 4e12)  # 4e12 FLOPs in 10 ms = 400 TFLOPS
    table.add("fwd", "chunked PyTorch", 250.0, 4e12)
    table.baseline("broken baseline", lambda: 1 / 0, {})
    out = table.outcome("sparse_mla")
    rows = out.metrics["timings"]
    assert out.status == "pass" and rows[0]["tflops"] == 400.0 and rows[1]["time_over_ours"] == 25.0
    assert rows[2]["error"].startswith("ZeroDivisionError")
    anchors = {a["anchor"]: a["ours_over_anchor"] for a in out.metrics["anchors"]}
    assert len(anchors) == len(ANCHORS["sparse_mla.fwd"]) and anchors["FlashMLA sparse prefill fwd (H800)"] == 0.625
    result = {"name": "speed.sparse_mla", "section": "speed", "shapes": "", "status": out.status,
              "summary": out.summary, "metrics": out.metrics, "seconds": 1.0}
    runner.write_reports([result], opts, "test", 0.0, 1.0)
    md = (tmp_path / "report.md").read_text()
    assert "| fwd | ours | 10 | 400 |" in md and "| FlashMLA sparse prefill fwd (H800) | 640 | 0.62 |" in md
    assert "failed: ZeroDivisionError" in md


@pytest.mark.integration
def test_a_check_that_kills_the_process_leaves_the_report_of_the_checks_before(tmp_path):
    """A crashing kernel can take the process down (heap corruption, a segfault): the reports are
    rewritten after every check, so the ones before it are on disk, marked incomplete."""
    script = textwrap.dedent(f"""
        import os
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["DSA_KERNELS"] = "triton"
        import dsa_train.gpucheck.environment as env
        env._versions_check = lambda opts: os._exit(9)
        from dsa_train.gpucheck.runner import main
        main(["--device", "cpu", "--small", "--out", {str(tmp_path)!r}, "--only", "environment.machine",
              "environment.versions"])
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 9
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["complete"] is False and [c["name"] for c in report["checks"]] == ["environment.machine"]
    assert "INCOMPLETE" in (tmp_path / "report.md").read_text()


def test_emulated_bf16_roundings_stay_inside_the_sparse_mla_tolerances():
    from dsa_train.gpucheck.correctness import TOL
    from dsa_train.gpucheck.emulate import sparse_mla_errors

    errs = sparse_mla_errors(rows=4, H=16, D=64, D_V=48, K=64, T=256)
    assert 0 < errs["out"][0] < TOL["out"] / 2  # the roundings show, well inside the tolerance
    assert all(0 < errs[k][0] < TOL["grad"] / 4 for k in ("dq", "dkv")), errs
