#!/usr/bin/env python3
"""Build a wheelhouse for installing dsa-train offline on a cluster image that already has torch and
Triton, without replacing them (docs/install.md).

On the image (offline), print its parameters:

    python make_wheelhouse.py --probe
    # --python-version 3.12 --platform manylinux_2_35_x86_64 --torch 2.11.0 --triton 3.6.0

On a connected Linux machine, from a clone of this repository (any Python >= 3.10 with pip >= 22.2;
neither torch nor a GPU is needed there):

    python scripts/make_wheelhouse.py --out wheelhouse <the flags printed by --probe>

Back on the image, with the wheelhouse copied over:

    python -m pip install --no-index --find-links wheelhouse -c wheelhouse/image-constraints.txt "dsa-train[train]"

How: dependencies are resolved for the image's Python and platform with torch and Triton replaced by
empty stand-in wheels of the image's exact versions (so nothing that torch or Triton would pull,
CUDA libraries included, is resolved or downloaded, and a dependency that needs another torch fails
here, not on the image); packages that publish only a source distribution (DeepSpeed,
antlr4-python3-runtime) are built into wheels here, and must come out pure Python (DeepSpeed builds
no ops ahead of time: it compiles them on first use, on the image). Everything else is downloaded
as wheels for the image. pip's cache makes a repeated run fast.

Standard library only: this file also runs on the image for --probe.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ME = "make_wheelhouse"
REPO = Path(__file__).resolve().parent.parent
CONSTRAINTS_NAME = "image-constraints.txt"
# the packages the image provides; the wheelhouse never contains them
IMAGE_PACKAGES = ("torch", "triton")
# copied into the temporary source tree from which the dsa-train wheel is built (not the repo's own
# build/ or egg-info, which a build would otherwise leave in the clone)
SOURCE_IGNORE = (".git", ".venv", "*.egg-info", "build", "dist", "__pycache__", "runs", "outputs", "wandb",
                 ".pytest_cache", "wheelhouse")
MIN_PIP = (22, 2)  # `pip install --dry-run --report`


class WheelhouseError(Exception):
    """A problem with the inputs or the environment, told in one line."""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# --- on the image -----------------------------------------------------------------------------

def probe() -> str:
    """The flags that describe this interpreter's image: Python version, platform tag, torch, Triton."""
    from importlib import metadata

    if sys.platform != "linux":
        raise WheelhouseError(f"--probe runs on the Linux cluster image; this is {sys.platform}")
    # the glibc this process runs with (as pip's own tag logic reads it); platform.libc_ver() only reads
    # the symbol versions the executable was linked against, which can be older
    try:
        libc, libc_version = (os.confstr("CS_GNU_LIBC_VERSION") or "").split()
    except (ValueError, OSError):
        libc, libc_version = platform.libc_ver()
    if libc != "glibc" or not libc_version:
        raise WheelhouseError(f"this Python reports libc {libc or 'unknown'!r}; manylinux wheels need glibc. "
                              "Pass --platform to make_wheelhouse.py by hand")
    major, minor = libc_version.split(".")[:2]
    machine = platform.machine()
    flags = [f"--python-version {sys.version_info.major}.{sys.version_info.minor}",
             f"--platform manylinux_{major}_{minor}_{machine}"]
    for name in IMAGE_PACKAGES:
        try:
            flags.append(f"--{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            raise WheelhouseError(f"{name} is not installed in this Python ({sys.executable}); run --probe with "
                                  "the image's Python, the one that has CUDA torch and Triton") from None
    return " ".join(flags)


# --- on the connected machine -------------------------------------------------------------------

def stub_wheel(name: str, version: str, out_dir: Path) -> Path:
    """An empty wheel that stands in for the image's `name==version` during resolution: it has no
    dependencies, so nothing torch or Triton require is resolved or downloaded."""
    import base64
    import hashlib

    file_name = re.sub(r"[-_.]+", "_", name)  # a wheel's file name spells the project with underscores
    dist_info = f"{file_name}-{version}.dist-info"
    files = {
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: make_wheelhouse\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{dist_info}/RECORD"] = "\n".join(record + [f"{dist_info}/RECORD,,"]) + "\n"
    path = out_dir / f"{file_name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for member, text in files.items():
            wheel.writestr(member, text)
    return path


def run_pip(args: list[str], what: str, env: dict[str, str] | None = None) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    print(f"{ME}: {what}", flush=True)
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout)
        raise WheelhouseError(f"{what} failed (pip exit {proc.returncode}; its output is above): "
                              + " ".join(cmd))


def isolated_env() -> dict[str, str]:
    """This environment without pip's configuration: no configured find-links or index reaches the
    offline check."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def check_pip() -> None:
    try:
        from pip import __version__ as pip_version
    except ImportError:
        raise WheelhouseError(f"{sys.executable} has no pip; run this script with a Python that has pip "
                              f">= {MIN_PIP[0]}.{MIN_PIP[1]}") from None
    have = tuple(int(p) for p in re.findall(r"\d+", pip_version)[:2])
    if have < MIN_PIP:
        raise WheelhouseError(f"pip {pip_version} is too old (needs >= {MIN_PIP[0]}.{MIN_PIP[1]} for --report): "
                              f"{sys.executable} -m pip install -U pip")


# glibc 2.x of the legacy manylinux names (PEP 600)
LEGACY_MANYLINUX = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}


def expand_platform(tag: str) -> list[str]:
    """A platform tag and every older one a wheel for which runs there: pip's --platform takes the
    tags literally (manylinux_2_35_x86_64 alone would miss a manylinux_2_17 wheel)."""
    many = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", tag)
    musl = re.fullmatch(r"musllinux_1_(\d+)_(\w+)", tag)
    if many:
        glibc_minor, arch = int(many.group(1)), many.group(2)
        tags = []
        for minor in range(glibc_minor, 4, -1):
            tags.append(f"manylinux_2_{minor}_{arch}")
            if minor in LEGACY_MANYLINUX:
                tags.append(f"{LEGACY_MANYLINUX[minor]}_{arch}")
        return tags
    if musl:
        return [f"musllinux_1_{minor}_{musl.group(2)}" for minor in range(int(musl.group(1)), 0, -1)]
    return [tag]


def target_flags(python_version: str, platforms: list[str]) -> list[str]:
    flags = ["--only-binary", ":all:", "--implementation", "cp", "--python-version", python_version]
    for tag in dict.fromkeys(t for given in platforms for t in expand_platform(given)):
        flags += ["--platform", tag]
    return flags


def resolve(requirements: list[str], find_links: list[Path], constraints: Path, report: Path,
            extra: list[str], what: str, env: dict[str, str] | None = None) -> list[dict]:
    """`pip install --dry-run --report` with nothing installed: the packages pip would install."""
    args = ["install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report), "-c", str(constraints)]
    for link in find_links:
        args += ["--find-links", str(link)]
    run_pip(args + extra + requirements, what, env)
    return json.loads(report.read_text())["install"]


def is_wheel_url(item: dict) -> bool:
    return item["download_info"]["url"].split("#")[0].endswith(".whl")


def remove_unneeded(out: Path, wanted: set[str]) -> None:
    """Delete wheels the resolution did not pick (a wheel built in step 2 that the image's Python does
    not need): anything in the wheelhouse is offered to the image's pip."""
    for path in out.glob("*.whl"):
        if canonical(path.name.split("-")[0]) not in wanted:
            path.unlink()


def read_image_list(path: Path) -> dict[str, str | None]:
    """An image's package list: `pip list --format=freeze` lines (`name==version`), or bare names
    where only the name is known; `#` comments and blank lines ignored. -> canonical name -> version."""
    try:
        lines = path.read_text().splitlines()
    except OSError as err:
        raise WheelhouseError(f"--image-packages {path}: cannot be read ({err.strerror or err})")
    found: dict[str, str | None] = {}
    for number, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name.strip()) or (sep and not version.strip()):
            raise WheelhouseError(f"--image-packages {path}:{number}: {line!r} is not `name==version` or a name; "
                                  "write it as `pip list --format=freeze` prints it")
        found[canonical(name.strip())] = version.strip() or None
    return found


def build_wheelhouse(out: Path, torch_version: str, triton_version: str, python_version: str,
                     platforms: list[str], extras: str, source: Path,
                     image_packages: dict[str, str | None] | None = None) -> dict:
    check_pip()
    if not re.fullmatch(r"3\.\d+", python_version):
        raise WheelhouseError(f"--python-version {python_version!r}: give major.minor of the image's Python, e.g. 3.12")
    for tag in platforms:
        if not re.fullmatch(r"(manylinux|musllinux)_\d+_\d+_\w+|manylinux(1|2010|2014)_\w+|linux_\w+", tag):
            raise WheelhouseError(f"--platform {tag!r} is not a Linux platform tag; use e.g. manylinux_2_35_x86_64 "
                                  "(what --probe prints on the image)")
    if not (source / "pyproject.toml").is_file():
        raise WheelhouseError(f"--source {source}: no pyproject.toml there; point it at a dsa_train clone")
    extras_list = [e.strip() for e in extras.split(",") if e.strip()]
    out.mkdir(parents=True, exist_ok=True)
    stale = sorted(p.name for p in out.iterdir())
    if stale:
        raise WheelhouseError(f"--out {out} is not empty ({len(stale)} entries, e.g. {stale[0]}); give a new "
                              "directory so that no stale wheel reaches the image")
    try:
        return fill_wheelhouse(out, torch_version, triton_version, python_version, platforms, extras_list, source,
                               image_packages or {})
    except BaseException:
        for path in out.iterdir():  # it was empty: leave it so for the next try, not half filled
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        raise


def fill_wheelhouse(out: Path, torch_version: str, triton_version: str, python_version: str,
                    platforms: list[str], extras_list: list[str], source: Path,
                    image_packages: dict[str, str | None]) -> dict:
    # DeepSpeed: build no ops ahead of time (it JIT-compiles them on the image, against its own torch)
    env = dict(os.environ, DS_BUILD_OPS="0")
    # what the image has: torch and Triton always; with --image-packages every package it lists.
    # A listed version becomes a stand-in wheel (resolved against exactly, pinned on the image); a bare
    # name is only left out of the wheelhouse (its version on the image must then satisfy dsa-train).
    pinned = {name: version for name, version in image_packages.items()
              if version and name not in IMAGE_PACKAGES + ("dsa-train", "pip")}
    pinned.update(zip(IMAGE_PACKAGES, (torch_version, triton_version)))
    on_image = set(IMAGE_PACKAGES) | (set(image_packages) - {"dsa-train"})

    with tempfile.TemporaryDirectory(prefix="dsa-wheelhouse-") as tmp_name:
        tmp = Path(tmp_name)
        stubs = tmp / "stubs"
        stubs.mkdir()
        stub_reqs = [f"{name} @ {stub_wheel(name, version, stubs).as_uri()}" for name, version in sorted(pinned.items())]
        constraints = out / CONSTRAINTS_NAME
        constraints.write_text("# the image's own packages: pip keeps them (make_wheelhouse.py)\n"
                               + "".join(f"{name}=={version}\n" for name, version in sorted(pinned.items())))

        # 1. dsa-train itself, built from a copy of the source tree (the clone stays clean)
        src = tmp / "src"
        shutil.copytree(source, src, ignore=shutil.ignore_patterns(*SOURCE_IGNORE))
        run_pip(["wheel", "--quiet", "--no-deps", "--wheel-dir", str(out), str(src)], "building the dsa-train wheel",
                env)
        (own_wheel,) = out.glob("dsa_train-*.whl")
        with zipfile.ZipFile(own_wheel) as wheel:
            meta = next(wheel.read(n).decode() for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        provided = re.findall(r"^Provides-Extra: (\S+)", meta, re.M)
        unknown = [e for e in extras_list if canonical(e) not in map(canonical, provided)]
        if unknown:
            raise WheelhouseError(f"--extras {','.join(unknown)}: dsa-train has no such extra; it has "
                                  f"{', '.join(provided)} (or '' for the core only)")
        own_req = f"{own_wheel}[{','.join(extras_list)}]" if extras_list else str(own_wheel)

        # 2. which dependencies exist only as a source distribution: resolve for this machine, sdists allowed
        local = resolve(stub_reqs + [own_req], [], constraints, tmp / "local.json", [],
                        "resolving on this machine (to find source-only packages)")
        for item in local:
            name, version = item["metadata"]["name"], item["metadata"]["version"]
            if canonical(name) in on_image | {"dsa-train"} or is_wheel_url(item):
                continue
            run_pip(["wheel", "--quiet", "--no-deps", "--wheel-dir", str(out), f"{name}=={version}"],
                    f"building a wheel of {name} {version} (published as source only)", env)
            built = [p for p in out.glob("*.whl") if canonical(p.name.split("-")[0]) == canonical(name)]
            impure = [p.name for p in built if not p.name.endswith("-none-any.whl")]
            if impure:
                raise WheelhouseError(f"{name} {version} built into a platform wheel ({impure[0]}), which may not run "
                                      f"on the image; build it there instead: pip wheel --no-deps {name}=={version}")

        # 3. the real resolution, for the image's Python and platform: wheels only (the ones just built
        # included), torch and Triton the stand-ins
        target = target_flags(python_version, platforms)
        install = resolve(stub_reqs + [own_req], [out], constraints, tmp / "target.json",
                          target + ["--target", str(tmp / "target")],
                          f"resolving for Python {python_version} on {', '.join(platforms)}")
        needed = [item for item in install if canonical(item["metadata"]["name"]) not in on_image]
        pins = tmp / "pins.txt"
        pins.write_text("".join(f"{item['metadata']['name']}=={item['metadata']['version']}\n" for item in needed
                                if canonical(item["metadata"]["name"]) != "dsa-train"))

        # 4. download them (pip's cache serves a repeated run)
        run_pip(["download", "--quiet", "--no-deps", "--dest", str(out), "--find-links", str(out), *target,
                 "-r", str(pins)], f"downloading {len(needed) - 1} wheels")
        remove_unneeded(out, {canonical(item["metadata"]["name"]) for item in needed})

        # 5. the check: the image's install, resolved from the wheelhouse alone (and the stand-ins; an image
        # package listed without a version stands in at the version resolved here, assumed to satisfy)
        assumed = {canonical(item["metadata"]["name"]): item["metadata"]["version"] for item in install
                   if canonical(item["metadata"]["name"]) in on_image - set(pinned)}
        stub_reqs += [f"{name} @ {stub_wheel(name, version, stubs).as_uri()}" for name, version in sorted(assumed.items())]
        resolve(stub_reqs + [own_req.replace(str(own_wheel), "dsa-train")], [out], constraints,
                tmp / "offline.json", target + ["--no-index", "--target", str(tmp / "offline")],
                "checking that the wheelhouse alone satisfies the install (--no-index)", isolated_env())

    files = sorted(out.glob("*.whl"))
    size = sum(p.stat().st_size for p in files)
    return {"wheels": len(files), "bytes": size, "image_packages": len(on_image), "assumed_on_image": assumed,
            "install_target": f"dsa-train[{','.join(extras_list)}]" if extras_list else "dsa-train"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="make_wheelhouse.py",
        description="Wheelhouse for an offline install of dsa-train on an image with its own torch and Triton "
                    "(docs/install.md). Run --probe on the image, then the printed flags here.")
    parser.add_argument("--probe", action="store_true",
                        help="on the image: print this Python's --python-version/--platform/--torch/--triton flags")
    parser.add_argument("--out", type=Path, default=Path("wheelhouse"), help="new, empty directory (default: wheelhouse)")
    parser.add_argument("--torch", help="the image's torch version exactly as pip lists it, e.g. 2.11.0")
    parser.add_argument("--triton", help="the image's Triton version, e.g. 3.6.0")
    parser.add_argument("--python-version", help="the image's Python, major.minor, e.g. 3.12")
    parser.add_argument("--platform", action="append", dest="platforms",
                        help="the image's platform tag, e.g. manylinux_2_35_x86_64 (older manylinux tags are "
                             "implied); may be repeated")
    parser.add_argument("--extras", default="train",
                        help="dsa-train extras to include: 'train' (default: W&B, datasets, matplotlib, for "
                             "training runs) or '' (only what `dsa-train gpu-check` and the engine need)")
    parser.add_argument("--source", type=Path, default=REPO, help="the dsa_train source tree (default: this clone)")
    parser.add_argument("--image-packages", type=Path, default=None,
                        help="the image's `pip list --format=freeze` (or bare names): what it has is left out of "
                             "the wheelhouse and pinned on the image (a GPU session's small kit)")
    args = parser.parse_args(argv)
    try:
        if args.probe:
            print(probe())
            return 0
        missing = [flag for flag, value in (("--torch", args.torch), ("--triton", args.triton),
                                            ("--python-version", args.python_version),
                                            ("--platform", args.platforms)) if not value]
        if missing:
            raise WheelhouseError(f"missing {' '.join(missing)}: run `python make_wheelhouse.py --probe` on the "
                                  "image and pass the flags it prints")
        image = read_image_list(args.image_packages) if args.image_packages else None
        summary = build_wheelhouse(args.out.resolve(), args.torch, args.triton, args.python_version, args.platforms,
                                   args.extras, args.source.resolve(), image)
    except WheelhouseError as err:
        print(f"{ME}: {err}", file=sys.stderr)
        return 2
    out = args.out
    print(f"{ME}: {summary['wheels']} wheels, {summary['bytes'] / 2**20:.1f} MiB in {out} "
          f"(torch {args.torch} and Triton {args.triton} are the image's: not included)")
    print(f"{ME}: copy {out} to the image, then run there (no network needed):\n"
          f"  python -m pip install --no-index --find-links {out} -c {out}/{CONSTRAINTS_NAME} "
          f"\"{summary['install_target']}\"\n"
          f"  dsa-train gpu-check")
    return 0


if __name__ == "__main__":
    sys.exit(main())
