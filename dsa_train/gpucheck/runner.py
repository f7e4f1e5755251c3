"""`dsa-train gpu-check`: run every check in section order, one line each, and write
`report.json` and `report.md` into `--out` (docs/gpu-check.md).

    dsa-train gpu-check [--out DIR] [--dry-run] [--device cuda|cpu] [--small] [--only PREFIX ...]

A check that raises is one "fail" line (its traceback goes to report.json) and the rest still
run; a check that no longer fits the time budget is skipped with its reason. Exit 0 when nothing
failed, 1 when a check failed, 2 for a usage problem (no GPU for --device cuda, an unknown --only).
`--device cpu` (with --small) runs the Triton kernels under the interpreter: the command re-runs
itself with TRITON_INTERPRET=1 and DSA_KERNELS=triton set before triton is imported.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

from .budget import check_need_s
from .core import SECTIONS, Check, Options, Outcome

E2E_MODULE = "dsa_train.gpucheck.e2e"
DEFAULT_BUDGET_S = 600.0
LINE_WIDTH = 150


def collect(opts: Options) -> list[Check]:
    """Every check, in section order: the kernel checks here, end-to-end and NCCL from `e2e.py`."""
    from . import kernels

    found = kernels.checks(opts)
    try:
        e2e = importlib.import_module(E2E_MODULE)
    except ModuleNotFoundError as err:
        if err.name != E2E_MODULE:
            raise
        found.append(Check("end-to-end.missing", "end-to-end", "(this installation has no dsa_train.gpucheck.e2e)",
                           lambda o: Outcome("skip", "the end-to-end checks are not in this installation "
                                                     "(dsa_train/gpucheck/e2e.py missing)")))
    else:
        found += e2e.checks(opts)
    names = [c.name for c in found]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"gpu-check: duplicate check names {dup}")
    return sorted(found, key=lambda c: SECTIONS.index(c.section))  # stable: each module's order kept


def select(checks: list[Check], only: list[str] | None) -> list[Check]:
    """Checks whose section or name starts with one of the `only` prefixes (all when None)."""
    if not only:
        return checks
    unknown = [p for p in only if not any(c.section.startswith(p) or c.name.startswith(p) for c in checks)]
    if unknown:
        raise SystemExit(f"dsa-train gpu-check: --only {unknown[0]!r} matches no check; sections: "
                         f"{', '.join(SECTIONS)} (or a check name prefix from --dry-run)")
    return [c for c in checks if any(c.section.startswith(p) or c.name.startswith(p) for p in only)]


def _one_line(text: str) -> str:
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    return lines[0] if lines else ""


def _release_memory(opts: Options) -> None:
    gc.collect()
    if opts.device == "cuda":
        import torch

        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception:  # a broken CUDA context shows up in the next check's own failure
            pass


def run_checks(checks: list[Check], opts: Options, echo=print, after_each=None) -> list[dict]:
    """Run the checks in order -> one result dict each. Exceptions become one-line failures.
    after_each(results) runs after every check (the command rewrites its reports there, so a
    process killed by a crashing kernel still leaves the checks before it on disk)."""
    results = []
    cuda_lost = None  # the first check whose exception was a CUDA error (the context is sticky-broken)
    width = max((len(c.name) for c in checks), default=10)
    for i, check in enumerate(checks, 1):
        head = f"[{i:>2}/{len(checks)}] {check.name:<{width}}"
        if echo is print and sys.stdout.isatty():  # the running check's name, overwritten by its result
            print(head + " ...", end="\r", flush=True)
        t0 = time.monotonic()
        tb = None
        if opts.time_left() <= 0:
            outcome = Outcome("skip", "the time budget is spent (--budget-s)")
        else:
            try:
                outcome = check.run(opts)
                if not isinstance(outcome, Outcome):
                    raise TypeError(f"{check.name} returned {type(outcome).__name__}, not an Outcome")
            except Exception as err:  # one line here, the traceback in report.json
                summary = f"{type(err).__name__}: {_one_line(err)}"[:400]
                if cuda_lost is None and "CUDA error" in str(err):
                    cuda_lost = check.name
                elif cuda_lost is not None:
                    summary += f" [the CUDA context was lost in {cuda_lost}]"
                outcome = Outcome("fail", summary)
                tb = traceback.format_exc().strip().splitlines()[-25:]
        seconds = time.monotonic() - t0
        _release_memory(opts)
        line = f"{head} {outcome.status:<4} {seconds:6.1f} s  {outcome.summary}"
        echo(line if len(line) <= LINE_WIDTH else line[: LINE_WIDTH - 3] + "...", flush=True)
        results.append({"name": check.name, "section": check.section, "shapes": check.shapes,
                        "status": outcome.status, "summary": outcome.summary, "metrics": outcome.metrics,
                        "seconds": round(seconds, 2), **({"traceback": tb} if tb else {})})
        if after_each is not None:
            after_each(results)
    return results


# ----------------------------------------------------------------------------- reports
def _fmt(x, digits: int = 3) -> str:
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return "—" if x is None else str(x)


def markdown(report: dict) -> str:
    m, v = report["machine"], report["versions"]
    counts = ", ".join(f"{n} {k}" for k, n in report["counts"].items() if n)
    lines = [
        f"# dsa-train gpu-check: {m['name']}", "",
        f"- Machine: {m['name']}" + (f", compute capability {m['compute_capability']}, {m['memory_gib']} GiB, "
                                      f"driver {m['driver']}, {m['gpus']} GPU(s)" if m.get("gpus") else ""),
        "- Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
        f"- Command: `{report['command']}`",
        f"- Started {report['started_utc']} UTC, {report['seconds']:.0f} s; device {report['device']}"
        + (" (--small: tiny shapes, not a validation of the 671B shapes)" if report["small"] else ""),
        f"- Result: {counts}; exit {report['exit_code']}" if report.get("complete", True) else
        f"- INCOMPLETE: {len(report['checks'])} checks so far ({counts}); the run was still going or died "
        f"in the next check", "",
        "How to read this report: docs/gpu-check.md.", "",
        "## Checks", "", "| check | status | s | summary |", "|---|---|---|---|",
    ]
    for r in report["checks"]:
        lines.append(f"| {r['name']} | {r['status']} | {r['seconds']:.1f} | {r['summary'].replace('|', '/')} |")
    corr = [r for r in report["checks"] if r["section"] == "correctness" and "outputs" in r["metrics"]]
    if corr:
        lines += ["", "## Correctness", "",
                  "Error = max |kernel - fp32 reference| / max |reference| (KL value: relative error); "
                  "tolerances argued in docs/gpu-check.md.", "",
                  "| check | output | error | tolerance | rel. L2 | ok |", "|---|---|---|---|---|---|"]
        for r in corr:
            for name, o in r["metrics"]["outputs"].items():
                lines.append(f"| {r['name']} | {name} | {_fmt(o.get('err'))} | {_fmt(o.get('tol'))} | "
                             f"{_fmt(o.get('rel_l2'))} | {'yes' if o.get('ok') else '**NO**'} |")
    speed = [r for r in report["checks"] if r["section"] == "speed" and "timings" in r["metrics"]]
    if speed:
        lines += ["", "## Speed", ""]
        if report["device"] != "cuda":
            lines += ["Interpreter wall times on the CPU: not speeds, no TFLOPS.", ""]
        for r in speed:
            mt = r["metrics"]
            lines += [f"### {r['name']}", "", f"FLOPs: {mt['formula']}", "",
                      "| pass | impl | ms | TFLOPS | time / ours |", "|---|---|---|---|---|"]
            for t in mt["timings"]:
                if t.get("error"):
                    lines.append(f"| {t['pass']} | {t['impl']} | failed: {t['error'].replace('|', '/')} | — | — |")
                    continue
                lines.append(f"| {t['pass']} | {t['impl']} | {_fmt(t['ms'], 4)} | {_fmt(t.get('tflops'))} | "
                             f"{_fmt(t.get('time_over_ours'))} |")
            if mt.get("anchors"):
                lines += ["", "| pass | anchor | anchor TFLOPS | ours / anchor |", "|---|---|---|---|"]
                for a in mt["anchors"]:
                    lines.append(f"| {a['pass']} | {a['anchor']} | {a['anchor_tflops']:.0f} | "
                                 f"{a['ours_over_anchor']:.2f} |")
            lines.append("")
    e2e_rows = [r for r in report["checks"] if r["section"] == "end-to-end"]
    if e2e_rows:
        from . import e2e

        for r in e2e_rows:
            try:
                table = e2e.markdown_lines(r)
            except (KeyError, TypeError) as err:  # a report.json from another version of the check
                table = [f"(end-to-end figures of {r['name']} not tabulated: {type(err).__name__} {err})", ""]
            if table:
                lines += ["", *table]
    return "\n".join(lines).rstrip() + "\n"


def write_reports(results: list[dict], opts: Options, command: str, started: float, seconds: float,
                  complete: bool = True) -> dict:
    """report.json + report.md; complete=False while checks are still running (rewritten after
    each one)."""
    from .environment import machine, versions

    counts = {s: sum(r["status"] == s for r in results) for s in ("pass", "fail", "skip", "info")}
    report = {
        "complete": complete,
        "command": command,
        "started_utc": datetime.datetime.fromtimestamp(started, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "seconds": round(seconds, 1), "device": opts.device, "small": opts.small,
        "machine": machine(opts.device), "versions": versions(), "counts": counts,
        "exit_code": 1 if counts["fail"] else 0, "checks": results,
    }
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "report.md").write_text(markdown(report))
    return report


# ----------------------------------------------------------------------------- command
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dsa-train gpu-check",
        description="Prove and measure the CUDA path on one GPU: environment and compile gate, every kernel "
                    "against its fp32 reference at the 671B shapes (T = 4K, 32K, 128K), forward and backward "
                    "speed beside the anchors, end-to-end training with a resume, NCCL. Writes report.json and "
                    "report.md. See docs/gpu-check.md.")
    p.add_argument("--out", type=Path, default=Path("gpu-check"), help="report directory (default ./gpu-check)")
    p.add_argument("--dry-run", action="store_true", help="list every check in order with its shapes; run nothing")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default): one GPU; cpu: the Triton interpreter, with --small (tests the command)")
    p.add_argument("--small", action="store_true", help="tiny shapes (the CPU run of the command itself)")
    p.add_argument("--only", nargs="+", metavar="PREFIX",
                   help=f"only checks whose section or name starts with PREFIX ({', '.join(SECTIONS)}, "
                        f"or e.g. correctness.sparse_mla)")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                   help="time budget in seconds (default 600); checks that no longer fit are skipped")
    return p


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _reexec_interpreted(argv: list[str]) -> int | None:
    """--device cpu: the kernels must be interpreted, and TRITON_INTERPRET is read when triton
    decorates them, so run this command again in a process that has it (and DSA_KERNELS=triton)
    from the start. None when this process already is that process."""
    if os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("DSA_KERNELS") == "triton":
        return None
    env = dict(os.environ, TRITON_INTERPRET="1", DSA_KERNELS="triton")
    return subprocess.run([sys.executable, "-m", "dsa_train.gpucheck.runner", *argv], env=env).returncode


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = parser()
    args = p.parse_args(argv)
    if not args.budget_s > 0:
        p.error(f"--budget-s {args.budget_s:g}: must be > 0 seconds (default {DEFAULT_BUDGET_S:g}: the checks "
                "that do not fit are skipped)")
    opts = Options(device=args.device, small=args.small, out=args.out)
    if args.dry_run:
        checks = select(collect(opts), args.only)
        width = max(len(c.name) for c in checks)
        for c in checks:
            print(f"{c.section:<12} {c.name:<{width}}  {c.shapes}")
        print(f"{len(checks)} checks ({'--small, ' if args.small else ''}device {args.device}); nothing was run")
        return 0
    if args.device == "cpu" and not args.small:
        print("dsa-train gpu-check: --device cpu runs the kernels in the Triton interpreter, which cannot run the "
              "671B shapes; add --small (tiny shapes) or use --dry-run to list the checks", file=sys.stderr)
        return 2
    if args.device == "cpu":
        code = _reexec_interpreted(argv)
        if code is not None:
            return code
    elif not _cuda_available():
        import torch

        print(f"dsa-train gpu-check: no CUDA GPU visible to torch {torch.__version__} (CUDA build "
              f"{torch.version.cuda or 'none'}); on a machine without a GPU run `dsa-train gpu-check --device cpu "
              f"--small` (the command on tiny shapes) or `--dry-run` (the list of checks)", file=sys.stderr)
        return 2
    try:  # before minutes of checks: a report directory that cannot be written is one line now
        args.out.mkdir(parents=True, exist_ok=True)
        probe = args.out / ".gpu-check-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        print(f"dsa-train gpu-check: cannot write the reports into {args.out} ({err.strerror or err}); "
              f"pass a writable --out DIR", file=sys.stderr)
        return 2
    checks = select(collect(opts), args.only)
    opts.selected_sections = tuple(sorted({c.section for c in checks}))
    opts.selected_needs = {c.name: (c.section, check_need_s(c)) for c in checks}  # budget.py reserves for these
    started, t0 = time.time(), time.monotonic()
    opts.deadline = t0 + args.budget_s
    print(f"dsa-train gpu-check: {len(checks)} checks on {args.device}{' (--small)' if args.small else ''}, "
          f"budget {args.budget_s:.0f} s, reports in {args.out}/", flush=True)
    command = "dsa-train gpu-check " + " ".join(argv)
    results = run_checks(checks, opts, after_each=lambda done: write_reports(
        done, opts, command, started, time.monotonic() - t0, complete=False))
    report = write_reports(results, opts, command, started, time.monotonic() - t0)
    c = report["counts"]
    print(f"gpu-check: {c['pass']} pass, {c['fail']} fail, {c['skip']} skip, {c['info']} info in "
          f"{report['seconds']:.0f} s; {args.out / 'report.md'}, {args.out / 'report.json'}")
    return report["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
