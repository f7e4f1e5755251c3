"""The suite's own rules (tests/conftest.py), run on a small suite by pytest in a subprocess
(pytester; in-process, pytester's module snapshot would unload and re-import Triton, which aborts): an
unmarked test over the per-test budget fails with one line saying to mark it, a marked one passes;
a test that starts a Python process fails unless it is marked integration; `--durations-file`
writes the slowest phases, the wall time and the time per tier."""

from pathlib import Path

import pytest

CONFTEST = Path(__file__).with_name("conftest.py")

SMALL_SUITE = """
import subprocess
import sys
import time
import pytest

def test_quick():
    pass

def test_over_the_budget():
    start = time.process_time()
    while time.process_time() - start < 0.4:  # CPU, not sleep: the budget counts CPU seconds
        pass

def test_waits_without_cpu():
    time.sleep(0.4)

@pytest.mark.slow
def test_marked_slow():
    time.sleep(0.6)

@pytest.mark.integration
def test_marked_integration():
    time.sleep(0.6)
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_starts_python():
    subprocess.run([sys.executable, "-c", "pass"], check=True)
"""


@pytest.mark.integration
def test_the_budget_and_the_kind_check_fail_unmarked_tests_and_the_durations_file_records_them(pytester, monkeypatch):
    monkeypatch.setenv("DSA_TEST_BUDGET_S", "0.2")
    # laid out as the repository is: tests/conftest.py, testpaths, the durations file already there
    (pytester.path / "tests").mkdir()
    (pytester.path / "tests" / "conftest.py").write_text(CONFTEST.read_text())
    (pytester.path / "tests" / "test_small.py").write_text(SMALL_SUITE)
    pytester.makeini("[pytest]\ntestpaths = tests\nmarkers =\n    slow: slow\n    integration: integration\n"
                     "    gpu: gpu\n    long: long\n")
    (pytester.path / "out").mkdir()
    (pytester.path / "out" / "durations.txt").write_text("the last run's\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--durations-file=out/durations.txt")
    result.assert_outcomes(passed=4, failed=2)
    result.stdout.fnmatch_lines(["*test_over_the_budget: 0.* s of CPU (* s wall), over the 0.2 s budget of an "
                                 "unmarked test*"
                                 "mark it @pytest.mark.integration if it starts a process*"])
    result.stdout.fnmatch_lines(["*test_starts_python started a process (*python* -c pass): mark it "
                                 "@pytest.mark.integration*"])
    text = (pytester.path / "out" / "durations.txt").read_text()
    assert "4 passed, 2 failed" in text and "session wall time" in text
    # "    0.60s     0.00s call     test_small.py::test_marked_slow  [slow]": wall, CPU
    phases = {}
    for line in text.split("slowest 25 phases (wall, CPU):\n")[1].splitlines():
        wall, cpu, when, nodeid, tier = line.split()
        phases[nodeid.split("::")[1], when] = float(wall.rstrip("s")), float(cpu.rstrip("s")), tier
    assert len(phases) == 18  # setup, call, teardown of 6 tests
    for name, tier in [("test_over_the_budget", "[unit]"), ("test_marked_slow", "[slow]"),
                       ("test_marked_integration", "[integration]"), ("test_waits_without_cpu", "[unit]")]:
        wall, cpu, recorded_tier = phases[name, "call"]
        assert wall >= 0.4 and recorded_tier == tier, (name, phases[name, "call"])
    assert phases["test_over_the_budget", "call"][1] >= 0.4  # CPU
    assert phases["test_waits_without_cpu", "call"][1] < 0.2  # waited: passed under the budget
    assert phases["test_quick", "call"][2] == "[unit]"
