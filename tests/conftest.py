"""Suite-wide settings and the suite's tiers and time budget.

DSA_STRICT_DEVICES=1: every multi-rank run the suite launches (torchrun subprocesses inherit the
environment) checks that each collective's tensors are on the compute device, so a collective
that NCCL would reject on a GPU fails here on the CPU (`dsa_train.parallel.strict_devices`).
Set DSA_STRICT_DEVICES=0 in the environment to switch it off.

Tiers (markers registered in pyproject.toml): `integration` (the test starts a process -- torchrun
ranks, a spawned process group, Slurm daemons, an offline install, the CLI in a subprocess -- or runs
a whole trainer), `slow` (too costly for the unit tier, or multi-rank), `gpu`, `long`. `make
test-fast` runs the rest (the unit tier); `make test` runs everything but `gpu` and `long`.

The tiers are checked as the tests run, each failure one line saying what to do:
- the budget: an unmarked test whose call phase uses more than UNIT_TEST_BUDGET_S seconds of CPU
  (this process's threads and its children) fails. CPU time, not wall time: it grows far less with
  the machine's load (about 2x at load 5-8 on 2 cores, where wall time grew 6x) and a test that
  waits uses none. DSA_TEST_BUDGET_S overrides the budget; 0 turns the check off.
- the kind: a test not marked `integration` (nor `gpu` / `long`) that starts a process -- a Python
  interpreter, a shell, torchrun, dsa-train, pip, a Slurm daemon, W&B's service (PROCESS_NAMES), a multiprocessing
  child (a DataLoader worker included) -- or constructs the trainer (TRAINER_MODULE's `Trainer`) in
  its setup or call fails. Helper tools a library runs (ptxas, ldconfig, a compiler) do not count.

`--durations-file=PATH` (make test passes docs/test-durations.txt; write it with `=`: pytest reads
the command line before it loads this file, and `--durations-file PATH` with PATH an existing file
would take PATH for the tests to run): at the session's end, write
the slowest 25 test phases (wall time, as pytest's `--durations=25` ranks them, and CPU time), with
the session's wall time, the machine's load and the wall and CPU time per tier.
"""

import os

os.environ.setdefault("DSA_STRICT_DEVICES", "1")

import importlib.abc  # noqa: E402
import multiprocessing.process  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import resource  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

# CPU seconds of an unmarked test's call phase. Measured 2026-11-27 on the 2-core dev machine with
# `make test-fast`: the costliest unit test used 2.1 s of CPU at load 1.2, and 5.5 s at load 5-8
# (contention inflated the tier's CPU time about 2x and its wall time about 6x); the tests over
# ~3.5 s there are marked slow. 20 s leaves room for a loaded machine, a test that grows, and a
# machine with more cores, where torch's spinning worker threads add CPU time to the same work.
UNIT_TEST_BUDGET_S = 20.0
# marks that exempt a test from the budget (and from the unit tier)
TIER_MARKS = ("integration", "slow", "gpu", "long")
SLOWEST = 25

# what starts "a process" for the kind check: the basename of the command's first word
PROCESS_NAMES = re.compile(r"^(python[0-9.]*|pypy[0-9.]*|bash|sh|dash|zsh|torchrun|dsa-train|pip[0-9.]*|"
                           r"srun|sbatch|salloc|slurmd|slurmctld|slurmdbd|munged|scontrol|squeue|wandb-core)$")
# the trainer: constructing its `Trainer` makes a test an integration test
TRAINER_MODULE = "dsa_train.trainer.trainer"

pytest_plugins = ["pytester"]  # tests/test_suite_tiers.py runs this file's hooks on a small suite


@pytest.fixture(autouse=True)
def _restore_deterministic_mode():
    """A test that trains in-process with `deterministic: true` switches on
    torch.use_deterministic_algorithms for the whole process (dsa_train/trainer/rng.py); restore the
    mode after every test so that later tests see the default (one did: the sparse-MLA backward
    then took its deterministic path). Torch is not imported here: before its first import the mode
    is the default."""
    torch = sys.modules.get("torch")
    enabled, warn_only = ((torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
                          if torch is not None else (False, False))
    yield
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


@pytest.fixture(autouse=True)
def _restore_root_logging():
    """A command run in-process (`dsa-train checkpoint ...`, Hydra's job logging) installs root
    handlers on the sys.stdout/sys.stderr of that moment: under capsys a stream closed when its
    test ends, so a later test's warning printed "--- Logging error ---" with a traceback into the
    stderr it checks. Put the root logger back as it was after every test."""
    import logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in root.handlers:
        if handler not in handlers:
            root.removeHandler(handler)
    for handler in handlers:
        if handler not in root.handlers:
            root.addHandler(handler)
    root.setLevel(level)


# ------------------------------------------------------------------------------ tiers and budget
def pytest_addoption(parser):
    parser.addoption("--durations-file", default=None, metavar="PATH",
                     help="write the slowest 25 test phases, the wall time and the time per tier to PATH at the "
                          "session's end (make test: docs/test-durations.txt)")


def budget_s() -> float:
    return float(os.environ.get("DSA_TEST_BUDGET_S", UNIT_TEST_BUDGET_S))


def tier(item) -> str:
    """The first of TIER_MARKS the test carries, else "unit"."""
    return next((mark for mark in TIER_MARKS if item.get_closest_marker(mark)), "unit")


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                              text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def cpu_seconds() -> float:
    """CPU time of this process (every thread) and of its finished children."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


class Timings:
    def __init__(self):
        self.start = time.time()
        self.load_start = os.getloadavg()
        self.commit = git_commit()  # what is tested: the commit at the start
        self.tiers = {}  # nodeid -> tier
        self.cpu = {}  # (nodeid, phase) -> CPU seconds


TIMINGS_KEY = pytest.StashKey[Timings]()


# ------------------------------------------------------------------------------ what a test starts
class Starts:
    """The processes and trainers the running test started (recorded between its setup and the end
    of its call; `None` while no test is being watched)."""

    seen: list[str] | None = None

    @classmethod
    def note(cls, what: str) -> None:
        if cls.seen is not None and what not in cls.seen:
            cls.seen.append(what)


def _watch_processes() -> None:
    execute_child = subprocess.Popen._execute_child

    def _execute_child(self, args, *rest, **kwargs):
        argv = [args] if isinstance(args, (str, bytes)) else list(args)
        first = os.fsdecode(argv[0]) if argv else ""
        name = os.path.basename(first.split()[0] if first.strip() else first)
        if PROCESS_NAMES.match(name):
            Starts.note(f"a process ({' '.join(os.fsdecode(a) for a in argv[:4])[:80]})")
        return execute_child(self, args, *rest, **kwargs)

    subprocess.Popen._execute_child = _execute_child
    start = multiprocessing.process.BaseProcess.start

    def _start(self):
        Starts.note(f"a multiprocessing process ({self.name})")
        return start(self)

    multiprocessing.process.BaseProcess.start = _start


def _watch_trainer(module) -> None:
    trainer = getattr(module, "Trainer", None)
    if trainer is None or getattr(trainer.__init__, "_watched", False):
        return
    init = trainer.__init__

    def __init__(self, *args, **kwargs):
        Starts.note(f"the trainer ({TRAINER_MODULE}.Trainer)")
        return init(self, *args, **kwargs)

    __init__._watched = True
    trainer.__init__ = __init__


class _TrainerImportWatch(importlib.abc.MetaPathFinder):
    """Watches the trainer's `Trainer` once its module is imported (whenever a test imports it)."""

    def find_spec(self, name, path, target=None):
        if name != TRAINER_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                exec_module = spec.loader.exec_module

                def exec_and_watch(module, exec_module=exec_module):
                    exec_module(module)
                    _watch_trainer(module)

                spec.loader.exec_module = exec_and_watch
                return spec
            if spec is not None:
                return spec
        return None


def pytest_configure(config):
    config.stash[TIMINGS_KEY] = Timings()
    _watch_processes()
    if TRAINER_MODULE in sys.modules:
        _watch_trainer(sys.modules[TRAINER_MODULE])
    else:
        sys.meta_path.insert(0, _TrainerImportWatch())


def watched(item) -> bool:
    """Starting a process or a trainer is this test's business: it is marked integration (gpu and
    long tests run on their own machines)."""
    return not any(item.get_closest_marker(mark) for mark in ("integration", "gpu", "long"))


def _timed(item, phase):
    cpu = item.config.stash[TIMINGS_KEY].cpu
    start = cpu_seconds()
    yield
    cpu[item.nodeid, phase] = cpu_seconds() - start


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    Starts.seen = [] if watched(item) else None
    yield from _timed(item, "setup")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _timed(item, "call")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    yield from _timed(item, "teardown")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    timings = item.config.stash[TIMINGS_KEY]
    item_tier = tier(item)
    timings.tiers[item.nodeid] = item_tier
    if call.when != "call":
        return
    started, Starts.seen = Starts.seen or [], None
    budget = budget_s()
    cpu = timings.cpu.get((item.nodeid, "call"), 0.0)
    if report.passed and started:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} started {started[0]}"
                           f"{f' and {len(started) - 1} more' if len(started) > 1 else ''}: mark it "
                           f"@pytest.mark.integration (tests/conftest.py), or test the same thing in this process")
    elif report.passed and item_tier == "unit" and budget > 0 and cpu > budget:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid}: {cpu:.1f} s of CPU ({report.duration:.1f} s wall), over the {budget:g} s "
                           f"budget of an unmarked test (tests/conftest.py): mark it @pytest.mark.integration if it "
                           f"starts a process or a trainer, else @pytest.mark.slow, or make it faster")


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    path = config.getoption("durations_file")
    if not path:
        return
    timings = config.stash[TIMINGS_KEY]
    phases, tiers, tier_cpu, counts = [], {}, {}, {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) not in ("setup", "call", "teardown") or not hasattr(report, "duration"):
                continue
            cpu = timings.cpu.get((report.nodeid, report.when), 0.0)
            phases.append((report.duration, cpu, report.when, report.nodeid))
            item_tier = timings.tiers.get(report.nodeid, "unit")
            tiers[item_tier] = tiers.get(item_tier, 0.0) + report.duration
            tier_cpu[item_tier] = tier_cpu.get(item_tier, 0.0) + cpu
            if report.when == "call" or (report.when == "setup" and not report.passed):
                counts[item_tier] = counts.get(item_tier, 0) + 1
    phases.sort(reverse=True)
    costliest = max(((cpu, nodeid) for _, cpu, when, nodeid in phases
                     if when == "call" and timings.tiers.get(nodeid) == "unit"), default=None)
    wall = time.time() - timings.start
    load_end = os.getloadavg()
    summary = ", ".join(f"{len(terminalreporter.stats[outcome])} {outcome}" for outcome in
                        ("passed", "failed", "error", "skipped", "xfailed", "xpassed") if terminalreporter.stats.get(outcome))
    lines = [
        "# Written by pytest --durations-file (tests/conftest.py); `make test` rewrites it on every run.",
        f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(timings.start))}, commit {timings.commit}, "
        f"{os.cpu_count()} CPU cores ({platform.machine()}), load average {timings.load_start[0]:.1f} at the start, "
        f"{load_end[0]:.1f} at the end (1-minute)",
        f"# command: pytest {' '.join(config.invocation_params.args)}",
        f"# {summary}; exit status {int(exitstatus)}",
        f"# session wall time: {wall / 60:.1f} min ({wall:.0f} s)",
        f"# session CPU time: {cpu_seconds() / 60:.1f} min (pytest and the processes it started)",
        "# time per tier (setup + call + teardown of its tests; unit = `make test-fast`; CPU: pytest's",
        "# threads and the processes the tests started):",
        *[f"#   {name:<12} {counts.get(name, 0):4d} tests {seconds / 60:7.1f} min wall {tier_cpu[name] / 60:7.1f} min CPU"
          for name, seconds in sorted(tiers.items(), key=lambda kv: -kv[1])],
        f"# unmarked-test budget: {budget_s():g} s of CPU per call phase (tests/conftest.py); the costliest "
        f"unmarked call phase: " + (f"{costliest[0]:.1f} s of CPU ({costliest[1]})" if costliest else "none"),
        "",
        f"slowest {SLOWEST} phases (wall, CPU):",
        *[f"{seconds:8.2f}s {cpu:8.2f}s {when:<8} {nodeid}  [{timings.tiers.get(nodeid, 'unit')}]"
          for seconds, cpu, when, nodeid in phases[:SLOWEST]],
    ]
    out = Path(path)
    if not out.is_absolute():
        out = config.rootpath / out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    terminalreporter.write_line(f"test durations written to {out}")
