"""The vocabulary of `dsa-train gpu-check`: options, checks and their outcomes.

A check is one named step of the GPU validation (an environment probe, one kernel's correctness
at one shape, one timing, the end-to-end run, ...). The runner (`runner.py`) runs them in
order; a check's failure is one line in the report and the others still run. Modules that
contribute checks expose `checks(opts: Options) -> list[Check]`; the same list backs the
command, its `--dry-run` listing, and `pytest -m gpu` (one implementation, two entry points).
Nothing here imports W&B, datasets, Hydra, DeepSpeed or megatron-core.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

SECTIONS = ("environment", "compile", "correctness", "speed", "end-to-end", "nccl")
STATUSES = ("pass", "fail", "skip", "info")


@dataclass
class Options:
    device: str = "cuda"  # "cuda" | "cpu" (cpu: the Triton interpreter; only meaningful with small)
    small: bool = False  # tiny shapes: the CPU run of the command itself (tests), not a validation
    out: Path = Path("gpu-check")  # report directory; checks may write files under it
    deadline: float = float("inf")  # time.monotonic() by which the whole command should end
    selected_sections: tuple = SECTIONS  # the sections this run executes (the runner sets it from --only)
    # check name -> (section, estimated seconds on a GPU) for the checks this run executes (budget.py)
    selected_needs: dict = field(default_factory=dict)

    def time_left(self) -> float:
        return self.deadline - time.monotonic()


@dataclass
class Outcome:
    status: str  # one of STATUSES; "skip" and "fail" say why in `summary`
    summary: str  # one line
    metrics: dict = field(default_factory=dict)  # numbers for the JSON / Markdown report

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"Outcome.status must be one of {STATUSES}, got {self.status!r}")


@dataclass
class Check:
    name: str  # dotted, unique: "correctness.sparse_mla.T32768"
    section: str  # one of SECTIONS
    shapes: str  # what it runs, one line, for --dry-run
    run: Callable[[Options], Outcome]

    def __post_init__(self):
        if self.section not in SECTIONS:
            raise ValueError(f"Check.section must be one of {SECTIONS}, got {self.section!r}")
