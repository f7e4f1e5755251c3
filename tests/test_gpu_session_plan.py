"""The GPU session's prepared plan (scripts/gpu-next.txt) and `gpu_session.py run --plan`: every step
is checked before the install, so a typo in the plan costs no device time, and every gpu-check
prefix the plan names matches a check (the plan cannot rot when checks are renamed)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("gpu_session_plan_under_test", REPO / "scripts" / "gpu_session.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_next_sessions_plan_names_real_checks_and_benchmarks():
    from dsa_train.gpucheck.core import Options
    from dsa_train.gpucheck.runner import collect

    gs = _script()
    steps = gs.read_plan(REPO / "scripts" / "gpu-next.txt")
    names = [c.name for c in collect(Options(device="cuda", small=False, out=None))]
    checks = [s for s in steps if s.startswith("check:")]
    assert checks and any(s.startswith("bench:") for s in steps)
    for step in checks:
        for prefix in step.partition("=")[0][len("check:"):].split(","):
            assert any(n.startswith(prefix) for n in names), f"{step}: {prefix!r} matches no gpu-check check"
    # the time boxes of the first call fit one device call (10 minutes) with the install and the tail
    boxes = [float(s.partition("=")[2]) for s in steps if not s.startswith("env:")]
    assert sum(boxes[:4]) + gs.INSTALL_SECONDS <= 600


@pytest.mark.parametrize("text, problem", [
    ("chek:speed\n", "unknown step"),
    ("check:\n", "needs its argument"),
    ("bench:no_such_benchmark.py=30\n", "no benchmarks/no_such_benchmark.py"),
    ("speed=soon\n", "seconds > 0"),
    ("env:DSA_X\n", "env:NAME=VALUE"),
    ("pytest:\n", "needs its argument"),
    ("pytest:test_host_values.py,no_such_test.py=60\n", "no tests/no_such_test.py"),
    ("# only a comment\n\n", "no steps"),
])
def test_a_bad_plan_is_one_line_before_anything_runs(tmp_path, capsys, text, problem):
    gs = _script()
    plan = tmp_path / "plan.txt"
    plan.write_text(text)
    kit = tmp_path / "kit"
    kit.mkdir()
    (kit / "image-constraints.txt").write_text("")
    out = tmp_path / "out"
    assert gs.main(["run", "--kit", str(kit), "--out", str(out), "--plan", str(plan)]) == 2
    err = capsys.readouterr().err.strip()
    assert problem in err and "\n" not in err
    assert not out.exists() or not any(out.iterdir())  # nothing ran, nothing written


def test_plan_and_step_together_are_refused(tmp_path):
    gs = _script()
    with pytest.raises(SystemExit):
        gs.main(["run", "--out", str(tmp_path), "--plan", "x", "--step", "speed"])


@pytest.mark.integration
def test_a_pytest_step_runs_the_gpu_tests_of_its_files_from_outside_the_tree(tmp_path):
    """`pytest:FILES`: the files' `gpu` tests only (here, without CUDA, collected and skipped), run
    from the session's work folder with `python -P` and importlib imports (the installed package
    under test), JUnit XML kept among the reports."""
    import sys
    import xml.etree.ElementTree as ET

    gs = _script()
    session = gs.Session(tmp_path / "out", 300, sys.executable, True, "cpu")
    session.step("pytest:test_host_values.py,test_kernels_topk_repair.py=120")
    row = session.rows[-1]
    assert row["status"] == "ok", (row, (tmp_path / "out" / "session.log").read_text()[-2000:])
    assert " -P -m pytest -m gpu " in row["command"] and "--import-mode=importlib" in row["command"]
    name, xml = session.reports[-1]
    cases = {c.get("name"): [x.tag for x in c] for c in ET.parse(xml).getroot().iter("testcase")}
    assert cases == {"test_on_cuda_the_next_layer_makes_no_host_sync": ["skipped"],
                     "test_repair_path_has_no_host_sync": ["skipped"]}, cases
    session.log.close()
