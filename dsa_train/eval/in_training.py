"""The recipe's `eval` group: the evaluation of `dsa-train eval` (`run.evaluate_batches`) on the model
being trained, in memory, at the end of every stage and every `eval.every_n_steps` steps.

Held-out data: the last `eval.num_sequences` rows of the training loader's own packed stream at
`data.seq_len` (same sources, tokenizer and framing). The trainer builds its loader with
`held_out=eval.num_sequences`, so the sampler permutes only the rows before them: no training step
of any epoch reads a held-out row (`PackedDataLoader.held_out_rows`). A document cut by the first
held-out row has its beginning in training rows; the held-out tokens themselves are never trained on.

Under N ranks (any layout: TP, CP, EP, ZeRO-3), every rank takes part in gathering the full state
(`layout.full_state_dict`), rank 0 loads it into a single-process copy of the
model and evaluates it while the other ranks wait at a barrier. The copy is as big as the whole
model: for models that do not fit one device beside rank 0's shard, leave `eval` off and run
`dsa-train eval` on the export.

Metrics (flat, logged with the prefix `eval/`): `<mode>/loss`, `<mode>/loss_pos<lo>-<hi>` (position
bucket [lo, hi)), `sparse_minus_dense`, `layer<i>/<measurement>` and its mean over layers
`layers/<measurement>`, plus `topk` and `sequences`.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass

import torch

from dsa_train.stage import trained_index_topk
from dsa_train.config.schema import EvalConfig
from dsa_train.model import DSAForCausalLM

from .attention import LayerStats
from .data import HeldOut, rows_of
from .run import EvalOptions, ModeResult, evaluate_batches

BUCKET_KEY = re.compile(r"^(?P<mode>\w+)/loss_pos(?P<lo>\d+)-(?P<hi>\d+)$")  # "sparse/loss_pos64-128"


@dataclass
class TrainingEval:
    config: EvalConfig
    held: HeldOut  # the held-out rows, each batch [1, T]
    seq_len: int
    topk: int

    @classmethod
    def of(cls, config: EvalConfig, loader, seq_len: int, stages, model_config) -> "TrainingEval | None":
        """None when `eval.enabled` is false. `loader`: the training loader built with
        held_out=config.num_sequences; `stages`: the trainer's {name: Stage}."""
        if not config.enabled:
            return None
        topk = config.topk or trained_index_topk(((s.attention, s.config.topk) for s in stages.values()),
                                                 model_config.index_topk)
        return cls(config, rows_of(loader.dataset, loader.held_out_rows), seq_len, topk)

    def due_within(self, stage_step: int, stage_steps: int) -> bool:
        """An evaluation after this step of a stage (the stage's last step has the stage-end one)."""
        every = self.config.every_n_steps
        return every > 0 and stage_step % every == 0 and stage_step < stage_steps

    def options(self) -> EvalOptions:
        return EvalOptions(modes=[str(getattr(m, "value", m)) for m in self.config.modes],
                           num_sequences=len(self.held.rows), buckets=self.config.buckets,
                           layer_metrics=self.config.layer_metrics)

    def run(self, model: torch.nn.Module, layout, device: torch.device) -> dict[str, float] | None:
        """The flat metrics on rank 0 (None on the other ranks, which wait for it)."""
        whole = whole_model(model, layout, device)
        values = None
        if whole is not None:
            was_training = whole.training
            whole.eval()
            try:
                batches = [{k: v.to(device) for k, v in b.items()} for b in self.held.batches]
                results, layers = evaluate_batches(whole, self.topk, batches, self.seq_len, self.options())
            finally:
                whole.train(was_training)
            values = flat_metrics(results, layers)
            values.update(topk=float(self.topk), sequences=float(len(self.held.rows)))
        if layout.distributed:
            layout.barrier()
        return values


def whole_model(model: torch.nn.Module, layout, device: torch.device) -> torch.nn.Module | None:
    """One process: `model` itself. N ranks: a single-process copy on rank 0 from the gathered full
    state (every rank must call this), None on the other ranks."""
    if not layout.distributed:
        return model
    full = layout.full_state_dict(model)
    if layout.rank != 0:
        return None
    dtype = next(t.dtype for t in full.values() if t.is_floating_point())
    whole = DSAForCausalLM(copy.deepcopy(model.config))
    whole.load_state_dict(full, strict=False)  # as the export: buffers the state does not hold keep their init
    return whole.to(device=device, dtype=dtype)


def flat_metrics(results: dict[str, ModeResult], layers: dict[int, LayerStats]) -> dict[str, float]:
    out: dict[str, float] = {}
    for mode, result in results.items():
        losses = result.losses
        out[f"{mode}/loss"] = losses.loss
        for lo, hi, total, n in zip(losses.edges, losses.edges[1:], losses.loss_sum, losses.tokens):
            if n:
                out[f"{mode}/loss_pos{lo}-{hi}"] = total / n
    if "dense" in results and "sparse" in results:
        out["sparse_minus_dense"] = out["sparse/loss"] - out["dense/loss"]
    per_layer = {i: stats.values() for i, stats in sorted(layers.items())}
    for i, values in per_layer.items():
        out.update({f"layer{i}/{k}": v for k, v in values.items()})
    for key in next(iter(per_layer.values()), {}):
        out[f"layers/{key}"] = sum(v[key] for v in per_layer.values()) / len(per_layer)
    return out


def position_losses(values: dict[str, float]) -> tuple[list[tuple[int, int]], dict[str, dict[tuple[int, int], float]]]:
    """From flat metrics (with or without the `eval/` prefix): the buckets [(lo, hi)] in order and
    {mode: {(lo, hi): loss}}."""
    by_mode: dict[str, dict[tuple[int, int], float]] = {}
    for key, value in values.items():
        match = BUCKET_KEY.match(key.removeprefix("eval/"))
        if match and value is not None:
            by_mode.setdefault(match["mode"], {})[(int(match["lo"]), int(match["hi"]))] = value
    buckets = sorted({b for losses in by_mode.values() for b in losses})
    return buckets, by_mode


def position_table(values: dict[str, float]):
    """The summary's "sparse vs dense LM loss by position" table (a rich Table): a row per position
    bucket and one for all positions, a column per mode and sparse - dense."""
    from rich.table import Table

    buckets, by_mode = position_losses(values)
    modes = [m for m in ("dense", "sparse", "oracle") if m in by_mode]
    table = Table()
    table.add_column("query position")
    for mode in modes:
        table.add_column(mode, justify="right")
    both = "dense" in by_mode and "sparse" in by_mode
    if both:
        table.add_column("sparse - dense", justify="right")
    fmt = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
    rows = [(f"[{lo},{hi})", (lo, hi)) for lo, hi in buckets] + [("all", None)]
    for label, bucket in rows:
        cells = [by_mode[m].get(bucket) if bucket else values.get(f"{m}/loss") for m in modes]
        if both:
            d, s = cells[modes.index("dense")], cells[modes.index("sparse")]
            cells.append(None if d is None or s is None else s - d)
        table.add_row(label, *[fmt(c) if i < len(modes) else f"{c:+.4f}" if c is not None else "-"
                               for i, c in enumerate(cells)])
    return table
