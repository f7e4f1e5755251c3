"""`dsa-train kernels report --arch sm_90a [--triton 3.6.0] [--op OP] [--json]`: compile every
kernel the dispatchers can launch, at the 671B shapes and the block sizes the launchers pick there,
for a GPU architecture, on a machine without a GPU, with a given Triton. `dsa-train kernels gate`:
the same for every (Triton, arch) pair of the gate (`GATE_TARGETS`), in parallel, one verdict each.

Per kernel: Triton compiles the launch (`triton.compile(ASTSource(fn, signature, constexprs,
attrs), target=GPUTarget("cuda", cap, 32), options=...)`, with the argument specialization the
JIT launcher would apply: 16-byte-divisible pointers and integers, integer 1 as a constant),
which ends with Triton's bundled ptxas assembling the cubin, with the flags that Triton version
uses on a GPU (3.9 adds `--regAllocOptLevel=2`, 3.6 does not); ptxas's `-v` log, which Triton
prints under `knobs.nvidia.dump_ptxas_log`, gives registers and spill bytes (kept per kernel in
TRITON_CACHE_DIR/dsa_ptxas_stats for reruns that Triton's cache answers without ptxas). Shared
memory is Triton's dynamic allocation (its metadata) plus any static shared memory ptxas reports. Tensor-core instructions are counted in
the PTX: `wgmma.mma_async` (Hopper's warpgroup MMA), `mma.sync` (the warp-level MMA of
Ampere, also valid on Hopper and Blackwell) and `tcgen05.mma` (Blackwell's).

Triton versions: `SUPPORTED_TRITON` is the supported range, (oldest, newest). `--triton VERSION`
compiles with that Triton: the installed one if it is that version, else a side install
(`pip install --target DIR --no-deps triton==VERSION`, made once, in `side_triton_dir`) put
first on the PYTHONPATH of a fresh process. Every row records the Triton that compiled it.

Gate (`gate_failures`; `tests/test_kernels_compile.py` runs it in `make test` for every
(Triton, arch) pair of `GATE_TARGETS`, through `run_reports`, as `dsa-train kernels gate` does): the kernel compiles, does not spill, fits in the
per-block shared memory of the architecture (a spill listed in `ALLOWED_SPILLS`, with the GPU
measurement that earned it, passes up to its listed bytes), and, when its work is dot products
(`KernelCase.dots`: every kernel but the radix top-k selection), uses the architecture's
tensor-core instructions: wgmma on sm_90a (mma.sync alone does not count there), tcgen05.mma or
mma.sync on sm_100, mma.sync on sm_80.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import analysis

# name -> compute capability; Triton's NVIDIA backend appends "a" for >= 90 (sm_90a, sm_100a)
ARCHES = {"sm_80": 80, "sm_90a": 90, "sm_100": 100}
SMEM_LIMIT = {80: 163 * 1024, 90: 227 * 1024, 100: 227 * 1024}  # max dynamic shared memory per block

# The supported Triton versions, (oldest, newest): the oldest is what torch 2.11 pins (the Triton of
# GPU images built on torch 2.11), the newest what the development venv installs
# (constraints-cpu.txt). pyproject's floor `triton>=` is the oldest.
SUPPORTED_TRITON = ("3.6.0", "3.9.0")
OLDEST_TRITON, NEWEST_TRITON = SUPPORTED_TRITON
# The compile gate of `make test` (tests/test_kernels_compile.py): (Triton, arch) pairs.
GATE_TARGETS = ((OLDEST_TRITON, "sm_90a"), (NEWEST_TRITON, "sm_90a"), (NEWEST_TRITON, "sm_100"))

# Tensor-core instructions counted in the PTX: row key -> PTX instruction.
TENSOR_CORE_PTX = {"wgmma": "wgmma.mma_async", "mma_sync": "mma.sync", "tcgen05_mma": "tcgen05.mma"}
_TENSOR_CORE_RE = {key: re.compile(rf"\b{re.escape(ins)}\b") for key, ins in TENSOR_CORE_PTX.items()}
# Per compute capability, the instructions of which a dot-product kernel needs at least one.
# sm_90a: wgmma; a kernel whose dots all fall back to mma.sync leaves Hopper's warpgroup MMA unused.
# sm_100: wgmma is sm_90a-only; Triton 3.9 emits tcgen05.mma, and mma.sync for some dot shapes.
# Spills the gate allows, each earned by a GPU measurement (docs/kernels.md "Measured on a GPU"):
# (kernel, config label prefix, Triton major.minor, compute capability) -> the most spill bytes
# (ptxas stores + loads) allowed. The split sparse-MLA backward at 32-key tiles and 3 stages ran
# 478 ms against the 16-key default's 709-727 ms on an H200 (Triton 3.6, T = 32K, k = 2048);
# ptxas: 255 registers, 396 B spilled (the GPU's Triton reported n_spills 46: local memory / 4).
ALLOWED_SPILLS = {
    ("_sparse_mla_bwd_kernel", "autotune config split-k32-s3 ", "3.6", 90): 396,
}


def allowed_spill(row: dict, cap: int) -> int:
    """The spill bytes `ALLOWED_SPILLS` grants this row's (kernel, config, Triton, arch); 0 if none."""
    minor = ".".join(str(row.get("triton", "")).split(".")[:2])
    return max([b for (kernel, prefix, version, c), b in ALLOWED_SPILLS.items()
                if row["kernel"] == kernel and row["config"].startswith(prefix) and version == minor and c == cap],
               default=0)


TENSOR_CORE_REQUIRED = {80: ("mma_sync",), 90: ("wgmma",), 100: ("tcgen05_mma", "mma_sync")}

# The keys of a report row, in the JSON and table order (`gate`: the gate's failures, one string each).
ROW_KEYS = ("op", "kernel", "language", "config", "triton", "registers", "spill_bytes", "shared_bytes",
            *TENSOR_CORE_PTX, "global_writes", "dots", "error", "gate", "shapes", "replication", "occupancy", "analysis")


class SideTritonError(RuntimeError):
    """A side install of Triton could not be made or used (the message is one line)."""


def _base_version(version: str) -> str:
    return version.split("+", 1)[0]


def side_triton_dir(version: str) -> Path:
    """Where the side install of Triton `version` lives: `$DSA_TRITON_SIDE_DIR/triton-VERSION`,
    by default `<venv>/side-triton/triton-VERSION` (under `sys.prefix`: made for this Python,
    reused by every later run, removed with the venv)."""
    root = os.environ.get("DSA_TRITON_SIDE_DIR") or str(Path(sys.prefix) / "side-triton")
    return Path(root) / f"triton-{version}"


def _side_triton_ready(path: Path, version: str) -> bool:
    return (path / "triton" / "__init__.py").is_file() and (path / f"triton-{version}.dist-info").is_dir()


def _pip_install_cmd(version: str, target: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
            "--no-deps", "--target", str(target), f"triton=={version}"]


def ensure_side_triton(version: str) -> Path:
    """The directory holding Triton `version` (to put first on PYTHONPATH), installed on first use
    with pip (`--target`, `--no-deps`; from pip's cache this takes seconds). Concurrent callers are
    safe: each installs into its own temporary directory and the first rename wins.
    Raises SideTritonError (one line) when pip fails."""
    path = side_triton_dir(version)
    if _side_triton_ready(path, version):
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".triton-{version}.", dir=path.parent))
    except OSError as err:
        raise SideTritonError(f"cannot create {path.parent} for the side install of Triton {version} ({err}); "
                              f"set DSA_TRITON_SIDE_DIR to a writable directory") from None
    try:
        cmd = _pip_install_cmd(version, tmp)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0 or not _side_triton_ready(tmp, version):
            tail = " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-2:]) or f"exit code {proc.returncode}"
            raise SideTritonError(f"side install of Triton {version} into {path} failed: `pip install --target DIR "
                                  f"--no-deps triton=={version}` said: {tail}")
        try:
            tmp.rename(path)
        except OSError:  # another process installed it first
            if not _side_triton_ready(path, version):
                raise SideTritonError(f"{path} exists but holds no Triton {version}: remove it and rerun") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _specialize(launch):
    """(signature, constexprs, attrs) as Triton's JIT launcher would specialize `launch.args`."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    fn = launch.kernel
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(fn.arg_names, fn.params)):
        if name not in launch.args:
            raise TypeError(f"{fn.__name__}: launch plan does not set {name}")
        value = launch.args[name]
        if param.is_constexpr:
            signature[name] = "constexpr"
            constexprs[name] = value
            continue
        specialize = not param.do_not_specialize
        align = not param.do_not_specialize_on_alignment
        ty, spec = native_specialize_impl(BaseBackend, value, False, specialize, align)
        if ty == "constexpr":  # an integer 1 (or None) is folded into the kernel
            signature[name] = "constexpr"
            constexprs[name] = spec
            continue
        signature[name] = ty
        if spec == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


def _parse_ptxas_log(log: str) -> dict | None:
    """Registers, spill bytes (stores + loads) and static shared memory from `ptxas -v` output;
    None when the log has no statistics."""
    regs = re.search(r"Used (\d+) registers", log)
    if not regs:
        return None
    spill_st = re.search(r"(\d+) bytes spill stores", log)
    spill_ld = re.search(r"(\d+) bytes spill loads", log)
    smem = re.search(r"(\d+) bytes smem", log)
    return {
        "registers": int(regs.group(1)),
        "spill_bytes": (int(spill_st.group(1)) if spill_st else 0) + (int(spill_ld.group(1)) if spill_ld else 0),
        "static_smem": int(smem.group(1)) if smem else 0,
    }


def _stats_path(compiled_hash: str) -> Path:
    """Where the ptxas statistics of one compiled kernel are kept: Triton's cache folder
    (TRITON_CACHE_DIR, default ~/.triton/cache) / dsa_ptxas_stats / <Triton's cache key>.json.
    On a rerun Triton's cache answers the compile without running ptxas; this file answers the
    statistics."""
    root = os.environ.get("TRITON_CACHE_DIR") or str(Path.home() / ".triton" / "cache")
    return Path(root) / "dsa_ptxas_stats" / f"{compiled_hash}.json"


def _load_stats(compiled_hash: str) -> dict | None:
    try:
        return json.loads(_stats_path(compiled_hash).read_text())
    except (OSError, ValueError):
        return None


def _store_stats(compiled_hash: str, stats: dict) -> None:
    path = _stats_path(compiled_hash)
    try:  # a failed write only costs the next run a recompile
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_suffix(f".{os.getpid()}.part")
        part.write_text(json.dumps(stats))
        os.replace(part, path)
    except OSError:
        pass


def _compile_logged(src, target, options: dict, always: bool):
    """triton.compile with Triton's own `ptxas -v` log captured (knobs.nvidia.dump_ptxas_log: Triton
    prints it when it assembles the cubin, with the flags this Triton version uses on a GPU);
    `always` bypasses Triton's cache. -> (compiled kernel, captured stdout)."""
    import triton
    from triton import knobs

    saved = knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile
    out = io.StringIO()
    try:
        knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = True, always
        with contextlib.redirect_stdout(out):
            compiled = triton.compile(src, target=target, options=options)
    finally:
        knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = saved
    return compiled, out.getvalue()


def kernel_language(kernel) -> str:
    """"Gluon" for a `@gluon.jit` kernel (`triton.experimental.gluon`: explicit layouts, warp
    specialization), else "Triton"."""
    is_gluon = getattr(kernel, "is_gluon", None)
    return "Gluon" if callable(is_gluon) and is_gluon() else "Triton"


def _ast_source(kernel):
    """The compiler front end of a kernel: Gluon's (`GluonASTSource`) or Triton's `ASTSource`."""
    if kernel_language(kernel) == "Gluon":
        from triton.experimental.gluon._runtime import GluonASTSource

        return GluonASTSource
    from triton.compiler import ASTSource

    return ASTSource


def compile_case(case, cap: int) -> dict:
    """Compile one registered kernel case for compute capability `cap` -> one report row."""
    import triton
    from triton.backends.compiler import GPUTarget

    row = dict.fromkeys(ROW_KEYS)
    row.update(op=case.op, kernel=case.kernel_name, language=kernel_language(case.launch.kernel),
               config=case.config, triton=triton.__version__,
               dots=case.dots, gate=[], analysis=analysis.as_dict(case.work))
    t0 = time.perf_counter()
    try:
        signature, constexprs, attrs = _specialize(case.launch)
        src = _ast_source(case.launch.kernel)(case.launch.kernel, signature, constexprs, attrs)
        target, options = GPUTarget("cuda", cap, 32), case.launch.options()
        compiled, log = _compile_logged(src, target, options, always=False)
        # ptxas ran (a cold Triton cache): its log; else the statistics kept from that run; else
        # (a Triton cache filled by another program) compile once more, bypassing the cache
        stats = _parse_ptxas_log(log) or _load_stats(compiled.hash)
        if stats is None:
            compiled, log = _compile_logged(src, target, options, always=True)
            stats = _parse_ptxas_log(log)
    except Exception as err:  # a compile error is a report row, not a crash
        # Triton's CompilationError quotes the source; keep its position and its last lines (the cause)
        lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
        where = [line for line in lines[:1] if line.startswith("at ")]
        row["error"] = f"{type(err).__name__}: " + " | ".join(where + lines[-2:])
        return row
    if stats is None:
        row["error"] = "Triton's ptxas log (TRITON_DUMP_PTXAS_LOG) has no register / spill statistics"
        return row
    _store_stats(compiled.hash, stats)
    ptx = compiled.asm["ptx"]
    row.update(registers=stats["registers"], spill_bytes=stats["spill_bytes"],
               shared_bytes=int(compiled.metadata.shared) + stats["static_smem"],
               **{key: len(pattern.findall(ptx)) for key, pattern in _TENSOR_CORE_RE.items()})
    row["global_writes"] = len(_GLOBAL_WRITE_RE.findall(ptx))
    row["shapes"] = analysis.instruction_shapes(ptx)
    row["replication"] = analysis.warpgroup_replication(compiled.asm.get("ttgir", ""))
    row["analysis"] = analysis.as_dict(case.work, replication=row["replication"]["ratio"])
    # the compiled kernel's warps: a warp-specialized Gluon kernel adds its worker partitions' warps to
    # the launch's num_warps (the Gluon score kernel: 4 + 4 + 4), all at the launch's register count
    warps = int(getattr(compiled.metadata, "num_warps", 0) or case.launch.num_warps)
    row["occupancy"] = analysis.occupancy(row["registers"], warps, row["shared_bytes"], cap)
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


# Instructions that write global memory (stores, atomics / reductions, TMA bulk copies): a kernel
# without any computes nothing observable (Triton 3.9 compiled a tensor-memory overflow on sm_100
# to a lone `trap`).
_GLOBAL_WRITE_RE = re.compile(r"\b(?:st\.global|atom\.global|red\.global|cp\.async\.bulk)\b")


def gate_failures(row: dict, cap: int, dots: bool) -> list[str]:
    """The gate's verdict on one row compiled for compute capability `cap`: empty when the kernel
    passes. `dots`: the kernel's work is dot products, so it must use tensor cores."""
    fails = []
    if row["error"]:
        return [f"does not compile: {row['error']}"]
    if row["spill_bytes"] > allowed_spill(row, cap):
        allowed = allowed_spill(row, cap)
        fails.append(f"spills {row['spill_bytes']} bytes" + (f" (allowed: {allowed}, ALLOWED_SPILLS)" if allowed else ""))
    if row.get("global_writes") == 0:
        fails.append("compiles to a kernel that writes no global memory (a lone trap?)")
    if row["shared_bytes"] > SMEM_LIMIT[cap]:
        fails.append(f"needs {row['shared_bytes']} B shared memory > {SMEM_LIMIT[cap]} B")
    required = TENSOR_CORE_REQUIRED[cap]
    if dots and not any(row[key] for key in required):
        counts = ", ".join(f"{TENSOR_CORE_PTX[k]} {row[k]}" for k in TENSOR_CORE_PTX)
        fails.append(f"dot-product kernel without {' or '.join(map(TENSOR_CORE_PTX.get, required))} "
                     f"on {_arch_name(cap)} (PTX: {counts})")
    return fails


def _arch_name(cap: int) -> str:
    return next(name for name, c in ARCHES.items() if c == cap)


def supported_arches() -> list[str]:
    try:
        from triton.backends.nvidia.compiler import CUDABackend
        from triton.backends.compiler import GPUTarget
    except Exception:
        return []
    out = []
    for name, cap in ARCHES.items():
        try:
            CUDABackend(GPUTarget("cuda", cap, 32))
            out.append(name)
        except Exception:
            pass
    return out


def report(arch: str, ops: list[str] | None = None) -> list[dict]:
    from .registry import cases

    from ._triton_common import planning_for

    cap = ARCHES[arch]
    rows = []
    with planning_for(cap):  # the launchers pick this architecture's block sizes
        built = cases(ops)
    for case in built:
        row = compile_case(case, cap)
        row["gate"] = gate_failures(row, cap, case.dots)
        rows.append(row)
    return rows


def _cell(key: str, value) -> str:
    if value is None:
        return "—"
    if key == "shapes":  # the tensor-core instruction shapes, most frequent first
        parts = [f"{kind} {shape} x{n}" for kind, counts in value.items() for shape, n in counts.items()]
        return ", ".join(parts) or "none"
    if key == "replication":  # FLOPs the wgmma dots issue / counted once (Triton's warp-group layout)
        return f"x{value['ratio']}" + (f" ({', '.join(value['replicated'])})" if value["replicated"] else "")
    if key == "occupancy":
        return f"{value['ctas']} CTA/SM ({value['limit']})"
    return str(value)


def _table(rows: list[dict]) -> str:
    """The text report: one row per kernel, then the analysis column (per token, at the 671B
    shapes) as one line per kernel that has one."""
    head = [k for k in ROW_KEYS if k not in ("triton", "gate", "analysis")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join(_cell(k, r.get(k)) for k in head) + " |")
    notes = [f"- {r['op']} `{r['kernel']}` ({r['config']}): {analysis.describe_dict(r['analysis'])}"
             for r in rows if r.get("analysis")]
    if notes:
        lines += ["", "analysis per token (formulas over each launch's block sizes; the TFLOPS are a roofline "
                  f"estimate on {analysis.H100['name']}, not a measurement):", *notes]
    return "\n".join(lines)


def run_reports(targets=GATE_TARGETS, ops: list[str] | None = None, timeout: float = 900) -> dict:
    """Run `report --arch ARCH --triton VERSION --json` for every (VERSION, ARCH) of `targets`, in
    parallel subprocesses, after side-installing the Triton versions that are not the installed one.
    Returns {(version, arch): {"returncode", "stdout", "stderr", "rows" (None without JSON),
    "seconds", "install_error" (one line; then the report did not run)}}."""
    try:
        import triton

        installed = _base_version(triton.__version__)
    except Exception:
        installed = None
    sides, install_errors = {}, {}  # version -> its side install's directory / why it could not be made
    for version in sorted({v for v, _ in targets} - {installed}):
        try:
            sides[version] = ensure_side_triton(version)
        except SideTritonError as err:
            install_errors[version] = str(err)
    op_args = [a for op in ops or [] for a in ("--op", op)]
    running, out = {}, {}
    for version, arch in targets:
        if version in install_errors:
            out[(version, arch)] = dict(returncode=None, stdout="", stderr="", rows=None, seconds=0.0,
                                        install_error=install_errors[version])
            continue
        cmd = [sys.executable, "-m", "dsa_kernels.compile_report", "report", "--arch", arch, "--triton", version,
               "--json", *op_args]
        # the side install goes straight onto the report's PYTHONPATH: it need not re-run itself
        env = _report_env(sides.get(version))
        running[(version, arch)] = (subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                     text=True, env=env), time.perf_counter())
    for target, (proc, t0) in running.items():
        stdout, stderr = proc.communicate(timeout=timeout)
        try:
            rows = json.loads(stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            rows = None
        out[target] = dict(returncode=proc.returncode, stdout=stdout, stderr=stderr, rows=rows,
                           seconds=time.perf_counter() - t0, install_error=None)
    return {t: out[t] for t in targets}


def _gate_main(ops: list[str] | None) -> int:
    """`dsa-train kernels gate`: the compile gate of `make test`, every pair of GATE_TARGETS."""
    t0 = time.perf_counter()
    results = run_reports(GATE_TARGETS, ops)
    worst = 0
    for (version, arch), res in results.items():
        if res["install_error"]:
            print(f"gate Triton {version} {arch}: NOT RUN: {res['install_error']}")
            worst = 2
            continue
        if res["rows"] is None:
            tail = " | ".join(res["stderr"].strip().splitlines()[-2:])
            print(f"gate Triton {version} {arch}: NOT RUN: the report exited {res['returncode']}: {tail}")
            worst = 2
            continue
        fails = [f"{r['op']} {r['kernel']} [{r['config']}]: {f}" for r in res["rows"] for f in r["gate"]]
        verdict = f"FAIL ({len(fails)})" if fails else "pass"
        print(f"gate Triton {version} {arch}: {verdict}, {len(res['rows'])} kernels, {res['seconds']:.0f} s")
        for f in fails:
            print(f"  {f}")
        worst = max(worst, 1 if fails else 0)
    print(f"# {len(results)} reports in parallel, {time.perf_counter() - t0:.0f} s")
    return worst


_REEXEC_MARK = "DSA_KERNELS_REPORT_SIDE_TRITON"  # set in the process re-run with a side install


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(
        prog="dsa-train kernels",
        description="Kernel tools. `report`: compile every DSA kernel at the 671B shapes for a GPU "
                    "architecture (no GPU needed) and print registers, spills, shared memory and "
                    "tensor-core instructions, with the compile gate's verdict. `gate`: the reports of "
                    "the compile gate (every supported Triton and architecture it covers), one verdict each.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    rep = sub.add_parser("report", help="compile report for a GPU architecture")
    rep.add_argument("--arch", default="sm_90a", choices=sorted(ARCHES),
                     help="target architecture (default sm_90a: H100/H200)")
    rep.add_argument("--triton", metavar="VERSION",
                     help=f"compile with this Triton ({' or '.join(SUPPORTED_TRITON)}; default: the installed "
                          f"one); another than the installed is side-installed once with pip into "
                          f"{side_triton_dir('VERSION')} (DSA_TRITON_SIDE_DIR replaces {side_triton_dir('VERSION').parent})")
    rep.add_argument("--op", action="append", dest="ops", metavar="OP",
                     help="only this op (repeatable); default: every registered op")
    rep.add_argument("--json", action="store_true",
                     help="also print the rows as a JSON list on the last line")
    gate_help = ("the compile gate of make test: a report for every (Triton, arch) of GATE_TARGETS ("
                 + ", ".join(f"{v} {a}" for v, a in GATE_TARGETS) + "), in parallel, Triton side-installed as needed")
    gate = sub.add_parser("gate", help=gate_help, description=gate_help)
    gate.add_argument("--op", action="append", dest="ops", metavar="OP",
                      help="only this op (repeatable); default: every registered op")
    args = parser.parse_args(argv)
    me = f"dsa-train kernels {args.cmd}"

    if getattr(args, "triton", None) is not None and args.triton not in SUPPORTED_TRITON:
        print(f"{me}: --triton {args.triton} is not a supported Triton; use {OLDEST_TRITON} (oldest) or "
              f"{NEWEST_TRITON} (newest), or leave it out to use the installed one", file=sys.stderr)
        return 2
    from .registry import OPS, registered_ops

    if args.ops:
        unknown = [o for o in args.ops if o not in OPS]
        if unknown:
            print(f"{me}: unknown op {unknown[0]!r}; ops: {', '.join(OPS)}", file=sys.stderr)
            return 2
    if args.cmd == "gate":
        return _gate_main(args.ops)
    try:
        import triton
    except Exception as err:
        if args.triton is None:
            print(f"{me}: triton is not importable ({err}); install triton>={OLDEST_TRITON} "
                  f"or pass --triton {OLDEST_TRITON}", file=sys.stderr)
            return 2
        triton = None
    have_version = getattr(triton, "__version__", None)
    if args.triton is not None and (have_version is None or _base_version(have_version) != args.triton):
        if os.environ.get(_REEXEC_MARK):  # the side install was on PYTHONPATH and still not imported
            print(f"{me}: asked for Triton {args.triton} (side install {os.environ[_REEXEC_MARK]}), "
                  f"but Python imported {have_version} from {getattr(triton, '__file__', None)}", file=sys.stderr)
            return 2
        try:
            side = ensure_side_triton(args.triton)
        except SideTritonError as err:
            print(f"{me}: {err}", file=sys.stderr)
            return 2
        return _rerun(argv, side)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        # under the interpreter @triton.jit gives interpreted functions, which cannot be compiled:
        # run the report in a fresh process without it
        return _rerun(argv)
    have = supported_arches()
    if args.arch not in have:
        print(f"{me}: Triton {have_version} cannot target {args.arch}; it supports {', '.join(have) or 'none'}",
              file=sys.stderr)
        return 2

    t0 = time.perf_counter()
    rows = report(args.arch, args.ops)
    where = Path(triton.__file__).parent
    print(f"# {me} --arch {args.arch}, Triton {have_version} ({where}): {len(rows)} kernels, 671B shapes, "
          f"{time.perf_counter() - t0:.0f} s; ops registered: {', '.join(registered_ops())}")
    print(_table(rows))
    failing = [(r, f) for r in rows for f in r["gate"]]
    for r, f in failing:
        print(f"GATE FAIL {r['op']} {r['kernel']}: {f}")
    if not failing:
        cores = " or ".join(map(TENSOR_CORE_PTX.get, TENSOR_CORE_REQUIRED[ARCHES[args.arch]]))
        allowed = [r for r in rows if r["spill_bytes"]]  # spills within ALLOWED_SPILLS
        listed = ", ".join(f"{r['kernel']} {r['spill_bytes']} B" for r in allowed)
        spills = "none spills" + (f" beyond ALLOWED_SPILLS ({listed})" if allowed else "")
        print(f"gate (Triton {have_version}, {args.arch}): every kernel compiles, {spills}, shared memory "
              f"within the limit, every dot-product kernel uses {cores}")
    if args.json:
        print(json.dumps([{k: r[k] for k in ROW_KEYS} for r in rows]))
    return 1 if failing else 0


def _report_env(side: Path | None = None) -> dict:
    """The environment of a report run in a fresh process: without TRITON_INTERPRET (compile, do
    not interpret); with `side` (a side install of Triton) first on PYTHONPATH and named in
    _REEXEC_MARK, so that the report imports that Triton and does not re-run itself."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if side is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(side), env.get("PYTHONPATH")) if p)
        env[_REEXEC_MARK] = str(side)
    return env


def _rerun(argv: list[str], side: Path | None = None) -> int:
    """Run this report again in a fresh process (`_report_env`)."""
    cmd = [sys.executable, "-m", "dsa_kernels.compile_report", *argv]
    return subprocess.run(cmd, env=_report_env(side)).returncode


if __name__ == "__main__":
    sys.exit(main())
