"""The harness of the kernel-candidate benchmarks that run a kernel never run on a GPU before
(gluon_sparse_mla.py, gluon_index_scores.py): the measurements run in a child process under a
deadline, so a kernel that hangs (a producer / consumer handshake that never completes) is killed
and reported, not waited for; every row is written the moment it is measured, so the rows before
the hang survive it.

    main side:   run_child(__file__, args.out_json, child_argv, budget, small, "name") -> exit status
    child side:  c = Child(args, space); c.emit(kind=..., ...); c.time_ms(fn); c.deadline
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time


class Rows:
    """The child's rows: each a JSON line, printed and appended to the rows file at once."""

    def __init__(self, rows_file: str):
        self.rows_file = rows_file
        self.t_start = time.time()

    def emit(self, **row) -> None:
        row["t_s"] = round(time.time() - self.t_start, 1)
        line = json.dumps(row)
        print(line, flush=True)
        with open(self.rows_file, "a") as f:
            f.write(line + "\n")


def add_child_arguments(parser, budget: float) -> None:
    """The options every such script takes: --budget (seconds for the child's measurements), --small
    (tiny shapes on the CPU under the interpreter: a smoke run) and the child's own hidden ones."""
    import argparse

    parser.add_argument("--budget", type=float, default=budget, help="seconds for the child's measurements")
    parser.add_argument("--small", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1): a smoke run")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rows-file", default=None, help=argparse.SUPPRESS)


class Child:
    """What every child run starts with: its rows, its deadline, the gpu-check dims (`--small`: the tiny
    ones on the CPU), the device and capability (sm_90 assumed for the CPU smoke run), a first "env" row
    naming the machine and versions and the config space (`space(capability)` -> names), and TF32 off."""

    def __init__(self, args, space):
        import torch
        import triton

        from dsa_train.gpucheck.inputs import dims_for

        self.rows = Rows(args.rows_file)
        self.emit = self.rows.emit
        self.deadline = self.rows.t_start + args.budget
        self.d = dims_for(args.small)
        self.cuda = not args.small
        self.dev = "cuda" if self.cuda else "cpu"
        cap = torch.cuda.get_device_capability() if self.cuda else (9, 0)
        self.capability = cap[0] * 10 + cap[1]
        self.emit(kind="env", device=torch.cuda.get_device_name() if self.cuda else "cpu (interpreter smoke run)",
                  capability=f"sm_{self.capability}", triton=triton.__version__, torch=torch.__version__,
                  space=list(space(self.capability)))
        torch.backends.cuda.matmul.allow_tf32 = False

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def time_ms(self, fn) -> float:
        return time_ms(fn, self.cuda)


def time_ms(fn, cuda: bool) -> float:
    """Median of 5 after 2 warm-ups (CUDA events); one wall-clock call off the GPU (a smoke run)."""
    if not cuda:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import torch

    for _ in range(2):
        fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[2]


def run_child(script: str, out_json: str, child_argv: list[str], budget: float, small: bool, name: str) -> int:
    """Run `script --child --rows-file F --budget B *child_argv` with a deadline of budget + 5 s; write
    {"status", "seconds", "rows"} to out_json -> 0 (ok), 1 (the child failed or was killed), 2 (no
    CUDA GPU and not a --small run: nothing measured)."""
    import torch

    t0 = time.time()
    if not small and not torch.cuda.is_available():
        result = {"status": "no CUDA GPU: nothing measured", "rows": []}
        with open(out_json, "w") as f:
            json.dump(result, f, indent=1)
        print(result["status"], file=sys.stderr)
        return 2
    rows_file = out_json + ".rows"
    open(rows_file, "w").close()
    cmd = [sys.executable, os.path.abspath(script), out_json, "--child", "--rows-file", rows_file,
           "--budget", str(budget), *child_argv, *(["--small"] if small else [])]
    status = "ok"
    try:
        proc = subprocess.run(cmd, timeout=budget + 5, stdout=None, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
            status = f"child exited {proc.returncode}: {tail}"
    except subprocess.TimeoutExpired:
        status = f"timeout after {budget + 5:.0f} s: killed (a hang in the kernel running last, see the last row)"
    rows = [json.loads(line) for line in open(rows_file) if line.strip()]
    os.remove(rows_file)
    result = {"status": status, "seconds": round(time.time() - t0, 1), "rows": rows}
    with open(out_json, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{name}: {status}; {len(rows)} rows in {out_json}, {result['seconds']} s", file=sys.stderr)
    return 0 if status == "ok" else 1
