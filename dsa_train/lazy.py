"""Lazy re-exports (PEP 562) for a package's `__init__`: a name is imported from its module on first
use, so importing the package loads nothing heavy (tests/test_structure.py checks which modules a
light import loads). Imports only the standard library."""

from __future__ import annotations

import importlib
import sys
from typing import Callable


def lazy_exports(package: str, exports: dict[str, str], public: list[str]) -> tuple[Callable, Callable]:
    """`__getattr__` and `__dir__` for `package`, whose public name `n` lives in module `exports[n]`;
    `public` is the package's `__all__`. A name is bound in the package on first use, so later
    lookups skip `__getattr__`."""

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *public})

    return __getattr__, __dir__
