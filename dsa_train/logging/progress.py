"""Local progress display: a rich progress bar on a terminal, plain log lines otherwise."""

from __future__ import annotations

import logging
import sys
import time

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

log = logging.getLogger(__name__)

# Metrics shown on the bar / in each log line, with their short labels.
SHOWN = {
    "train/loss": "loss",
    "train/lm_loss": "lm",
    "train/indexer_kl_captured": "kl_captured",
    "train/topk_recall": "recall",
    "optim/lr": "lr",
    "perf/tokens_per_s": "tok/s",
}


def format_metrics(metrics: dict[str, float]) -> str:
    return "  ".join(f"{label} {metrics[key]:.4g}" for key, label in SHOWN.items() if key in metrics)


class StageProgress:
    """One bar per stage when enabled and stdout is a terminal; otherwise an INFO line every
    logged step."""

    def __init__(self, enabled: bool):
        self.bar = None
        if enabled and sys.stdout.isatty():
            self.bar = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[metrics]}"),
            )
            self.bar.start()
        self.task = None
        self.stage = ""

    # Without a bar, a step longer than this logs its micro-batches as they finish.
    WITHIN_STEP_LOG_S = 10.0

    def start_stage(self, name: str, total_steps: int, completed: int) -> None:
        self.stage = name
        self.step_started = time.perf_counter()
        self.last_within_log = self.step_started
        if self.bar is not None:
            self.task = self.bar.add_task(name, total=total_steps, completed=completed, metrics="")

    def within_step(self, step: int, micro_batch: int, micro_batches: int) -> None:
        """Micro-batch `micro_batch` of `micro_batches` of optimizer step `step` has run its
        forward: a long step shows that it is moving."""
        now = time.perf_counter()
        if micro_batch == 1:
            self.step_started = self.last_within_log = now
        if self.bar is not None:
            self.bar.update(self.task, description=f"{self.stage} (step {step}: micro-batch {micro_batch}/{micro_batches})")
        elif now - self.last_within_log >= self.WITHIN_STEP_LOG_S:
            self.last_within_log = now
            log.info("%s step %d: micro-batch %d/%d after %.0f s", self.stage, step, micro_batch, micro_batches,
                     now - self.step_started)

    def micro_batch_hook(self, step_of, micro_batches: int):
        """A forward hook for the model: each training forward (grad enabled) is one micro-batch
        of the step `step_of()` returns."""
        import torch

        seen = {"step": None, "count": 0}

        def hook(*_):
            if not torch.is_grad_enabled():
                return
            step = step_of()
            seen["count"] = seen["count"] + 1 if seen["step"] == step else 1
            seen["step"] = step
            self.within_step(step, seen["count"], micro_batches)

        return hook

    def update(self, stage_step: int, total_steps: int, metrics: dict[str, float], logged: bool) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=stage_step, metrics=format_metrics(metrics), description=self.stage)
        elif logged:
            log.info("%s %d/%d  %s", self.stage, stage_step, total_steps, format_metrics(metrics))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


# Model FLOPs utilization assumed for the up-front step-time estimate (the measured MFU is logged
# as perf/mfu from the first step on). CPU: the demo recipe measured 0.33% of the nominal peak on
# the 2-core dev machine shared with six other jobs (tiny smoke models 0.05-0.15%: small matrices,
# chunked attention); 1% assumes an idle machine. GPU: a typical 671B-class training MFU.
ASSUMED_MFU = {"cpu": 0.01, "cuda": 0.35}


def describe_step(name: str, sequences: int, seq_len: int, micro_batch_size: int, data_parallel: int,
                  flops_per_token: float, peak_flops: float, device_type: str, steps: int) -> str:
    """What one optimizer step of stage `name` is, and a rough time for it on this device."""
    tokens = sequences * seq_len
    flops = tokens * flops_per_token
    micro = max(sequences // max(micro_batch_size * data_parallel, 1), 1)
    mfu = ASSUMED_MFU.get(device_type, 0.1)
    step_s = flops / (peak_flops * max(data_parallel, 1) * mfu)
    return (
        f"stage {name}: a step is {sequences} sequences x {seq_len} tokens = {tokens:,} tokens "
        f"({micro} micro-batches of {micro_batch_size} per rank), {flops / 1e12:.3g} TFLOP; on this {device_type} "
        f"(peak {peak_flops / 1e12:.3g} TFLOP/s per device, assuming {mfu:.0%} MFU) roughly "
        f"{_duration(step_s)} per step, {_duration(step_s * steps)} for {steps} steps"
    )


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.2g} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
