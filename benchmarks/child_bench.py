"""The harness of the kernel-candidate benchmarks that run a kernel never run on a GPU before
(gluon_sparse_mla.py, gluon_index_scores.py): the measurements run in a child process under a
deadline, so a kernel that hangs (a producer / consumer handshake that never completes) is killed
and reported, not waited for; every row is written the moment it is measured, so the rows before
the hang survive it.

    main side:   run_child(__file__, args.out_json, child_argv, budget, small, "name") -> exit status
    child side:  rows = Rows(args.rows_file); rows.emit(kind=..., ...); time_ms(fn, cuda)
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
