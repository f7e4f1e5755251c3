"""`dsa-train kernels report --arch sm_90a [--json]`: compile every kernel the dispatchers can
launch, at the 671B shapes and the block sizes the launchers pick there, for a GPU architecture,
on a machine without a GPU.

Per kernel: Triton compiles the launch (`triton.compile(ASTSource(fn, signature, constexprs,
attrs), target=GPUTarget("cuda", cap, 32), options=...)`, with the argument specialization the
JIT launcher would apply: 16-byte-divisible pointers and integers, integer 1 as a constant);
then Triton's bundled ptxas (`-v`, for sm_90a: `--gpu-name=sm_90a`) assembles the PTX and
reports registers and spill bytes. Shared memory is Triton's dynamic allocation (its
metadata) plus any static shared memory ptxas reports; wgmma is the number of
`wgmma.mma_async` instructions in the PTX.

Gate (tests/test_kernels_compile.py): no compile error, no spill, shared memory <= 227 KB
(H100's per-block limit), and every attention kernel uses wgmma on sm_90a.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# name -> compute capability; Triton's NVIDIA backend appends "a" for >= 90 (sm_90a, sm_100a)
ARCHES = {"sm_80": 80, "sm_90a": 90, "sm_100": 100}
SMEM_LIMIT = {80: 163 * 1024, 90: 227 * 1024, 100: 227 * 1024}  # max dynamic shared memory per block


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


def _ptxas_stats(ptx: str, cap: int) -> dict:
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    ptxas = get_ptxas(cap).path
    arch = sm_arch_from_capability(cap)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        proc = subprocess.run([ptxas, "-v", "--regAllocOptLevel=2", f"--gpu-name={arch}", str(src),
                               "-o", str(Path(tmp) / "k.o")], capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        return {"error": f"ptxas -arch={arch} failed: " + " | ".join(log.strip().splitlines()[-3:])}
    regs = re.search(r"Used (\d+) registers", log)
    spill_st = re.search(r"(\d+) bytes spill stores", log)
    spill_ld = re.search(r"(\d+) bytes spill loads", log)
    smem = re.search(r"(\d+) bytes smem", log)
    return {
        "registers": int(regs.group(1)) if regs else None,
        "spill_bytes": (int(spill_st.group(1)) if spill_st else 0) + (int(spill_ld.group(1)) if spill_ld else 0),
        "static_smem": int(smem.group(1)) if smem else 0,
    }


def compile_case(case, cap: int) -> dict:
    """Compile one registered kernel case for compute capability `cap` -> one report row."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    row = {"op": case.op, "kernel": case.kernel_name, "config": case.config, "registers": None,
           "spill_bytes": None, "shared_bytes": None, "wgmma": None, "error": None}
    t0 = time.perf_counter()
    try:
        signature, constexprs, attrs = _specialize(case.launch)
        src = ASTSource(case.launch.kernel, signature, constexprs, attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", cap, 32), options=case.launch.options())
    except Exception as err:  # a compile error is a report row, not a crash
        # Triton's CompilationError quotes the source; keep its position and its last lines (the cause)
        lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
        where = [line for line in lines[:1] if line.startswith("at ")]
        row["error"] = f"{type(err).__name__}: " + " | ".join(where + lines[-2:])
        return row
    ptx = compiled.asm["ptx"]
    stats = _ptxas_stats(ptx, cap)
    if "error" in stats:
        row["error"] = stats["error"]
        return row
    row.update(registers=stats["registers"], spill_bytes=stats["spill_bytes"],
               shared_bytes=int(compiled.metadata.shared) + stats["static_smem"],
               wgmma=len(re.findall(r"wgmma\.mma_async", ptx)))
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def gate_failures(row: dict, cap: int, attention: bool) -> list[str]:
    """The gate's verdict on one row: empty when the kernel passes."""
    fails = []
    if row["error"]:
        return [f"does not compile: {row['error']}"]
    if row["spill_bytes"]:
        fails.append(f"spills {row['spill_bytes']} bytes")
    if row["shared_bytes"] > SMEM_LIMIT[cap]:
        fails.append(f"needs {row['shared_bytes']} B shared memory > {SMEM_LIMIT[cap]} B")
    if cap == 90 and attention and not row["wgmma"]:
        fails.append("attention kernel without wgmma")
    return fails


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

    cap = ARCHES[arch]
    rows = []
    for case in cases(ops):
        row = compile_case(case, cap)
        row["gate"] = gate_failures(row, cap, case.attention)
        rows.append(row)
    return rows


def _table(rows: list[dict]) -> str:
    head = ["op", "kernel", "config", "registers", "spill_bytes", "shared_bytes", "wgmma", "error"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r[k]) if r[k] is not None else "—" for k in head]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="dsa-train kernels",
        description="Kernel tools. `report`: compile every DSA kernel at the 671B shapes for a GPU "
                    "architecture (no GPU needed) and print registers, spills, shared memory, wgmma.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    rep = sub.add_parser("report", help="compile report for a GPU architecture")
    rep.add_argument("--arch", default="sm_90a", choices=sorted(ARCHES),
                     help="target architecture (default sm_90a: H100/H200)")
    rep.add_argument("--op", action="append", dest="ops", metavar="OP",
                     help="only this op (repeatable); default: every registered op")
    rep.add_argument("--json", action="store_true",
                     help="also print the rows as a JSON list on the last line")
    args = parser.parse_args(argv)

    try:
        import triton  # noqa: F401
    except Exception as err:
        print(f"dsa-train kernels report: triton is not importable ({err}); install triton>=3.2", file=sys.stderr)
        return 2
    have = supported_arches()
    if args.arch not in have:
        print(f"dsa-train kernels report: the installed Triton cannot target {args.arch}; "
              f"it supports {', '.join(have) or 'none'}", file=sys.stderr)
        return 2
    from .registry import OPS, registered_ops

    if args.ops:
        unknown = [o for o in args.ops if o not in OPS]
        if unknown:
            print(f"dsa-train kernels report: unknown op {unknown[0]!r}; ops: {', '.join(OPS)}", file=sys.stderr)
            return 2
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        # under the interpreter @triton.jit gives interpreted functions, which cannot be compiled:
        # run the report in a fresh process without it
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        cmd = [sys.executable, "-m", "dsa_kernels.compile_report", *(sys.argv[1:] if argv is None else argv)]
        return subprocess.run(cmd, env=env).returncode

    t0 = time.perf_counter()
    rows = report(args.arch, args.ops)
    print(f"# dsa-train kernels report --arch {args.arch}: {len(rows)} kernels, 671B shapes, "
          f"{time.perf_counter() - t0:.0f} s; ops registered: {', '.join(registered_ops())}")
    print(_table(rows))
    failing = [(r, f) for r in rows for f in r["gate"]]
    for r, f in failing:
        print(f"GATE FAIL {r['op']} {r['kernel']}: {f}")
    if not failing:
        wgmma = "attention kernels use wgmma" if ARCHES[args.arch] == 90 else "(wgmma is checked on sm_90a only)"
        print(f"gate: every kernel compiles, none spills, shared memory within the limit, {wgmma}")
    if args.json:
        keys = ("op", "kernel", "config", "registers", "spill_bytes", "shared_bytes", "wgmma", "error")
        print(json.dumps([{k: r[k] for k in keys} for r in rows]))
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
