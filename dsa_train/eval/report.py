"""The evaluation's outputs: a terminal table, `eval.json`, and PNG plots.

Plots (matplotlib, the optional `train` extra; without it one line says so and the JSON and table
are still written), one file per model and sequence length (`<model>`: the directory's name,
prefixed `model0_` / `model1_` when the two models' names are the same):

  * `loss_by_position_<model>_T<T>.png`: LM loss per position bucket, one line per mode (dense,
    sparse, oracle); sparse above dense past the first bucket is what sparsity costs there, and the
    oracle line is the floor a perfect indexer would reach at this k.
  * `recall_by_layer_<model>_T<T>.png`: per layer, the indexer's top-k recall, the oracle top-k's
    recall (the ceiling), the indexer's overlap with the oracle set, KL-captured and the bf16-vs-FP8
    top-k overlap.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

LAYER_SERIES = [  # (eval.json key, plot legend, table column)
    ("topk_recall", "indexer top-k recall", "recall"),
    ("oracle_recall", "oracle top-k recall", "oracle recall"),
    ("oracle_overlap", "overlap with oracle top-k", "oracle overlap"),
    ("indexer_kl_captured", "indexer KL-captured", "KL-captured"),
    ("fp8_overlap", "bf16 vs FP8 top-k overlap", "bf16/FP8 overlap"),
]


def write_json(doc: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "eval.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.4f}"


def print_tables(doc: dict, console: Console | None = None) -> None:
    """On a terminal at its width; into a file or pipe 120 columns wide (rich's default 80 cuts the
    bucket columns)."""
    console = console or Console(width=None if sys.stdout.isatty() else 120)
    for entry in doc["models"]:
        for length in entry["lengths"]:
            modes = length["modes"]
            buckets = [b["bucket"] for b in next(iter(modes.values()))["buckets"]]
            overlap = length.get("rows_overlapping_training")
            n = len(length["rows"])
            if overlap:
                rows = f"{n} sequences, {len(overlap)} trained on"
                console.print(f"warning: {entry['model']} T={length['seq_len']}: {len(overlap)} of the {n} sequences "
                              f"overlap the run's training data (rows {overlap}): not held out, their losses read low; "
                              "evaluate on --data the run did not train on", markup=False, soft_wrap=True)
            elif overlap is None:
                rows = f"{n} sequences, not checked against training data"
            else:
                rows = f"{n} held-out sequences"
            table = Table(title=f"{entry['model']} T={length['seq_len']} k={entry['topk']}: LM loss by query position "
                                f"({rows})")
            table.add_column("mode")
            table.add_column("loss", justify="right")
            table.add_column("ppl", justify="right")
            for b in buckets:
                table.add_column(b, justify="right")
            with_passkey = any("passkey" in r for r in modes.values())
            if with_passkey:
                table.add_column("passkey", justify="right")
            for mode, r in modes.items():
                row = [mode, _fmt(r["loss"]), "-" if r["perplexity"] is None else f"{r['perplexity']:.2f}"]
                row += [_fmt(b["loss"]) for b in r["buckets"]]
                if with_passkey:
                    row.append(f"{r['passkey']['accuracy']:.2f}" if "passkey" in r else "-")
                table.add_row(*row)
            console.print(table)
            if length["layers"]:
                layers = Table(title=f"per layer (dense forward, k={entry['topk']}; recall: the indexer's top-k)")
                layers.add_column("layer", justify="right")
                for _, _, column in LAYER_SERIES:
                    layers.add_column(column, justify="right")
                for row in length["layers"]:
                    layers.add_row(str(row["layer"]), *[_fmt(row.get(key)) for key, _, _ in LAYER_SERIES])
                console.print(layers)


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(name).name or name).strip("_") or "model"


def write_plots(doc: dict, out_dir: Path) -> list[Path] | str:
    """The PNGs written, or the one line saying why none were."""
    if importlib.util.find_spec("matplotlib") is None:
        return ("plots skipped: matplotlib is not installed (the train extra: pip install \"dsa-train[train]\"); "
                "eval.json holds every number")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    slugs = [_slug(entry["model"]) for entry in doc["models"]]
    if len(set(slugs)) < len(slugs):  # e.g. two runs' export/ directories
        slugs = [f"model{i}_{slug}" for i, slug in enumerate(slugs)]
    for entry, slug in zip(doc["models"], slugs):
        for length in entry["lengths"]:
            T = length["seq_len"]
            fig, ax = plt.subplots(figsize=(6.4, 4.0))
            for mode, r in length["modes"].items():
                pts = [(i, b["loss"]) for i, b in enumerate(r["buckets"]) if b["loss"] is not None]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=f"{mode} ({r['loss']:.3f})")
            labels = [b["bucket"] for b in next(iter(length["modes"].values()))["buckets"]]
            ax.set_xticks(range(len(labels)), labels)
            ax.set_xlabel("query position in its document (bucket)")
            ax.set_ylabel("LM loss")
            ax.set_title(f"{slug}: loss by position, T={T}, k={entry['topk']}")
            ax.grid(alpha=0.3)
            ax.legend()
            fig.tight_layout()
            path = out_dir / f"loss_by_position_{slug}_T{T}.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(path)
            if length["layers"]:
                fig, ax = plt.subplots(figsize=(6.4, 4.0))
                xs = [row["layer"] for row in length["layers"]]
                for key, label, _ in LAYER_SERIES:
                    ys = [row.get(key) for row in length["layers"]]
                    if all(y is not None for y in ys):
                        ax.plot(xs, ys, marker="o", label=label)
                ax.set_xticks(xs)
                ax.set_xlabel("layer")
                ax.set_ylabel("fraction")
                ax.set_title(f"{slug}: per layer, T={T}, k={entry['topk']}")
                ax.axhline(0.0, color="gray", linewidth=0.8, linestyle=":")
                ax.grid(alpha=0.3)
                ax.legend(fontsize=8)
                fig.tight_layout()
                path = out_dir / f"recall_by_layer_{slug}_T{T}.png"
                fig.savefig(path, dpi=110)
                plt.close(fig)
                written.append(path)
    return written
