"""The built wheel holds the whole source tree: every file under dsa_train/, dsa_kernels/ and recipes/ (as
dsa_train/recipes/), so no installed dsa-train can lack a module that
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
ROOTS = {"dsa_train": "dsa_train", "dsa_kernels": "dsa_kernels", "recipes": "dsa_train/recipes"}


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


@pytest.mark.integration
def test_a_probe_for_the_pypi_kernels_package_does_not_import_ours_twice():
    """From a clone (the repository root on sys.path, as `python -m` and pytest put it), transformers
    probes for the PyPI `kernels` package by importing `kernels`. While our ops lived in a root
    directory named `kernels/`, that probe imported them a second time under that name and
    re-registered every `dsa_kernels::` custom op over the first copy's, leaving the first copy's op
    handles dangling: the memory trace then failed at random (`vector::reserve`, `std::bad_alloc`,
    a missing schema, SIGSEGV). The directory is now named as the package imports."""
    code = (
        "import importlib.util, sys, torch\n"
        "import dsa_kernels.custom_ops\n"
        "import transformers.modeling_utils\n"
        "root = sys.argv[1]\n"
        "spec = importlib.util.find_spec('kernels')\n"
        "assert spec is None or not str(spec.origin).startswith(root), spec.origin\n"
        "twice = sorted(m for m, mod in list(sys.modules.items()) if str(getattr(mod, '__file__', '') or '')"
        ".startswith(root + '/dsa_kernels/') and not m.startswith('dsa_kernels'))\n"
        "assert not twice, twice\n"
        "print(torch.ops.dsa_kernels.sparse_mla_fwd.default._schema.name)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(REPO)], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "dsa_kernels::sparse_mla_fwd", out.stdout
