#!/usr/bin/env python3
"""One GPU session in one call: a small kit built on a connected machine, then everything a lent GPU
machine should run, in priority order, each step time-boxed, into one output folder of at most 8 files.

On a connected machine, from a clone (builds the kit; the clone plus the kit must stay under 40 MiB,
the device tool carries the working tree and at most 64 MiB):

    python scripts/gpu_session.py prepare [--kit .gpu-kit] [--image scripts/gpu-image/cuda.txt]

The kit is a wheelhouse of dsa-train and only what the image lacks (DeepSpeed, megatron-core, Hydra,
...): `scripts/gpu-image/cuda.txt` lists what the image has (its `pip list --format=freeze`,
written by the last session's `run` as image.txt), and `make_wheelhouse.py --image-packages` leaves
those out and pins them.

On the GPU machine (offline; the image's python3, which is itself a venv):

    python3 scripts/gpu_session.py run --kit .gpu-kit --out "$OUT" [--budget-s 540] [--step NAME ... | --plan FILE]

  (--plan FILE: the steps one per line, `#` comments; scripts/gpu-next.txt is the next session's
  prepared plan. Every step is checked before the install, so a typo costs no device time.)

  1. image       the image's probe flags, `pip list --format=freeze`, nvidia-smi     -> image.txt
  2. install     `pip install --no-index --find-links KIT -c KIT/image-constraints.txt dsa-train`
                 into the image's own environment; if pip cannot (an old image package in the way),
                 `--target` + PYTHONPATH with the kit's wheels as they are (said in the log)
  3. the steps, in the order given (default: DEFAULT_STEPS), each with its own time box, skipped once
     the session budget cannot hold it:
       e2e        dsa-train gpu-check --only environment end-to-end nccl (the trainer: both stages of
                  small_32k at T = 32K, 2 layers, ZeRO-2, bf16, kill -9 and resume; tokens/s, MFU, peak
                  memory beside `dsa-train plan`)
       variants   benchmarks/kernel_variants.py (launch variants never timed on a GPU)
       speed      dsa-train gpu-check --only speed
       correctness dsa-train gpu-check --only correctness
       check:P1,P2[=S]  dsa-train gpu-check --only P1 P2 (any check prefixes), S seconds
       bench:SCRIPT[=S] python benchmarks/SCRIPT <out>.json (a kernel candidate's script)
       pytest:T1,T2[=S] the tests marked `gpu` in tests/T1, tests/T2 (python -P -m pytest -m gpu,
                        --import-mode=importlib, from outside the tree: the installed package under
                        test, not the source tree); its JUnit XML among the reports
       env:NAME=VALUE   set NAME for the steps after it (e.g. env:DSA_KERNELS_GLUON=1 before the
                        steps that may run an opt-in kernel, after the steps that must not)
  Outputs ($OUT, at most 8 files): session.md (one row per step: status, seconds, command), session.log
  (everything printed), image.txt, reports.tar.gz (every step's reports, logs and JSON), and the reports
  of up to four steps as <step>.md / .json.

The CPU rehearsal (`make test`, tests/test_install_offline.py): `prepare` for this interpreter and an
image-like venv, then `run --small --device cpu --python IMAGE/bin/python`: the same install and the
same steps at tiny shapes on the CPU.

Standard library only until the install: this file runs on the bare image.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ME = "gpu_session"
REPO = Path(__file__).resolve().parent.parent
DEFAULT_IMAGE = REPO / "scripts" / "gpu-image" / "cuda.txt"
KIT_LIMIT_MIB = 40.0  # the kit and the working tree together (the device tool carries 64 MiB)
MAX_FILES = 8  # the device tool returns at most 8 files
INSTALL_TARGET = "dsa-train"  # the core: gpu-check's training runs read the bundled corpus (no `datasets`)
# name -> seconds on an H200 (estimates until a session measures them; session.md records each)
STEP_SECONDS = {"e2e": 300, "variants": 150, "speed": 200, "correctness": 150}
DEFAULT_STEPS = ("e2e", "variants", "speed", "correctness")
INSTALL_SECONDS = 120
TAIL_SECONDS = 15  # packing the outputs


class SessionError(Exception):
    """A problem with the inputs, told in one line."""


STEP_KINDS = ("e2e", "variants", "speed", "correctness", "check", "bench", "pytest")
STEP_USAGE = ("use e2e, variants, speed, correctness, check:PREFIX[,PREFIX][=S], bench:SCRIPT[=S], "
              "pytest:TEST_FILE[,TEST_FILE][=S] or env:NAME=VALUE")


def check_step(spec: str) -> None:
    """Raise SessionError (one line) for a step `Session.step` would refuse, before any runs."""
    if spec.startswith("env:"):
        key, sep, _ = spec[4:].partition("=")
        if not key or not sep:
            raise SessionError(f"step {spec!r}: write env:NAME=VALUE")
        return
    name, eq, secs = spec.partition("=")
    kind, colon, arg = name.partition(":")
    if kind not in STEP_KINDS:
        raise SessionError(f"step {spec!r}: unknown step; {STEP_USAGE}")
    if kind in ("check", "bench", "pytest") and not arg:
        raise SessionError(f"step {spec!r}: {kind}: needs its argument ({kind}:...)")
    if kind == "bench" and not (REPO / "benchmarks" / arg).is_file():
        raise SessionError(f"step {spec!r}: no benchmarks/{arg}; pick a script in benchmarks/")
    if kind == "pytest":
        missing = [t for t in arg.split(",") if not t or not (REPO / "tests" / t).is_file()]
        if missing:
            raise SessionError(f"step {spec!r}: no tests/{missing[0]}; name test files in tests/, comma-separated")
    if eq:
        try:
            ok = float(secs) > 0
        except ValueError:
            ok = False
        if not ok:
            raise SessionError(f"step {spec!r}: the time box after '=' must be seconds > 0")


def read_plan(path: Path) -> list[str]:
    """The steps of a plan file: one per line, blank lines and `#` comments ignored, each checked."""
    try:
        text = path.read_text()
    except OSError as err:
        raise SessionError(f"--plan {path}: cannot read it ({err.strerror}); give a file of steps, one per line")
    steps = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    steps = [st for st in steps if st]
    if not steps:
        raise SessionError(f"--plan {path}: no steps in it; write one step per line (e.g. check:speed.sparse_mla=90)")
    for st in steps:
        check_step(st)
    return steps


# --------------------------------------------------------------------------------------- prepare
def _read_probe_flags(image_file: Path) -> list[str]:
    for line in image_file.read_text().splitlines():
        if line.startswith("# probe:"):
            return shlex.split(line.split(":", 1)[1])
    raise SessionError(f"{image_file} has no '# probe: --python-version ... --platform ... --torch ... --triton ...' "
                       "line; write the flags `python scripts/make_wheelhouse.py --probe` prints on the image")


def tree_bytes(root: Path) -> int:
    """What the device tool carries of the working tree: tracked plus untracked files git does not ignore."""
    out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, check=True).stdout
    total = 0
    for name in filter(None, out.split(b"\0")):
        path = root / os.fsdecode(name)
        if path.is_file():
            total += path.stat().st_size
    return total


def prepare(kit: Path, image_file: Path, extras: str, limit_mib: float, probe_flags: list[str] | None) -> dict:
    if not image_file.is_file():
        raise SessionError(f"--image {image_file}: no such file; give the image's `pip list --format=freeze` "
                           f"(the default is {DEFAULT_IMAGE.relative_to(REPO)})")
    flags = probe_flags or _read_probe_flags(image_file)
    if kit.exists():
        shutil.rmtree(kit)  # the kit is ours: rebuilt from scratch so no stale wheel travels
    cmd = [sys.executable, str(REPO / "scripts" / "make_wheelhouse.py"), "--out", str(kit), "--extras", extras,
           "--image-packages", str(image_file), *flags]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout)
        raise SessionError(f"building the kit failed (make_wheelhouse.py exit {proc.returncode}; its output is above)")
    shutil.copy2(image_file, kit / "image-packages.txt")
    kit_bytes = sum(p.stat().st_size for p in kit.iterdir() if p.is_file())
    tree = tree_bytes(REPO)
    total_mib = (kit_bytes + tree) / 2**20
    summary = {"kit": str(kit), "wheels": sorted(p.name for p in kit.glob("*.whl")), "kit_mib": kit_bytes / 2**20,
               "tree_mib": tree / 2**20, "total_mib": total_mib}
    (kit / "kit.json").write_text(json.dumps(summary, indent=1) + "\n")
    if total_mib > limit_mib:
        raise SessionError(f"the kit ({kit_bytes / 2**20:.1f} MiB) and the working tree ({tree / 2**20:.1f} MiB) "
                           f"are {total_mib:.1f} MiB, over {limit_mib:.0f} MiB; list more of the image's packages in "
                           f"{image_file} or leave untracked files out of the tree")
    return summary


def record_image(session_image: Path, image_file: Path) -> int:
    """Rewrite the image list from a session's image.txt (its probe flags and pip freeze)."""
    sections, current = {}, None
    for line in session_image.read_text().splitlines():
        if line.startswith("# "):
            current = line[2:].strip()
            sections[current] = []
        elif current is not None and line.strip():
            sections[current].append(line.strip())
    probe, freeze = sections.get("probe"), sections.get("pip list --format=freeze")
    if not probe or not probe[0].startswith("--python-version") or not freeze:
        raise SessionError(f"{session_image} has no probe flags or pip freeze (is it a session's image.txt?)")
    gpu = " ".join(sections.get("nvidia-smi", [])[1:2])
    head = ["# The lent GPU machines' image: what it has, read by `scripts/gpu_session.py prepare` (left out of",
            "# the session's kit, pinned there). Recorded by `gpu_session.py record-image` from a session's",
            f"# image.txt ({time.strftime('%Y-%m-%d')}; {gpu or 'GPU not recorded'}).",
            f"# probe: {probe[0]}"]
    freeze = [ln for ln in freeze if "==" in ln and not ln.lower().startswith(("dsa-train==", "dsa_train=="))]
    image_file.write_text("\n".join(head + freeze) + "\n")
    return len(freeze)


# ------------------------------------------------------------------------------------------- run
class Session:
    def __init__(self, out: Path, budget_s: float, python: str, small: bool, device: str):
        self.out, self.python, self.small, self.device = out, python, small, device
        self.work = out / "work"
        self.work.mkdir(parents=True, exist_ok=True)
        self.log_path = out / "session.log"
        self.log = open(self.log_path, "a", buffering=1)
        self.t0 = time.monotonic()
        self.deadline = self.t0 + budget_s
        self.rows: list[dict] = []
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.dsa_train = [python, "-m", "dsa_train.cli"]
        self.reports: list[tuple[str, Path]] = []  # step name -> its main report (copied out at the end)

    def say(self, text: str) -> None:
        line = f"[{time.monotonic() - self.t0:6.0f} s] {text}"
        print(line, flush=True)
        self.log.write(line + "\n")

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, cmd: list[str], seconds: float, cwd: Path | None = None, env: dict | None = None) -> int:
        """Run one step's command with a time box; its output goes to the log. -> exit code (124: timed out)."""
        self.say(f"{name}: {' '.join(shlex.quote(str(c)) for c in cmd)}  (time box {seconds:.0f} s)")
        t = time.monotonic()
        proc = subprocess.Popen([str(c) for c in cmd], cwd=cwd or REPO, env=env or self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=seconds)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            out, _ = proc.communicate()
            code = 124
        self.log.write(out or "")
        took = time.monotonic() - t
        status = "ok" if code == 0 else ("timed out" if code == 124 else f"exit {code}")
        tail = [ln for ln in (out or "").strip().splitlines() if ln.strip()][-1:] or [""]
        self.rows.append({"step": name, "status": status, "seconds": round(took, 1), "box_s": seconds,
                          "command": " ".join(map(str, cmd)), "last_line": tail[0][:200]})
        self.say(f"{name}: {status} in {took:.0f} s")
        return code

    def skip(self, name: str, why: str) -> None:
        self.rows.append({"step": name, "status": "skipped", "seconds": 0.0, "box_s": 0, "command": "", "last_line": why})
        self.say(f"{name}: skipped ({why})")

    # -- 1. the image
    def image(self) -> None:
        py = self.python
        parts = []
        for title, cmd in (("probe", [py, str(REPO / "scripts" / "make_wheelhouse.py"), "--probe"]),
                           ("pip list --format=freeze", [py, "-m", "pip", "list", "--format=freeze"]),
                           ("python", [py, "-c", "import sys; print(sys.version); print(sys.prefix)"]),
                           ("nvidia-smi", ["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
                                           "--format=csv"])):
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
                text = proc.stdout.strip() or proc.stderr.strip()
            except (OSError, subprocess.TimeoutExpired) as err:
                text = f"({err})"
            parts.append(f"# {title}\n{text}\n")
        (self.out / "image.txt").write_text("\n".join(parts))
        self.say("image: image.txt written")

    # -- 2. the install
    def install(self, kit: Path) -> bool:
        constraints = kit / "image-constraints.txt"
        base = [self.python, "-m", "pip", "install", "--no-index", "--find-links", str(kit), "--no-cache-dir",
                "--disable-pip-version-check"]
        code = self.run("install", base + ["-c", str(constraints), INSTALL_TARGET], min(INSTALL_SECONDS, self.left()))
        if code != 0:
            site = self.work / "site"
            self.say(f"install: pip could not install into the image's environment; falling back to --target {site}")
            code = self.run("install --target", [self.python, "-m", "pip", "install", "--no-index", "--no-deps",
                                                 "--target", str(site), "--no-cache-dir", *map(str, sorted(kit.glob("*.whl")))],
                            min(INSTALL_SECONDS, self.left()))
            if code != 0:
                return False
            self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), self.env.get("PYTHONPATH")]))
        # the installed package, from outside the tree (so the source tree cannot stand in for it)
        probe = self.run("import", [self.python, "-c", "import dsa_train, dsa_kernels, deepspeed, megatron.core, hydra; "
                                    "print(dsa_train.__file__)"], 120, cwd=self.work)
        return probe == 0

    # -- 3. the steps
    def gpu_check(self, name: str, only: list[str], seconds: float) -> None:
        out = self.work / name.replace(":", "-").replace(",", "-")
        flags = ["--device", self.device] + (["--small"] if self.small else [])
        self.run(name, self.dsa_train + ["gpu-check", "--only", *only, "--out", str(out), "--budget-s",
                                         str(int(max(seconds - 20, 10))), *flags], seconds, cwd=self.work)
        self.reports.append((name, out / "report.md"))
        self.reports.append((name, out / "report.json"))

    def bench(self, name: str, script: str, seconds: float) -> None:
        path = REPO / "benchmarks" / script
        if not path.is_file():
            self.skip(name, f"no benchmarks/{script}")
            return
        out = self.work / f"{Path(script).stem}.json"
        extra = ["--small"] if self.small else []
        env = self.kernel_env()
        # every benchmark's child measures under --budget: the step's time box less 20 s for the start and the write
        extra += ["--budget", str(int(max(seconds - 20, 10)))]
        if script == "kernel_variants.py" and self.small:
            extra += ["--only", "topk"]
        self.run(name, [self.python, str(path), str(out), *extra], seconds, cwd=self.work, env=env)
        self.reports.append((name, out))

    def kernel_env(self) -> dict:
        """The steps' environment; on the CPU (the rehearsal) with the Triton interpreter."""
        return dict(self.env, TRITON_INTERPRET="1") if self.device == "cpu" else self.env

    def gpu_tests(self, name: str, files: list[str], seconds: float) -> None:
        """The `gpu`-marked tests of tests/FILE...: run from outside the tree with `python -P` (no
        working directory on sys.path) and `--import-mode=importlib` (no rootdir inserted), so they
        import the installed dsa_train / dsa_kernels; the tree gives only the tests and the config."""
        xml = self.work / ("pytest-" + "-".join(Path(f).stem for f in files) + ".xml")
        env = self.kernel_env()
        cmd = [self.python, "-P", "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "--import-mode=importlib",
               "--rootdir", str(REPO), "-c", str(REPO / "pyproject.toml"), f"--junitxml={xml}",
               *(str(REPO / "tests" / f) for f in files)]
        self.run(name, cmd, seconds, cwd=self.work, env=env)
        self.reports.append((name, xml))

    def step(self, spec: str) -> None:
        if spec.startswith("env:"):
            key, sep, value = spec[4:].partition("=")
            if not key or not sep:
                raise SessionError(f"--step {spec!r}: write env:NAME=VALUE")
            self.env[key] = value
            self.say(f"env: {key}={value} for the steps after this")
            return
        name, _, secs = spec.partition("=")
        kind, _, arg = name.partition(":")
        seconds = float(secs) if secs else STEP_SECONDS.get(kind, 120)
        if self.small:
            seconds = max(seconds, 600)  # the CPU rehearsal has no lease to respect, only the interpreter's pace
        if self.left() < min(seconds, 60) + TAIL_SECONDS:
            self.skip(name, f"{self.left():.0f} s left of the session budget")
            return
        seconds = min(seconds, self.left() - TAIL_SECONDS)
        if kind == "e2e":
            self.gpu_check(name, ["environment", "end-to-end", "nccl"], seconds)
        elif kind in ("speed", "correctness"):
            self.gpu_check(name, [kind], seconds)
        elif kind == "variants":
            self.bench(name, "kernel_variants.py", seconds)
        elif kind == "check":
            self.gpu_check(name, [p for p in arg.split(",") if p], seconds)
        elif kind == "bench":
            self.bench(name, arg, seconds)
        elif kind == "pytest":
            self.gpu_tests(name, arg.split(","), seconds)
        else:
            raise SessionError(f"--step {spec!r}: unknown step; {STEP_USAGE}")

    # -- the outputs
    def finish(self) -> None:
        lines = ["# GPU session", "", f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, "
                 f"{time.monotonic() - self.t0:.0f} s in all; device {self.device}{' (--small)' if self.small else ''}",
                 "", "| step | status | seconds | time box | last line |", "|---|---|---|---|---|"]
        for r in self.rows:
            lines.append(f"| {r['step']} | {r['status']} | {r['seconds']} | {r['box_s']:.0f} | "
                         f"{r['last_line'].replace('|', '/')} |")
        lines += ["", "Commands:", ""] + [f"- `{r['step']}`: `{r['command']}`" for r in self.rows if r["command"]]
        (self.out / "session.md").write_text("\n".join(lines) + "\n")
        (self.out / "session.json").unlink(missing_ok=True)
        with tarfile.open(self.out / "reports.tar.gz", "w:gz") as tar:
            tar.add(self.work, arcname="reports", filter=lambda ti: None if "/site" in ti.name else ti)
        fixed = {"session.md", "session.log", "image.txt", "reports.tar.gz"}
        room = MAX_FILES - len(fixed)
        copied = 0
        for name, path in self.reports:
            if copied >= room:
                break
            if path.is_file() and path.stat().st_size < 8 * 2**20:
                target = self.out / f"{name.replace(':', '-').replace(',', '-')}{''.join(path.suffixes)}"
                shutil.copy2(path, target)
                copied += 1
        self.log.close()
        shutil.rmtree(self.work, ignore_errors=True)
        files = sorted(p.name for p in self.out.iterdir())
        assert len(files) <= MAX_FILES, files
        print(f"{ME}: {len(files)} files in {self.out}: {', '.join(files)}", flush=True)


def run(args) -> int:
    steps = read_plan(args.plan) if args.plan else list(args.step or DEFAULT_STEPS)
    for spec in steps:
        check_step(spec)
    kit = args.kit.resolve()
    if not (kit / "image-constraints.txt").is_file():
        raise SessionError(f"--kit {args.kit}: no image-constraints.txt there; build the kit with "
                           "`python scripts/gpu_session.py prepare` on a connected machine and carry it")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    leftovers = [p.name for p in out.iterdir()]
    if leftovers:
        raise SessionError(f"--out {args.out} is not empty ({leftovers[0]} ...): give an empty folder")
    session = Session(out, args.budget_s, args.python, args.small, args.device)
    try:
        session.image()
        if not session.install(kit):
            session.say("install failed: no step can run (session.log has pip's output)")
        else:
            for spec in steps:
                session.step(spec)
    finally:
        session.finish()
    return 0 if all(r["status"] in ("ok", "skipped") for r in session.rows) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_session.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    pp = sub.add_parser("prepare", help="on a connected machine: build the kit (a wheelhouse of what the image lacks)")
    pp.add_argument("--kit", type=Path, default=REPO / ".gpu-kit")
    pp.add_argument("--image", type=Path, default=DEFAULT_IMAGE, help="the image's pip list --format=freeze")
    pp.add_argument("--extras", default="", help="dsa-train extras in the kit (default: none, the core)")
    pp.add_argument("--limit-mib", type=float, default=KIT_LIMIT_MIB)
    pp.add_argument("--probe-flags", default=None,
                    help="the image's make_wheelhouse.py --probe output (default: the image file's '# probe:' line)")
    ri = sub.add_parser("record-image", help="rewrite the image list from a session's image.txt")
    ri.add_argument("session_image", type=Path)
    ri.add_argument("--image", type=Path, default=DEFAULT_IMAGE)
    pr = sub.add_parser("run", help="on the GPU machine: install the kit offline, then run the steps")
    pr.add_argument("--kit", type=Path, default=REPO / ".gpu-kit")
    pr.add_argument("--out", type=Path, required=True)
    pr.add_argument("--budget-s", type=float, default=540.0, help="the whole session's seconds (install included)")
    pr.add_argument("--python", default=sys.executable, help="the image's Python (default: this one)")
    pr.add_argument("--step", action="append", help=f"steps in order (default: {' '.join(DEFAULT_STEPS)})")
    pr.add_argument("--plan", type=Path, default=None, help="a file of steps, one per line (# comments); "
                    "instead of --step (scripts/gpu-next.txt: the next session's)")
    pr.add_argument("--small", action="store_true", help="tiny shapes: the CPU rehearsal")
    pr.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = p.parse_args(argv)
    if args.command == "run" and args.plan and args.step:
        p.error("give --step or --plan, not both")
    try:
        if args.command == "record-image":
            n = record_image(args.session_image, args.image)
            print(f"{ME}: {args.image}: {n} packages of the image")
            return 0
        if args.command == "prepare":
            s = prepare(args.kit.resolve(), args.image, args.extras, args.limit_mib,
                        shlex.split(args.probe_flags) if args.probe_flags else None)
            print(f"{ME}: kit {s['kit']}: {len(s['wheels'])} wheels, {s['kit_mib']:.1f} MiB; with the working tree "
                  f"({s['tree_mib']:.1f} MiB) {s['total_mib']:.1f} MiB of {args.limit_mib:.0f}")
            return 0
        return run(args)
    except SessionError as err:
        print(f"{ME}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
