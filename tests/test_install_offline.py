"""The offline install of docs/install.md, end to end on the CPU.

An "image": a fresh venv that already has torch and Triton (this interpreter's own, hard-linked in
with their dependencies and pip, the way a cluster image ships them). Its parameters come from
`make_wheelhouse.py --probe` run with the image's Python. The connected phase builds the
wheelhouse with those flags the documented way (it reaches the package registry, as a user's
connected machine would). The offline phase runs the documented install on the image with every
package source but the wheelhouse cut off, then shows torch and Triton untouched (same versions,
the same files: inode, size and mtime of every file they record, and the hash of torch's
`__init__.py` and dist-info) and the installed package working.

The wheelhouse is the core one (`--extras ''`: what `dsa-train gpu-check` needs, ~37 MiB); the
`train` extra only adds wheels to download. pip's cache makes a repeated run faster.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "make_wheelhouse.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("make_wheelhouse", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_wheelhouse = _load_script()
IMAGE_PACKAGES = make_wheelhouse.IMAGE_PACKAGES
_canonical = make_wheelhouse.canonical


def _closure(roots: tuple[str, ...]) -> list[metadata.Distribution]:
    """The installed distributions `roots` need (their requirements, recursively), in this interpreter."""
    seen: dict[str, metadata.Distribution] = {}
    todo = list(roots)
    while todo:
        name = _canonical(todo.pop())
        if name in seen:
            continue
        dist = metadata.distribution(name)
        seen[name] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def _site_packages(venv: Path) -> Path:
    return venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def _make_image(venv: Path) -> None:
    """A venv with torch, Triton, their dependencies and pip preinstalled: every file each one's RECORD
    lists inside site-packages, hard-linked (no copy of torch's and Triton's ~1.8 GB; pip replaces a file by unlinking
    it first, so the original stays intact either way)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = _site_packages(venv)
    libs = {Path(sysconfig.get_paths()[key]).resolve() for key in ("purelib", "platlib")}
    for dist in _closure(IMAGE_PACKAGES + ("pip",)):
        for rel in dist.files or []:
            src = Path(dist.locate_file(rel)).resolve()
            lib = next((lib for lib in libs if lib in src.parents), None)
            if not src.is_file() or lib is None:  # console scripts in bin/, missing .pyc
                continue
            dst = site / src.relative_to(lib)
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src, dst)
            except OSError:  # another file system
                shutil.copy2(src, dst)


def _fingerprint(site: Path) -> dict:
    """torch's and Triton's versions and files as installed: (inode, size, mtime) of every recorded file,
    hashes of torch/__init__.py and of each dist-info file."""
    found = {}
    for dist in metadata.distributions(path=[str(site)]):
        name = _canonical(dist.metadata["Name"])
        if name not in IMAGE_PACKAGES:
            continue
        files = {}
        for rel in dist.files or []:
            path = Path(dist.locate_file(rel))
            if path.is_file():
                st = path.stat()
                files[str(rel)] = (st.st_ino, st.st_size, st.st_mtime_ns)
        dist_info = Path(dist._path)  # type: ignore[attr-defined]
        hashes = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(dist_info.iterdir()) if p.is_file()}
        if name == "torch":
            hashes["torch/__init__.py"] = hashlib.sha256((site / "torch" / "__init__.py").read_bytes()).hexdigest()
        found[name] = {"version": dist.version, "files": files, "hashes": hashes, "dist_info": dist_info.name}
    return found


def _offline_env(home: Path) -> dict[str, str]:
    """No package source but what the command names: no pip config (this machine's has local
    indexes), no index, and a dead proxy for anything that would still try the network."""
    dead = "http://127.0.0.1:9"
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8",
            "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_INDEX_URL": f"{dead}/simple",
            "HTTP_PROXY": dead, "HTTPS_PROXY": dead, "http_proxy": dead, "https_proxy": dead,
            "PIP_RETRIES": "0", "PIP_TIMEOUT": "3", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "PIP_NO_CACHE_DIR": "1"}


def _run(cmd: list, env: dict | None = None, cwd: Path | None = None) -> str:
    proc = subprocess.run([str(c) for c in cmd], env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=900)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{proc.stdout[-4000:]}"
    return proc.stdout


# --- the script's inputs (no network) ---------------------------------------------------------

def _main_error(capsys, argv) -> str:
    assert make_wheelhouse.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_missing_image_flags_point_to_probe(capsys, tmp_path):
    line = _main_error(capsys, ["--out", str(tmp_path / "w"), "--torch", "2.11.0"])
    assert "--triton --python-version --platform" in line and "--probe" in line
    assert not (tmp_path / "w").exists()


def test_bad_inputs_are_refused_in_one_line(capsys, tmp_path):
    image = ["--torch", "2.11.0", "--triton", "3.6.0", "--platform", "manylinux_2_35_x86_64"]
    assert "--python-version '312'" in _main_error(capsys, ["--out", str(tmp_path / "a"), "--python-version", "312", *image])
    line = _main_error(capsys, ["--out", str(tmp_path / "b"), "--python-version", "3.12", "--torch", "2.11.0",
                                "--triton", "3.6.0", "--platform", "win_amd64"])
    assert "win_amd64" in line and "manylinux_2_35_x86_64" in line
    full = tmp_path / "full"
    full.mkdir()
    (full / "torch-2.5.0-cp312-cp312-manylinux_2_28_x86_64.whl").write_bytes(b"")
    line = _main_error(capsys, ["--out", str(full), "--python-version", "3.12", *image])
    assert "not empty" in line and "torch-2.5.0" in line
    line = _main_error(capsys, ["--out", str(tmp_path / "c"), "--python-version", "3.12", *image,
                                "--source", str(tmp_path)])
    assert "no pyproject.toml" in line


def test_platform_tags_expand_to_the_older_manylinux_ones():
    tags = make_wheelhouse.expand_platform("manylinux_2_35_x86_64")
    assert tags[0] == "manylinux_2_35_x86_64" and tags[-1] == "manylinux1_x86_64"
    for tag in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux2010_x86_64"):
        assert tag in tags
    assert "manylinux_2_36_x86_64" not in tags and not [t for t in tags if "aarch64" in t]
    assert make_wheelhouse.expand_platform("manylinux2014_aarch64") == ["manylinux2014_aarch64"]


def test_probe_describes_this_interpreter():
    flags = make_wheelhouse.probe().split()
    given = dict(zip(flags[::2], flags[1::2]))
    assert given["--python-version"] == f"{sys.version_info.major}.{sys.version_info.minor}"
    assert given["--torch"] == metadata.version("torch") and given["--triton"] == metadata.version("triton")
    assert given["--platform"].startswith("manylinux_2_") and given["--platform"] in make_wheelhouse.expand_platform(
        given["--platform"])


def test_stub_wheel_is_an_installable_wheel_of_that_version(tmp_path):
    path = make_wheelhouse.stub_wheel("torch", "2.11.0a0+nv25.10", tmp_path)
    with zipfile.ZipFile(path) as wheel:
        names = wheel.namelist()
        assert "torch-2.11.0a0+nv25.10.dist-info/METADATA" in names
        meta = wheel.read("torch-2.11.0a0+nv25.10.dist-info/METADATA").decode()
    assert "Version: 2.11.0a0+nv25.10" in meta and "Requires-Dist" not in meta
    assert path.name == "torch-2.11.0a0+nv25.10-py3-none-any.whl"


# --- the whole path: image, connected machine, offline install -------------------------------------

@pytest.mark.slow  # ~1-2 min on 2 busy cores (wheel builds, resolution, install); ~40 s with pip's cache warm
@pytest.mark.integration
def test_offline_install_on_an_image_keeps_its_torch_and_triton(tmp_path):
    start = time.monotonic()
    image = tmp_path / "image"
    _make_image(image)
    image_python = image / "bin" / "python"
    site = _site_packages(image)
    before = _fingerprint(site)
    assert set(before) == set(IMAGE_PACKAGES), f"the image venv lacks {set(IMAGE_PACKAGES) - set(before)}"

    # on the image: its parameters
    flags = _run([image_python, SCRIPT, "--probe"]).split()
    assert flags[flags.index("--torch") + 1] == metadata.version("torch")
    assert flags[flags.index("--triton") + 1] == metadata.version("triton")

    # on the connected machine (this one, with its registry access and pip cache)
    wheelhouse = tmp_path / "wheelhouse"
    image_ready = time.monotonic()
    # a misspelt extra is refused in one line once the wheel says which exist, and the half-made
    # wheelhouse is emptied, so the same --out works on the next try
    typo = subprocess.run([sys.executable, SCRIPT, "--out", wheelhouse, "--extras", "trian", *flags],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert typo.returncode == 2 and "--extras trian" in typo.stderr and "train" in typo.stderr, typo.stderr
    assert wheelhouse.is_dir() and not list(wheelhouse.iterdir())
    out = _run([sys.executable, SCRIPT, "--out", wheelhouse, "--extras", "", *flags])
    built = time.monotonic()
    wheels = sorted(p.name for p in wheelhouse.glob("*.whl"))
    names = {_canonical(w.split("-")[0]) for w in wheels}
    assert not names & {"torch", "triton"}, f"the wheelhouse carries the image's own packages: {wheels}"
    assert not [w for w in wheels if w.startswith(("nvidia_", "nvidia-"))], wheels
    assert not names & {"wandb", "datasets", "matplotlib", "pyarrow"}, "the core wheelhouse has the train extra"
    deepspeed_wheels = [w for w in wheels if w.startswith("deepspeed-")]
    assert len(deepspeed_wheels) == 1 and deepspeed_wheels[0].endswith("-py3-none-any.whl"), wheels
    size_mib = sum(p.stat().st_size for p in wheelhouse.glob("*.whl")) / 2**20
    print(f"wheelhouse: {len(wheels)} wheels, {size_mib:.1f} MiB")
    assert "pip install --no-index --find-links" in out

    # on the image, offline: without the wheelhouse nothing is found (no other source reachable) ...
    offline = _offline_env(tmp_path / "home")
    blocked = subprocess.run([image_python, "-m", "pip", "install", "--dry-run", "dsa-train"], env=offline,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert blocked.returncode != 0 and "No matching distribution" in blocked.stdout, blocked.stdout[-2000:]
    # ... and the documented command installs it
    constraints = wheelhouse / "image-constraints.txt"
    _run([image_python, "-m", "pip", "install", "--no-index", "--find-links", wheelhouse, "-c", constraints,
          "dsa-train"], env=offline)
    installed = time.monotonic()
    print(f"image venv {image_ready - start:.0f} s, wheelhouse {built - image_ready:.0f} s, "
          f"offline install {installed - built:.0f} s")

    after = _fingerprint(site)
    for name in IMAGE_PACKAGES:
        assert after[name]["version"] == before[name]["version"]
        assert after[name]["dist_info"] == before[name]["dist_info"]
        assert after[name]["hashes"] == before[name]["hashes"], f"{name}'s dist-info or __init__.py changed"
        changed = [f for f, stat in before[name]["files"].items() if after[name]["files"].get(f) != stat]
        assert not changed, f"{len(changed)} of {name}'s files were replaced, e.g. {changed[:3]}"
    _run([image_python, "-m", "pip", "check"], env=offline)

    # the installed package works, from outside the source tree, without the train extra: imports, and
    # `dsa-train gpu-check --dry-run` lists its checks (the console script, no GPU needed)
    probe = ("import dsa_train, dsa_kernels, deepspeed, megatron.core, importlib.util as u; "
             "print(dsa_train.__file__); print([m for m in ('wandb', 'datasets') if u.find_spec(m)])")
    shown = _run([image_python, "-c", probe], env=dict(offline, DS_ACCELERATOR="cpu"),
                 cwd=tmp_path).splitlines()
    assert str(site) in shown[-2], shown
    assert shown[-1] == "[]", shown
    dry_run = _run([image / "bin" / "dsa-train", "gpu-check", "--dry-run"], env=offline, cwd=tmp_path)
    assert "correctness" in dry_run and "end-to-end" in dry_run, dry_run[-2000:]
