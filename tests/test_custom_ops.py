"""The kernel custom ops (`dsa_kernels.custom_ops`) and the CUDA-path memory trace, checked by the
cases in tests/custom_ops_cases.py, run in a fresh pytest process.

Why a process of their own: in this suite's process, after some unrelated earlier tests (for
example tests/test_checkpoint_errors.py), entering the custom ops with fake tensors crashed in
torch's dispatcher (`ValueError: vector::reserve`, or SIGSEGV, inside `OpOverload.__call__`),
while the same cases pass in a fresh process every time (torch 2.13, CPU; not root-caused). A
crash there would take the whole suite down with it; here it fails one test. `dsa-train plan
--trace` traces in a process of its own (tests/test_parallel_trace.py runs it that way)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

CASES = Path(__file__).with_name("custom_ops_cases.py")


@pytest.mark.integration
def test_custom_op_cases_pass_in_a_fresh_process():
    env = {**os.environ, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)],
                         cwd=CASES.parents[1], env=env, capture_output=True, text=True, timeout=900)
    tail = out.stdout[-4000:] + out.stderr[-2000:]
    assert out.returncode == 0, tail
    summary = out.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, tail
    assert int(summary.split(" passed")[0].split()[-1]) >= 5, summary  # every case ran (parametrized ones included)
