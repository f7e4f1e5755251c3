"""`logging.profile_steps`: torch.profiler around chosen global steps of a run.

For each listed step the trainer runs that step under `torch.profiler.profile` (CPU and, on a GPU,
CUDA activity) and writes `<run_dir>/profile/step_<N>.txt` (rank 0; other ranks `..._rank<r>.txt`):
the operators and kernels by self device time, then by self CPU time, 30 rows each, with the step's
wall time, then the calls of every event (one tab-separated line each: kernel launches, stream
synchronizations and copies, which the 30 rows may leave out). With `logging.profile_trace=true` also a Chrome trace (`step_<N>.json.gz`, tens of MB for
a 32K step): open it in https://ui.perfetto.dev. Steps not listed run unprofiled (no cost).
"""

from __future__ import annotations

import contextlib
import gzip
import shutil
import time
from pathlib import Path

import torch

ROWS = 30


def profile_path(run_dir: str | Path, step: int, rank: int, suffix: str) -> Path:
    tail = "" if rank == 0 else f"_rank{rank}"
    return Path(run_dir) / "profile" / f"step_{step:08d}{tail}{suffix}"


CALLS_HEADER = "## calls of every event (name, calls, self CPU us, self device us)"


def call_rows(averages) -> list[str]:
    """One tab-separated line per profiler event, most calls first: what the tables' 30 rows leave
    out (kernel launches, stream synchronizations, copies: gpu-check's end-to-end.throughput counts them)."""
    rows = []
    for e in averages:
        device_us = getattr(e, "self_device_time_total", 0.0) or 0.0
        rows.append((e.count, e.key, e.self_cpu_time_total, device_us))
    rows.sort(key=lambda r: (-r[0], r[1]))
    return [f"{key}\t{count}\t{cpu:.1f}\t{dev:.1f}" for count, key, cpu, dev in rows]


@contextlib.contextmanager
def profiled(step: int, steps: list[int] | tuple[int, ...], run_dir: str | Path, device: torch.device,
             rank: int = 0, trace: bool = False):
    """Profile the enclosed step when `step` is in `steps`; else do nothing."""
    if step not in steps:
        yield None
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    start = time.perf_counter()
    with profile(activities=activities, record_shapes=False) as prof:
        yield prof
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    wall = time.perf_counter() - start
    out = profile_path(run_dir, step, rank, ".txt")
    out.parent.mkdir(parents=True, exist_ok=True)
    averages = prof.key_averages()
    parts = [f"# global step {step}: {wall:.3f} s wall under the profiler (device {device})", ""]
    if device.type == "cuda":
        parts += ["## by self device time", averages.table(sort_by="self_device_time_total", row_limit=ROWS), ""]
    parts += ["## by self CPU time", averages.table(sort_by="self_cpu_time_total", row_limit=ROWS), ""]
    parts += [CALLS_HEADER, *call_rows(averages)]
    out.write_text("\n".join(parts) + "\n")
    if trace:
        raw = profile_path(run_dir, step, rank, ".json")
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(str(raw) + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
