"""The end-of-run summary: probe values at each stage's start and end; with the recipe's eval group,
the last stage end's "sparse vs dense LM loss by position" on the held-out rows."""

from __future__ import annotations

from io import StringIO
from pathlib import Path

from rich.console import Console
from rich.table import Table

from dsa_train.config import TrainConfig
from dsa_train.eval.in_training import position_table
from dsa_train.logging.report import KL_CAPTURED_NOTE, PROBE_NOTE
from dsa_train.stage import Stage

COLUMNS = [("lm_loss", "LM loss"), ("indexer_kl_captured", "indexer KL captured"), ("topk_recall", "top-k recall")]


def summary_metrics(summary: dict) -> dict[str, float]:
    """Flat `summary/<stage>/<metric>_<start|end>` values for the W&B run summary."""
    flat = {}
    for stage, moments in summary.items():
        for when, values in moments.items():
            for key, value in values.items():
                flat[f"summary/{stage}/{key}_{when}"] = value
    return flat


def _cell(moments: dict, key: str) -> str:
    start = moments.get("start", {}).get(key)
    end = moments.get("end", {}).get(key)
    if start is None and end is None:
        return "-"
    fmt = lambda v: "?" if v is None else f"{v:.4f}"  # noqa: E731
    return f"{fmt(start)} -> {fmt(end)}"


def format_summary(cfg: TrainConfig, result) -> str:
    table = Table(title=f"dsa-train run {cfg.run_name}: probe batches, stage start -> end")
    table.add_column("stage")
    table.add_column("attention")
    table.add_column("trains")
    table.add_column("steps", justify="right")
    for _, label in COLUMNS:
        table.add_column(label)
    for name, stage_config in cfg.stages.items():
        moments = result.summary.get(name, {})
        stage = Stage.of(name, stage_config)
        table.add_row(
            name, stage.attention, stage.kind.name, str(stage_config.steps),
            *[_cell(moments, key) for key, _ in COLUMNS],
        )
    buffer = StringIO()
    console = Console(file=buffer, width=120)
    console.print(table)
    console.print(f"run directory: {result.run_dir}")
    if result.export_dir is not None:
        console.print(f"export (V3.2 Hugging Face layout): {result.export_dir}")
    if result.wandb_run_id is not None:
        console.print(f"W&B run id: {result.wandb_run_id}")
        offline = sorted(Path(cfg.logging.wandb_dir).glob(f"wandb/offline-run-*-{result.wandb_run_id}"))
        if offline:
            console.print(f"upload the offline W&B run: wandb sync {offline[-1]}")
    console.print(PROBE_NOTE)
    console.print(KL_CAPTURED_NOTE)
    console.print(f"per-stage report and plots (loss, KL-captured, recall, lr, MFU): dsa-train report {result.run_dir}")
    evaluated = [name for name in cfg.stages if "eval" in result.summary.get(name, {})]
    if evaluated:  # the last: the run's result
        values = result.summary[evaluated[-1]]["eval"]
        console.print(f"sparse vs dense LM loss by position (end of stage {evaluated[-1]}: "
                      f"{int(values['sequences'])} held-out sequences, k={int(values['topk'])})")
        console.print(position_table(values))
        console.print("Held-out rows of the training stream that no step trained on (docs/eval.md). dense: full "
                      "attention; sparse: the indexer's top-k; oracle: the k keys with the most attention mass. Up "
                      "to position k every mode sees every key; sparse - dense past it is what sparsity costs.")
    return buffer.getvalue()
