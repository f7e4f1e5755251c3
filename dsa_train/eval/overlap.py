"""Which evaluation rows a run trained on (`dsa-train eval RUN ...`).

The evaluation's rows are windows of the packed token stream of `--data` at each `--seq-len`
(eval/data.py). When the model is a run (its directory or its `export/`), the run's newest
checkpoint records the recipe it trained under and the tokens it has seen (`trainer_state.json`):
the training loader visited, epoch after epoch, the first rows of `ShardedEpochSampler`'s order of
its stream at `data.seq_len` (data/loader.py; with one data-parallel rank the most rows an epoch
can use, so the set found here is never smaller than what a run with more ranks visited). A row of
the evaluation at another length covers other token positions; it overlaps the training data when
any of its T + 1 tokens lies in a trained row's window. Such rows are not held out: `eval.json`
lists them (`rows_overlapping_training`) and the table says how many.

Same sources with another document framing (add_bos / add_eos / text field) than the run's: the
token positions do not line up, every row is reported as possibly trained on. Other sources than
the run's: no overlap is claimed (the streams are different texts).
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

EPOCH_CAP = 64  # epochs looked at; after the first the visited set is the whole stream anyway


@dataclass
class RunTraining:
    checkpoint: Path
    data: dict  # the recipe's data section
    held_out: int  # rows the recipe's own eval group held out (never visited)
    tokens_seen: int


def training_of(model_path: str | Path) -> RunTraining | None:
    """The training the model at `model_path` (a run directory, its export/, or one of its training
    checkpoints) went through."""
    from dsa_train.checkpoint.training import list_checkpoints

    p = Path(model_path).expanduser()
    if (p / "trainer_state.json").is_file():  # a training checkpoint: what it had trained then
        steps_of = [[p]]
    else:
        steps_of = [list_checkpoints(run_dir / "checkpoints") for run_dir in (p, p.parent)]
    for steps in steps_of:
        for step in reversed(steps):
            try:
                state = json.loads((step / "trainer_state.json").read_text())
            except (OSError, ValueError):
                continue
            recipe = state.get("recipe") or {}
            if not recipe.get("data"):
                return None
            ev = recipe.get("eval") or {}
            held = int(ev.get("num_sequences") or 0) if ev.get("enabled") else 0
            return RunTraining(step, recipe["data"], held, int(state.get("tokens_seen") or 0))
    return None


def same_sources(training: RunTraining, sources: list[str]) -> bool:
    """Whether the evaluation reads the run's sources (else: other texts, no overlap claimed)."""
    return [str(s) for s in sources] == [str(s) for s in training.data.get("sources") or []]


def same_stream(training: RunTraining, sources: list[str], text_field: str = "text") -> bool:
    """Whether the evaluation's token stream is the run's: its sources, read as the evaluation reads
    them (the evaluation's `text_field`, the loader's defaults for BOS/EOS framing and txt sampling);
    only then do the token positions line up (TrainedSpans is built for that case only)."""
    data = training.data
    return (same_sources(training, sources) and data.get("text_field", "text") == text_field
            and data.get("add_bos", True) and data.get("add_eos", True) and data.get("txt_sample_by", "document") == "document")


class TrainedSpans:
    """Token windows [start, end] (inclusive) of the stream that the run trained on, merged."""

    def __init__(self, training: RunTraining, tokenizer):
        from dsa_train.data import PackedDataset, ShardedEpochSampler

        data = training.data
        T = int(data["seq_len"])
        dataset = PackedDataset.from_sources(list(data["sources"]), tokenizer, T, cache_dir=data.get("cache_dir"),
                                             text_field=data.get("text_field", "text"))
        rows_total = len(dataset) - training.held_out
        batch = int(data.get("micro_batch_size") or 1)
        left = training.tokens_seen // T
        visited: set[int] = set()
        if rows_total >= batch and left > 0:
            sampler = ShardedEpochSampler(rows_total, batch, int(data.get("seed", 1234)))
            used = sampler.batches_per_epoch * batch
            for epoch in range(EPOCH_CAP):
                take = min(left, used)
                visited.update(int(r) for r in sampler.epoch_permutation(epoch)[:take])
                left -= take
                if left <= 0 or len(visited) >= rows_total:
                    break
        spans: list[list[int]] = []
        for r in sorted(visited):
            start, end = r * T, r * T + T
            if spans and start <= spans[-1][1] + 1:
                spans[-1][1] = max(spans[-1][1], end)
            else:
                spans.append([start, end])
        self.starts = np.array([s for s, _ in spans], dtype=np.int64)
        self.ends = np.array([e for _, e in spans], dtype=np.int64)

    def overlaps(self, start: int, end: int) -> bool:
        i = bisect.bisect_right(self.starts, end) - 1
        return i >= 0 and self.ends[i] >= start


def overlapping_rows(training: RunTraining | None, spans: TrainedSpans | None, sources: list[str], rows: list[int],
                     seq_len: int, text_field: str = "text") -> list[int] | None:
    """The rows (of the evaluation's stream at `seq_len`) that the run trained on; None: unknown
    (the model is not a run)."""
    if training is None:
        return None
    if not same_sources(training, sources):
        return []
    if not same_stream(training, sources, text_field):  # the same texts framed otherwise: positions do not line up
        return list(rows)
    return [r for r in rows if spans is not None and spans.overlaps(r * seq_len, r * seq_len + seq_len)]
