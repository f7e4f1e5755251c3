"""Local progress display: a rich progress bar on a terminal, plain log lines otherwise."""

from __future__ import annotations

import logging
import sys

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

    def start_stage(self, name: str, total_steps: int, completed: int) -> None:
        self.stage = name
        if self.bar is not None:
            self.task = self.bar.add_task(name, total=total_steps, completed=completed, metrics="")

    def update(self, stage_step: int, total_steps: int, metrics: dict[str, float], logged: bool) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=stage_step, metrics=format_metrics(metrics))
        elif logged:
            log.info("%s %d/%d  %s", self.stage, stage_step, total_steps, format_metrics(metrics))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
