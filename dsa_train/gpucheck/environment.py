"""gpu-check sections `environment` and `compile`: what machine and software this is, and the
compile gate (`dsa_kernels.compile_report`) for the installed Triton and this GPU's architecture.

Versions are read from the installed distributions' metadata (importlib.metadata), so DeepSpeed,
megatron-core and the like are never imported here; "not installed" is information, not a failure.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import time

import torch

from .core import Check, Options, Outcome

# label in the report -> the distribution names it may be installed under (images differ: nightly
# torch ships Triton as pytorch-triton)
PACKAGES = {"torch": ("torch",), "Triton": ("triton", "pytorch-triton"), "DeepSpeed": ("deepspeed",),
            "megatron-core": ("megatron-core", "megatron_core"), "FlashAttention": ("flash-attn", "flash_attn"),
            "dsa-train": ("dsa-train", "dsa_train")}
COMPILE_OPS = ("indexer_scores", "indexer_topk", "sparse_mla_fwd", "sparse_mla_bwd", "sparse_indexer_kl",
               "dense_indexer_kl", "dense_attention_fwd", "dense_attention_bwd")
# --small (the CPU run of the command, in make test) compiles one attention kernel: it exercises the
# gate's path here; the full gate for every op runs in make test already (tests/test_kernels_compile.py)
COMPILE_OPS_SMALL = ("sparse_mla_fwd",)
COMPILE_TIMEOUT_S = 420


@functools.lru_cache(maxsize=None)
def versions() -> dict:
    """Installed versions, read once (the runner rewrites its reports with them after every check)."""
    out = {}
    for label, dists in PACKAGES.items():
        out[label] = "not installed"
        for dist in dists:
            try:
                out[label] = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    out["python"] = platform.python_version()
    out["CUDA (torch built with)"] = torch.version.cuda or "none (CPU build)"
    return out


def _driver_version() -> str:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return "unknown (no nvidia-smi)"
    try:
        proc = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20)
        return proc.stdout.strip().splitlines()[0] if proc.returncode == 0 and proc.stdout.strip() else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=None)
def machine(device: str) -> dict:
    """The machine the checks run on, for the report's header."""
    if device == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return {"name": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
                "compute_capability": f"{props.major}.{props.minor}",
                "memory_gib": round(props.total_memory / 2**30, 1), "sms": props.multi_processor_count,
                "driver": _driver_version(), "host": platform.node()}
    return {"name": f"{_cpu_name()}, {os.cpu_count()} cores (CPU, Triton interpreter)", "gpus": 0,
            "host": platform.node()}


def arch_for(opts: Options) -> str | None:
    """The compile report's architecture for this GPU (the CPU run compiles for sm_90a)."""
    if opts.device != "cuda":
        return "sm_90a"
    major, _ = torch.cuda.get_device_capability(0)
    return {8: "sm_80", 9: "sm_90a", 10: "sm_100"}.get(major)


# ----------------------------------------------------------------------------- environment
def _machine_check(opts: Options) -> Outcome:
    m = machine(opts.device)
    if opts.device == "cuda":
        if not torch.cuda.is_available():
            return Outcome("fail", "torch sees no CUDA GPU (torch.cuda.is_available() is False)")
        if not torch.cuda.is_bf16_supported():
            return Outcome("fail", f"{m['name']} has no bf16 support: the kernels need sm_80 or newer", m)
        return Outcome("pass", f"{m['name']} (sm {m['compute_capability']}, {m['memory_gib']} GiB, "
                               f"{m['gpus']} GPU(s)), driver {m['driver']}", m)
    return Outcome("info", f"{m['name']}: kernels run under TRITON_INTERPRET=1, timings are not speeds", m)


def _versions_check(opts: Options) -> Outcome:
    v = versions()
    missing = [k for k in ("torch", "Triton") if v[k] == "not installed"]
    summary = ", ".join(f"{k} {val}" for k, val in v.items())
    if missing:
        return Outcome("fail", f"{' and '.join(missing)} not installed: {summary}", v)
    return Outcome("info", summary, v)


def _kernel_mode_check(opts: Options) -> Outcome:
    from dsa_kernels._triton_common import kernel_mode, triton_importable

    mode = kernel_mode()
    metrics = {"DSA_KERNELS": mode, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "0"),
               "triton_importable": triton_importable()}
    if not triton_importable():
        return Outcome("fail", "triton does not import: the Triton kernels cannot run", metrics)
    if mode == "ref":
        return Outcome("fail", "DSA_KERNELS=ref forces the PyTorch references: unset it (or set "
                               "DSA_KERNELS=triton) so the kernels are what is checked", metrics)
    if opts.device == "cuda" and metrics["TRITON_INTERPRET"] == "1":
        return Outcome("fail", "TRITON_INTERPRET=1 on a GPU run: the kernels would be interpreted; unset it", metrics)
    where = "compiled on the GPU" if opts.device == "cuda" else "interpreted on the CPU (TRITON_INTERPRET=1)"
    return Outcome("pass", f"DSA_KERNELS={mode}: the Triton kernels run {where}", metrics)


# ----------------------------------------------------------------------------- compile gate
_COMPILE_SCRIPT = """
import json, sys
from dsa_kernels.compile_report import report, supported_arches
arch, ops = sys.argv[1], sys.argv[2].split(",")
have = supported_arches()
if arch not in have:
    print("RESULT " + json.dumps({"unsupported": have}))
    raise SystemExit(0)
print("RESULT " + json.dumps({"rows": report(arch, ops)}))  # each row has its gate's failures
"""


class CompileGate:
    """Runs the compile report for every op once, one subprocess per op in parallel (without
    TRITON_INTERPRET: interpreted kernels cannot be compiled; a GPU host's cores compile the ops
    side by side), and answers the per-op checks from the rows."""

    def __init__(self, ops: tuple[str, ...]):
        self.ops = ops
        self.results: dict[str, dict] | None = None

    def _collect(self, arch: str, timeout: float) -> dict[str, dict]:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        parallel = max(1, min(len(self.ops), (os.cpu_count() or 2) // 2, 8))
        results: dict[str, dict] = {}
        pending = list(self.ops)
        running: dict[str, subprocess.Popen] = {}
        deadline = time.monotonic() + timeout
        while pending or running:
            while pending and len(running) < parallel:
                op = pending.pop(0)
                running[op] = subprocess.Popen([sys.executable, "-c", _COMPILE_SCRIPT, arch, op], env=env, text=True,
                                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for op, proc in list(running.items()):
                if proc.poll() is None and time.monotonic() < deadline:
                    continue
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
                    results[op] = {"error": f"the compile report took longer than {timeout:.0f} s"}
                else:
                    out, err = proc.communicate()
                    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
                    if lines:
                        results[op] = json.loads(lines[-1][7:])
                    else:
                        tail = (err.strip().splitlines() or ["no output"])[-1]
                        results[op] = {"error": f"the compile report exited {proc.returncode}: {tail[:300]}"}
                del running[op]
            time.sleep(0.05)
        return results

    def result(self, op: str, arch: str, opts: Options) -> dict:
        if self.results is None:
            from .budget import reserve_after

            timeout = min(COMPILE_TIMEOUT_S, max(60.0, opts.time_left() - reserve_after(opts, "compile")))
            self.results = self._collect(arch, timeout)
        return self.results[op]

    def check(self, op: str):
        def run(opts: Options) -> Outcome:
            import triton

            arch = arch_for(opts)
            if arch is None:
                return Outcome("skip", "no compile gate for this GPU's architecture (gate arches: sm_80, sm_90a, sm_100)")
            res = self.result(op, arch, opts)
            if "error" in res:
                return Outcome("fail", res["error"])
            if "unsupported" in res:
                return Outcome("fail", f"Triton {triton.__version__} cannot target {arch} (it supports "
                                       f"{', '.join(res['unsupported']) or 'none'})")
            rows = [r for r in res["rows"] if r["op"] == op]
            if not rows:
                return Outcome("fail", f"the compile report has no kernel for op {op} (not registered?)")
            fails = [f"{r['kernel']}: {f}" for r in rows for f in r["gate"]]
            metrics = {"arch": arch, "triton": triton.__version__, "kernels": rows}
            tensor_cores = ("wgmma",) if arch == "sm_90a" else ("tcgen05_mma", "mma_sync", "wgmma")

            def cores(r):
                return ", ".join(f"{r[k]} {k}" for k in tensor_cores if r.get(k) is not None)

            desc = "; ".join(f"{r['kernel']} {r.get('registers')} regs, {r.get('spill_bytes')} B spill, "
                             f"{r.get('shared_bytes')} B smem, {cores(r)}" for r in rows if not r.get("error"))
            if fails:
                return Outcome("fail", f"Triton {triton.__version__} {arch}: " + "; ".join(fails), metrics)
            return Outcome("pass", f"Triton {triton.__version__} {arch}: {desc}", metrics)

        return run


def checks(opts: Options) -> list[Check]:
    out = [
        Check("environment.machine", "environment", "GPU name, memory, compute capability, driver", _machine_check),
        Check("environment.versions", "environment", "torch, CUDA, Triton, DeepSpeed, megatron-core, FlashAttention",
              _versions_check),
        Check("environment.kernels", "environment", "DSA_KERNELS / TRITON_INTERPRET: the Triton path is what runs",
              _kernel_mode_check),
    ]
    ops = COMPILE_OPS_SMALL if opts.small else COMPILE_OPS
    gate = CompileGate(ops)
    arch = "sm_90a" if opts.device != "cuda" else "this GPU's arch"
    for op in ops:
        out.append(Check(f"compile.{op}", "compile", f"{op} at the 671B shapes for {arch}: no spill, smem within "
                                                     f"the limit, tensor cores in dot-product kernels", gate.check(op)))
    return out
