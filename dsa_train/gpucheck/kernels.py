"""The kernel checks of `dsa-train gpu-check`, in section order: environment and compile gate
(`environment.py`), correctness against the references (`correctness.py`), speed (`speed.py`)."""

from __future__ import annotations

from . import correctness, environment, speed
from .core import Check, Options


def checks(opts: Options) -> list[Check]:
    return environment.checks(opts) + correctness.checks(opts) + speed.checks(opts)
