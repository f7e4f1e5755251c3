"""`dsa-train report RUN_DIR`: a per-stage summary of a run and PNG plots, without W&B.

Reads `<run_dir>/metrics.jsonl` (written by the trainer beside W&B, whatever the W&B mode), or
else the offline W&B run file under `<run_dir>/wandb/` (dsa_train.logging.wandb_offline). Prints
one row per stage (steps, training loss / LM loss / KL-captured / top-k recall at the stage's
first and last steps, throughput, model TFLOP/s per GPU and MFU -- each a total over time, tokens or
FLOPs over the summed step time, never a mean of per-step rates (`stage_throughput`) -- and the probe values at the stage's start and end) and
writes into `<run_dir>/report/`:

    loss.png         training loss and LM loss per step
    indexer.png      indexer KL (eq. 3 / eq. 4) and KL-captured per step
    topk_recall.png  top-k recall of the dense attention mass (sparse stages)
    lr.png           learning rate
    throughput.png   tokens/s and MFU
    eval.png         the recipe's eval group (eval/*): held-out loss by position, per evaluation, per layer

Each PNG has a row per metric and a column per stage (own y-axis: the sparse stage's small LM
loss fall is visible beside the pre-training's large one), probe values at the stage's start and
end as black diamonds. Noisy per-step curves are drawn faint with a moving average on top. A resumed run logs some
steps twice; the last value of a step wins.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dsa_train.logging.wandb_run import METRICS_FILE

REPORT_DIR = "report"

PROBE_NOTE = (
    "Probe values are measured at each stage's start and end on fixed probe batches: sequences drawn "
    "once per run from the same sources with seed data.seed + 1 (not a held-out split), with both losses "
    "and the LM head on, under no_grad. They are comparable from stage to stage; the training loss in the "
    "progress lines is a different quantity (each step's own batch, and the stage's loss terms only)."
)
KL_CAPTURED_NOTE = (
    "Indexer KL-captured = 1 - KL(p || q) / KL(p || uniform), where p is the head-summed, L1-normalized "
    "dense attention of a query (the warm-up target, report eq. 3) and q the indexer's softmax over the "
    "same keys (every causal key in dense stages; the selected top-k in sparse stages, eq. 4): 1 means the "
    "indexer reproduces the attention distribution, 0 means it is no better than a uniform distribution over "
    "those keys, negative means worse than uniform (a freshly initialized indexer starts there). The warm-up "
    "should raise it."
)

THROUGHPUT_NOTE = (
    "tok/s, TFLOPS/GPU and MFU are totals over time: the logged steps' tokens and model FLOPs divided by their "
    "summed step time (per GPU: over every GPU's peak), the first step of a stage (start-up) left out; time "
    "outside steps (probes, evaluation, checkpoints) is not counted."
)


@dataclass
class RunData:
    run_dir: Path
    source: Path
    stages: dict[str, dict] = field(default_factory=dict)  # name -> stage config (attention, trainable, steps, ...)
    steps: dict[int, dict[str, float]] = field(default_factory=dict)  # global step -> training metrics
    probes: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)  # stage -> start|end -> values
    evals: dict[int, dict[str, float]] = field(default_factory=dict)  # global step -> eval/* values
    wandb_run_dir: str | None = None


class ReportError(Exception):
    pass


def load_run(run_dir: str | Path) -> RunData:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a directory; pass a run directory (e.g. runs/demo)")
    metrics = run_dir / METRICS_FILE
    if metrics.is_file():
        data = _from_jsonl(run_dir, metrics)
    else:
        data = _from_wandb(run_dir)
    if not data.steps:
        raise ReportError(f"{data.source} holds no training steps yet")
    return data


def _add_row(data: RunData, step: int, row: dict, probe_moment: dict[str, str]) -> None:
    train = {k: v for k, v in row.items() if not k.startswith(("probe/", "eval/", "_")) and v is not None}
    evaluated = {k: v for k, v in row.items() if k.startswith("eval/") and v is not None}
    if evaluated:
        data.evals.setdefault(step, {}).update(evaluated)
    if "progress/stage" in train:
        data.steps[step] = train  # the last value of a step wins (resumed runs repeat steps)
    for key, value in row.items():
        if key.startswith("probe/") and value is not None:
            _, stage, name = key.split("/", 2)
            # the first probe of a stage is its start, the next its end
            when = probe_moment.setdefault((stage, step), "start" if stage not in data.probes else "end")
            data.probes.setdefault(stage, {}).setdefault(when, {})[name] = value


def _from_jsonl(run_dir: Path, path: Path) -> RunData:
    data = RunData(run_dir, path)
    moments: dict = {}
    for line_number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash
        if "run" in record:
            data.stages = record["run"].get("stages") or data.stages
            data.wandb_run_dir = record["run"].get("wandb_run_dir") or data.wandb_run_dir
        elif "step" in record:
            _add_row(data, int(record["step"]), record.get("metrics", {}), moments)
    return data


def _from_wandb(run_dir: Path) -> RunData:
    from dsa_train.logging import wandb_offline

    try:
        run_file = wandb_offline.find_run_file(run_dir)
    except FileNotFoundError:
        raise ReportError(
            f"{run_dir} has no {METRICS_FILE} and no offline W&B run (run-*.wandb); is it a dsa-train run directory?"
        ) from None
    data = RunData(run_dir, run_file, wandb_run_dir=str(run_file.parent))
    config = wandb_offline.read_config(run_file)
    data.stages = config.get("stages") or {}
    moments: dict = {}
    for row in wandb_offline.read_history(run_file):
        _add_row(data, int(row.get("_step", 0)), row, moments)
    return data


def stage_names(data: RunData) -> list[str]:
    names = list(data.stages)
    used = sorted({int(m["progress/stage"]) for m in data.steps.values()})
    while len(names) <= (used[-1] if used else -1):
        names.append(f"stage {len(names)}")
    return names


def stage_rows(data: RunData) -> list[dict]:
    """Per stage: its steps' first and last values, its throughput over time, and its probe values."""
    names = stage_names(data)
    rows = []
    for index, name in enumerate(names):
        steps = sorted(s for s, m in data.steps.items() if int(m["progress/stage"]) == index)
        if not steps and name not in data.probes:
            continue
        first, last = (data.steps[steps[0]], data.steps[steps[-1]]) if steps else ({}, {})

        stage_cfg = data.stages.get(name, {})
        rows.append({
            "stage": name,
            "attention": stage_cfg.get("attention", "?"),
            "trains": stage_cfg.get("trainable", "?"),
            "steps": f"{len(steps)}/{stage_cfg.get('steps', '?')}",
            "first_last": {key: (first.get(key), last.get(key)) for key in (
                "train/loss", "train/lm_loss", "train/indexer_kl_captured", "train/topk_recall")},
            **stage_throughput([data.steps[s] for s in steps]),
            "probe": data.probes.get(name, {}),
        })
    return rows


# per-GPU model TFLOP/s: the name the trainer writes now, and the earlier one
TFLOPS_KEYS = ("perf/tflops_per_gpu", "perf/tflops_per_device")


def _number(metrics: dict, *keys: str) -> float | None:
    for key in keys:
        value = metrics.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            return float(value)
    return None


def stage_throughput(records: list[dict]) -> dict:
    """A stage's throughput as totals over time, never a mean of per-step rates (a mean of rates
    weights a fast step like a slow one and reads high): tokens/s = sum of tokens / sum of step
    times, TFLOP/s per GPU = sum of FLOPs / sum of step times, MFU = sum of FLOPs / (sum of step
    times * peak), i.e. each step's rate weighted by its time. Over the logged steps (each record
    carries its own step time); the first step of a stage is left out when there are more than two
    (start-up work: allocation, compilation). Records without a step time (older runs) count as
    equally long."""
    rows = []
    for m in records:
        rate = _number(m, "perf/tokens_per_s")
        if rate is None:
            continue
        seconds = _number(m, "perf/step_time_s")
        rows.append((seconds if seconds is not None and seconds > 0 else None, m))
    if len(rows) > 2:
        rows = rows[1:]
    timed = all(t is not None for t, _ in rows)
    total = sum(t if timed else 1.0 for t, _ in rows)
    if not rows or total <= 0:
        return {"tokens_per_s": None, "tflops_per_gpu": None, "mfu": None, "seconds": None, "timed_steps": 0}

    def weighted(*keys):
        pairs = [(t if timed else 1.0, _number(m, *keys)) for t, m in rows]
        pairs = [(t, v) for t, v in pairs if v is not None]
        span = sum(t for t, _ in pairs)
        return sum(t * v for t, v in pairs) / span if pairs and span > 0 else None

    return {"tokens_per_s": weighted("perf/tokens_per_s"), "tflops_per_gpu": weighted(*TFLOPS_KEYS),
            "mfu": weighted("perf/mfu"), "seconds": total if timed else None, "timed_steps": len(rows)}


def _fmt(value, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.{digits}f}"


def _arrow(pair) -> str:
    start, end = pair
    return "-" if start is None and end is None else f"{_fmt(start)} -> {_fmt(end)}"


def format_report(data: RunData, plots: list[Path]) -> str:
    from io import StringIO

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"run {data.run_dir} (from {data.source.name}): per step, first -> last step of each stage")
    for column in ("stage", "attention", "trains", "steps", "loss", "LM loss", "KL captured", "top-k recall",
                   "tok/s", "TFLOPS/GPU", "MFU"):
        table.add_column(column)
    probe_table = Table(title="probe batches, stage start -> end")
    for column in ("stage", "LM loss", "indexer KL", "KL captured", "top-k recall"):
        probe_table.add_column(column)
    for row in stage_rows(data):
        fl = row["first_last"]
        table.add_row(
            row["stage"], row["attention"], row["trains"], row["steps"], _arrow(fl["train/loss"]),
            _arrow(fl["train/lm_loss"]), _arrow(fl["train/indexer_kl_captured"]), _arrow(fl["train/topk_recall"]),
            _fmt(row["tokens_per_s"], 1), "-" if row["tflops_per_gpu"] is None else f"{row['tflops_per_gpu']:.3g}",
            "-" if row["mfu"] is None else f"{row['mfu']:.2%}",
        )
        probe = row["probe"]
        pair = lambda key: (probe.get("start", {}).get(key), probe.get("end", {}).get(key))  # noqa: E731
        probe_table.add_row(row["stage"], _arrow(pair("lm_loss")), _arrow(pair("indexer_kl")),
                            _arrow(pair("indexer_kl_captured")), _arrow(pair("topk_recall")))
    buffer = StringIO()
    console = Console(file=buffer, width=140)
    console.print(table)
    if data.probes:
        console.print(probe_table)
        console.print(PROBE_NOTE)
    console.print(THROUGHPUT_NOTE)
    console.print(KL_CAPTURED_NOTE)
    if data.evals:
        step = max(data.evals)
        last = data.evals[step]
        console.print(f"held-out eval at step {step} (eval/, k={int(last.get('eval/topk', 0))}): " + "  ".join(
            f"{m} {last[f'eval/{m}/loss']:.4f}" for m in ("dense", "sparse", "oracle") if f"eval/{m}/loss" in last))
    if plots:
        console.print(f"plots: {', '.join(str(p) for p in plots)}")
    return buffer.getvalue()


# ---------------------------------------------------------------------------------- plots

PANELS = {
    "loss": [("train/loss", "training loss (the stage's loss terms)"), ("train/lm_loss", "LM loss")],
    "indexer": [("train/indexer_kl", "indexer KL"), ("train/indexer_kl_captured", "indexer KL captured")],
    "topk_recall": [("train/topk_recall", "top-k recall of the dense attention mass")],
    "lr": [("optim/lr", "learning rate")],
    "throughput": [("perf/tokens_per_s", "tokens/s"), ("perf/mfu", "MFU")],
}


def _moving_average(values: list[float], window: int) -> list[float]:
    out, total, queue = [], 0.0, []
    for v in values:
        queue.append(v)
        total += v
        if len(queue) > window:
            total -= queue.pop(0)
        out.append(total / len(queue))
    return out


PROBE_OF = {"train/lm_loss": "lm_loss", "train/indexer_kl": "indexer_kl",
            "train/indexer_kl_captured": "indexer_kl_captured", "train/topk_recall": "topk_recall"}


def write_plots(data: RunData, out_dir: Path) -> list[Path]:
    """One PNG per panel: a row per metric, a column per stage (each with its own y-axis, so that a
    stage's change is visible next to a larger one of another stage), probe values as markers."""
    from dsa_train.runtime import require_train_extra

    require_train_extra("matplotlib", purpose="`dsa-train report`'s plots")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import PercentFormatter

    out_dir.mkdir(parents=True, exist_ok=True)
    names = stage_names(data)
    steps = sorted(data.steps)
    spans = []  # (stage index, name, steps of the stage)
    for index, name in enumerate(names):
        in_stage = [s for s in steps if int(data.steps[s]["progress/stage"]) == index]
        if in_stage:
            spans.append((index, name, in_stage))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    def has(key, in_stage):
        return any(isinstance(data.steps[s].get(key), (int, float)) for s in in_stage)

    written = []
    for panel, series in PANELS.items():
        rows = [(key, label) for key, label in series if has(key, steps)]
        columns = [span for span in spans if any(has(key, span[2]) for key, _ in rows)]
        if not rows or not columns:
            continue
        fig, axes = plt.subplots(len(rows), len(columns), figsize=(4.6 * len(columns) + 0.8, 3.0 * len(rows) + 0.6),
                                 squeeze=False)
        for c, (index, name, in_stage) in enumerate(columns):
            color = colors[index % len(colors)]
            attention = data.stages.get(name, {}).get("attention")
            for r, (key, label) in enumerate(rows):
                ax = axes[r, c]
                xs = [s for s in in_stage if isinstance(data.steps[s].get(key), (int, float))]
                ys = [data.steps[s][key] for s in xs]
                window = max(1, len(xs) // 12)
                if not xs:
                    ax.text(0.5, 0.5, "not measured in this stage", ha="center", va="center",
                            transform=ax.transAxes, color="gray", fontsize=9)
                elif window > 1:
                    ax.plot(xs, ys, color=color, alpha=0.3, linewidth=0.8, label="per step")
                    ax.plot(xs, _moving_average(ys, window), color=color, linewidth=2.0,
                            label=f"moving average ({window} steps)")
                else:
                    ax.plot(xs, ys, color=color, linewidth=2.0, marker="o" if len(xs) < 10 else None, label="per step")
                probe = data.probes.get(name, {})
                probe_key = PROBE_OF.get(key)
                points = [(x, probe.get(when, {}).get(probe_key)) for x, when in
                          ((in_stage[0] - 0.5, "start"), (in_stage[-1] + 0.5, "end"))]
                points = [(x, y) for x, y in points if y is not None]
                if probe_key and points:
                    ax.plot(*zip(*points), linestyle="--", color="black", marker="D", markersize=5, linewidth=0.8,
                            label="probe batches (start, end)")
                if key == "train/indexer_kl_captured" and xs:
                    ax.axhline(0.0, color="gray", linewidth=0.8, linestyle=":")
                if key == "perf/mfu":
                    ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=2))
                if r == 0:
                    ax.set_title(f"{name}" + (f" ({attention})" if attention else ""))
                if c == 0:
                    ax.set_ylabel(label if len(label) < 28 else label.replace(" (", "\n(").replace(" of ", "\nof "))
                if r == len(rows) - 1:
                    ax.set_xlabel("global step")
                ax.grid(alpha=0.3)
                if xs:
                    ax.legend(loc="best", fontsize=7)
        fig.suptitle(f"{data.run_dir.name}: {panel.replace('_', ' ')}")
        fig.tight_layout()
        path = out_dir / f"{panel}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    from dsa_train.logging.eval_plot import write_eval_plot

    evaluated = write_eval_plot(data.evals, data.run_dir.name, out_dir)
    return written + ([evaluated] if evaluated else [])


def report(run_dir: str | Path, plots: bool = True) -> tuple[str, list[Path]]:
    data = load_run(run_dir)
    written = write_plots(data, Path(run_dir) / REPORT_DIR) if plots else []
    return format_report(data, written), written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="dsa-train report",
        description="Per-stage summary and PNG plots (loss, indexer KL / KL-captured, top-k recall, lr, "
                    "throughput / MFU) of a run, from its metrics.jsonl or offline W&B file; no W&B account needed.",
    )
    parser.add_argument("run_dir", help="the run directory, e.g. runs/demo")
    parser.add_argument("--no-plots", action="store_true", help="print the summary only")
    args = parser.parse_args(argv)
    try:
        text, _ = report(args.run_dir, plots=not args.no_plots)
    except ReportError as err:
        print(f"dsa-train report: {err}", file=sys.stderr)
        return 2
    print(text, end="")
    return 0
