"""Throughput, MFU and memory.

MFU = achieved model FLOP/s / peak FLOP/s of the devices used. Model FLOPs per token come from
`dsa_train.stage.Stage.flops_per_token` (the arithmetic of `dsa_train.model.flops`), which counts
the training FLOPs of the stage as its kind runs it (forward + backward of what trains, the indexer
included). Peak FLOP/s of one device: `logging.peak_flops` when set, else dense bf16 tensor-core
peak for known GPUs, and on the CPU 96 GFLOP/s per thread used by torch (fp32: 2 AVX2 FMA units x 8 lanes x 2 FLOPs at 3 GHz).
"""

from __future__ import annotations

import os
import resource

import torch

CPU_PEAK_FLOPS_PER_THREAD = 96e9

# Dense (no sparsity) bf16 tensor-core peak, FLOP/s.
GPU_PEAK_FLOPS = {
    "H200": 989.4e12,
    "H100": 989.4e12,  # SXM; the PCIe card is lower: set logging.peak_flops
    "H800": 989.4e12,
    "H20": 148e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "B200": 2250e12,
}


def peak_flops_per_device(device: torch.device, configured: float | None) -> float:
    """One device's peak FLOP/s: `configured` (logging.peak_flops) when set, else the GPU's from
    GPU_PEAK_FLOPS by its name; a GPU not there is a ConfigError (one line: set logging.peak_flops),
    which the trainer raises at start-up, before it loads anything."""
    if configured:
        return configured
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, flops in GPU_PEAK_FLOPS.items():
            if key in name:
                return flops
        from dsa_train.config import ConfigError

        raise ConfigError(f"logging.peak_flops: no peak FLOP/s known for GPU {name!r} (known: "
                          f"{', '.join(GPU_PEAK_FLOPS)}; MFU divides by it)",
                          fix="set logging.peak_flops=<one device's dense bf16 FLOP/s>, e.g. "
                              "logging.peak_flops=989.4e12 for an H100 SXM")
    return CPU_PEAK_FLOPS_PER_THREAD * torch.get_num_threads()


def rss_bytes() -> int:
    """Resident set size of this process (current where /proc exists, else peak)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_metrics(device: torch.device) -> dict[str, float]:
    metrics = {"perf/memory_rss_gib": rss_bytes() / 2**30}
    if device.type == "cuda":
        metrics["perf/cuda_max_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
    return metrics


def throughput_metrics(
    tokens: int, step_time_s: float, flops_per_token: float, peak_flops: float, num_devices: int = 1
) -> dict[str, float]:
    achieved = tokens * flops_per_token / step_time_s
    return {
        "perf/step_time_s": step_time_s,
        "perf/tokens_per_s": tokens / step_time_s,
        "perf/tflops_per_device": achieved / num_devices / 1e12,
        "perf/mfu": achieved / (peak_flops * num_devices),
    }
