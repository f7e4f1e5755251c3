"""`dsa-train report`'s `eval.png`: the recipe's eval group (`eval/*` metrics, docs/eval.md).

Three panels: LM loss by query-position bucket at the last evaluation (one line per mode: dense,
sparse, oracle top-k), the overall held-out LM loss of each mode at every evaluation (x: global
step), and per layer the indexer's top-k recall, the oracle's recall and KL-captured at the last
evaluation.
"""

from __future__ import annotations

import re
from pathlib import Path

MODE_STYLE = {"dense": ("black", "-"), "sparse": ("tab:red", "-"), "oracle": ("tab:green", "--")}
LAYER_KEY = re.compile(r"^eval/layer(?P<layer>\d+)/(?P<name>\w+)$")
LAYER_SERIES = [("topk_recall", "indexer top-k recall"), ("oracle_recall", "oracle top-k recall"),
                ("indexer_kl_captured", "indexer KL-captured")]


def write_eval_plot(evals: dict[int, dict[str, float]], run_name: str, out_dir: Path) -> Path | None:
    """`evals`: global step -> that evaluation's `eval/*` values. None when the run has none."""
    if not evals:
        return None
    import matplotlib.pyplot as plt

    from dsa_train.eval.in_training import position_losses

    steps = sorted(evals)
    last = evals[steps[-1]]
    fig, (by_pos, over_steps, by_layer) = plt.subplots(1, 3, figsize=(15, 4.2))
    buckets, by_mode = position_losses(last)
    labels = [f"[{lo},{hi})" for lo, hi in buckets]
    for mode, losses in by_mode.items():
        color, style = MODE_STYLE.get(mode, (None, "-"))
        by_pos.plot(range(len(buckets)), [losses.get(b) for b in buckets], color=color, linestyle=style, marker="o",
                    label=f"{mode} (all: {last.get(f'eval/{mode}/loss', float('nan')):.4f})")
        xs = [s for s in steps if f"eval/{mode}/loss" in evals[s]]
        over_steps.plot(xs, [evals[s][f"eval/{mode}/loss"] for s in xs], color=color, linestyle=style, marker="o",
                        label=mode)
    by_pos.set_xticks(range(len(buckets)), labels, rotation=30, fontsize=8)
    by_pos.set_xlabel("query position (tokens of its document before it)")
    by_pos.set_ylabel("held-out LM loss")
    by_pos.set_title(f"by position, step {steps[-1]} (k={int(last.get('eval/topk', 0))})")
    over_steps.set_xlabel("global step")
    over_steps.set_title("held-out LM loss at each evaluation")
    layers: dict[str, dict[int, float]] = {}
    for key, value in last.items():
        match = LAYER_KEY.match(key)
        if match:
            layers.setdefault(match["name"], {})[int(match["layer"])] = value
    for name, label in LAYER_SERIES:
        if name in layers:
            xs = sorted(layers[name])
            by_layer.plot(xs, [layers[name][x] for x in xs], marker="o", label=label)
    by_layer.axhline(0.0, color="gray", linewidth=0.8, linestyle=":")
    by_layer.set_xlabel("layer")
    by_layer.set_title(f"per layer, step {steps[-1]}")
    for ax in (by_pos, over_steps, by_layer):
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7, loc="best")
    fig.suptitle(f"{run_name}: evaluation on held-out rows (eval/)")
    fig.tight_layout()
    path = out_dir / "eval.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
