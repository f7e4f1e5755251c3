"""Triton 3.6's interpreter under the numpy this project installs (>= 2.4): a kernel with a loop
over a runtime bound fails there without `interpreter_compat` ("only 0-dimensional arrays can be
converted to Python scalars", in every kernel check of `gpu-check --device cpu --small`), and runs
with it. Triton 3.6 comes from the compile gate's side install (dsa_kernels/compile_report.py)."""

from __future__ import annotations

import pytest

import os
import subprocess
import sys

import numpy

from dsa_kernels.compile_report import ensure_side_triton

SCRIPT = r"""
import sys
import torch, triton, triton.language as tl
from dsa_kernels._triton_common import Launch, interpreter_compat

assert triton.__version__.startswith("3.6"), triton.__version__

@triton.jit
def add_n(X, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    for _ in range(0, n):  # a runtime bound: the interpreter calls tensor.__index__
        tl.store(X + offs, tl.load(X + offs) + 1.0)

x = torch.zeros(16)
if sys.argv[1] == "raw":
    try:
        add_n[(1,)](x, 3, BLOCK=16)
        print("RAW OK")
    except Exception as err:
        print("RAW FAILED", type(err).__name__, err)
else:
    Launch(add_n, (1,), {"X": x, "n": 3, "BLOCK": 16}).run()
    assert interpreter_compat() is True
    assert torch.equal(x, torch.full((16,), 3.0)), x
    print("COMPAT OK")
"""


def _run(mode: str) -> str:
    side = ensure_side_triton("3.6.0")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(side), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, mode], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.integration
def test_triton36_interpreter_runs_runtime_loops_under_this_numpy():
    out = _run("compat")
    assert "COMPAT OK" in out
    if tuple(int(p) for p in numpy.__version__.split(".")[:2]) >= (2, 4):
        # the failure the shim exists for is still there without it (else the shim can go)
        assert "RAW FAILED" in _run("raw")
