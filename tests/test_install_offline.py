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


# --- the GPU session's kit and run, rehearsed on the CPU -----------------------------------------

SESSION = REPO / "scripts" / "gpu_session.py"


def test_image_list_reads_freeze_lines_and_bare_names(tmp_path):
    listed = tmp_path / "image.txt"
    listed.write_text("# a comment\nNumPy==2.5.2\npyarrow\n\ntyping_extensions==4.15.0  # trailing\n")
    assert make_wheelhouse.read_image_list(listed) == {"numpy": "2.5.2", "pyarrow": None,
                                                       "typing-extensions": "4.15.0"}
    listed.write_text("numpy==\n")
    with pytest.raises(make_wheelhouse.WheelhouseError, match=r"image.txt:1: 'numpy==' is not"):
        make_wheelhouse.read_image_list(listed)


@pytest.mark.integration
def test_session_record_image_keeps_the_probe_and_the_freeze(tmp_path):
    session_image = tmp_path / "image.txt"
    session_image.write_text("# probe\n--python-version 3.12 --platform manylinux_2_39_x86_64 --torch 2.11.0 "
                             "--triton 3.6.0\n\n# pip list --format=freeze\nnumpy==2.5.2\ndsa-train==0.1.0\n\n"
                             "# python\n3.12.3 (main)\n\n# nvidia-smi\nname, memory\nNVIDIA H200, 143771 MiB\n")
    image = tmp_path / "cuda.txt"
    _run([sys.executable, SESSION, "record-image", session_image, "--image", image])
    text = image.read_text()
    assert "# probe: --python-version 3.12 --platform manylinux_2_39_x86_64" in text and "NVIDIA H200" in text
    assert make_wheelhouse.read_image_list(image) == {"numpy": "2.5.2"}  # dsa-train itself is never the image's


@pytest.mark.integration
def test_session_run_refuses_a_missing_kit_or_a_used_out_in_one_line(tmp_path):
    for args, needle in ((["--kit", tmp_path / "nokit", "--out", tmp_path / "o"], "prepare"),):
        proc = subprocess.run([sys.executable, SESSION, "run", *args], capture_output=True, text=True)
        assert proc.returncode == 2 and needle in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_the_committed_image_list_has_probe_flags_and_versions():
    image = REPO / "scripts" / "gpu-image" / "cuda.txt"
    packages = make_wheelhouse.read_image_list(image)
    assert packages["torch"] and packages["triton"] and len(packages) > 100
    probe = [line for line in image.read_text().splitlines() if line.startswith("# probe:")]
    assert len(probe) == 1 and "--python-version 3.12" in probe[0]


@pytest.mark.integration
@pytest.mark.slow  # resolution for the GPU image's Python 3.12 (pip's cache): ~30 s
def test_gpu_kit_for_the_committed_image_fits_in_40_mib(tmp_path):
    """`prepare` for the lent GPU image as recorded (scripts/gpu-image/cuda.txt): only what it lacks,
    under 40 MiB with the working tree."""
    import json

    kit = tmp_path / "kit"
    _run([sys.executable, SESSION, "prepare", "--kit", kit])
    summary = json.loads((kit / "kit.json").read_text())
    assert summary["total_mib"] < 40, summary
    names = {_canonical(w.split("-")[0]) for w in summary["wheels"]}
    assert {"dsa-train", "deepspeed", "megatron-core", "hydra-core", "omegaconf"} <= names
    image = make_wheelhouse.read_image_list(REPO / "scripts" / "gpu-image" / "cuda.txt")
    assert not names & set(image), names & set(image)  # nothing the image has travels


@pytest.mark.integration
@pytest.mark.slow  # the wheel kit, an offline install and three trainer runs + the NCCL stand-in: ~5 min on 2 busy cores
def test_gpu_session_rehearsal_installs_the_wheel_offline_and_trains(tmp_path):
    """`scripts/gpu_session.py` as a GPU session runs it, on an image-like venv here: `prepare` builds
    the kit for this image (what its pip freeze lacks), `run` installs the built dsa-train wheel
    offline into the image's own environment (not editable, outside the source tree) and runs
    gpu-check's end-to-end checks from it: both stages, kill -9 and resume, the throughput run with
    its profiler, and the 2-rank EP2 launch (gloo)."""
    import json
    import tarfile

    image = tmp_path / "image"
    _make_image(image)
    image_python = image / "bin" / "python"
    freeze = tmp_path / "image-freeze.txt"
    freeze.write_text(_run([image_python, "-m", "pip", "list", "--format=freeze"]))
    flags = _run([image_python, SCRIPT, "--probe"]).strip()
    kit = tmp_path / "kit"
    # this image has only torch, Triton and their needs (no numpy, ...): its kit is larger than the GPU
    # image's (test_gpu_kit_fits below), within the device tool's 64 MiB
    out = _run([sys.executable, SESSION, "prepare", "--kit", kit, "--image", freeze, "--probe-flags", flags,
                "--limit-mib", "64"])
    assert "with the working tree" in out
    names = {_canonical(p.name.split("-")[0]) for p in kit.glob("*.whl")}
    assert {"dsa-train", "deepspeed", "megatron-core", "hydra-core"} <= names
    assert not names & {"torch", "triton", "wandb", "matplotlib", "datasets", "pyarrow"}, names

    offline = _offline_env(tmp_path / "home")
    session_out = tmp_path / "out"
    proc = subprocess.run([str(image_python), str(SESSION), "run", "--kit", str(kit), "--out", str(session_out),
                           "--small", "--device", "cpu", "--python", str(image_python), "--step", "e2e"],
                          env=offline, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1500)
    files = sorted(p.name for p in session_out.iterdir())
    summary = (session_out / "session.md").read_text() if (session_out / "session.md").exists() else proc.stdout[-3000:]
    assert proc.returncode == 0, summary + (session_out / "session.log").read_text()[-4000:]
    assert len(files) <= 8 and {"session.md", "session.log", "image.txt", "reports.tar.gz", "e2e.json"} <= set(files)
    assert "| install | ok |" in summary and "| e2e | ok |" in summary
    # installed from the wheel into the image's own site-packages, torch and Triton untouched
    site = _site_packages(image)
    assert (site / "dsa_train" / "eval" / "in_training.py").is_file()
    assert not list(site.glob("__editable__*dsa_train*"))
    report = json.loads((session_out / "e2e.json").read_text())
    status = {c["name"]: (c["status"], c["summary"]) for c in report["checks"]}
    for name in ("end-to-end.train_kill_resume", "end-to-end.throughput", "nccl.ep2"):
        assert status[name][0] == "pass", (name, status[name])
    # the checks' own outcomes in detail (the only CPU runs of them in the suite)
    from tests.test_gpu_check_e2e import assert_small_cpu_outcomes

    unpacked = tmp_path / "unpacked"
    with tarfile.open(session_out / "reports.tar.gz") as tar:
        tar.extractall(unpacked, filter="data")
    assert_small_cpu_outcomes(report, unpacked / "reports" / "e2e")
    assert f"{site}/dsa_train/__init__.py" in (session_out / "session.log").read_text()  # the import step's print
    with tarfile.open(session_out / "reports.tar.gz") as tar:
        members = tar.getnames()
    assert any(m.endswith("throughput/step_00000003.txt") for m in members), members[:20]
    assert any(m.endswith("end-to-end/killed.log") for m in members)
