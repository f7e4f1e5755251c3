"""The built wheel holds the whole source tree: every file under dsa_train/, kernels/ (as
dsa_kernels/) and recipes/ (as dsa_train/recipes/), so no installed dsa-train can lack a module that
the editable install used by the rest of the suite has (the wheel once lacked dsa_train.eval, which
the trainer imports)."""

from __future__ import annotations

import pytest

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# source directory -> where its files land in the wheel
ROOTS = {"dsa_train": "dsa_train", "kernels": "dsa_kernels", "recipes": "dsa_train/recipes"}


def _source_files() -> set[str]:
    expected = set()
    for src, dst in ROOTS.items():
        for path in (REPO / src).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                expected.add(f"{dst}/{path.relative_to(REPO / src).as_posix()}")
    return expected


@pytest.mark.integration
def test_wheel_holds_every_source_file(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                           "--wheel-dir", str(tmp_path), str(REPO)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = tmp_path.glob("dsa_train-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        shipped = {n for n in zf.namelist() if ".dist-info/" not in n}
    expected = _source_files()
    missing = sorted(expected - shipped)
    assert not missing, f"{len(missing)} source files are not in the wheel, e.g. {missing[:5]}"
    # and nothing but them (no build debris, no tests)
    extra = sorted(shipped - expected)
    assert not extra, f"the wheel carries files that are not in the source tree: {extra[:5]}"
    for module in ("dsa_train/eval/in_training.py", "dsa_kernels/ops/sparse_mla/__init__.py",
                   "dsa_train/recipes/small_32k.yaml"):
        assert module in shipped
