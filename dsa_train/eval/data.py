"""Held-out sequences for the evaluation.

The sequences are rows of the training data path's own packed stream
(`PackedDataset.from_sources`: the same tokenizer, document framing and cache as training), at the
evaluation's sequence length. Which rows: the training loader visits the rows of an epoch in the
order `ShardedEpochSampler.epoch_permutation(0)` (a pure function of `data.seed`); the evaluation
takes that order's last rows, those a training run with the same seed and sequence length feeds
last in its first epoch. The bundled corpus has no split that training never reads: a run that
completes an epoch has seen every row. For text no run trained on, pass `--data` files that are not
among the recipe's `data.sources`.

The recipe's `eval` group holds its rows out differently: the last rows of the training stream,
which its training loader never visits (`in_training.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsa_train.data import PackedDataset, ShardedEpochSampler, Tokenizer

DEFAULT_SEED = 1234  # data.seed's default (dsa_train.data.DataConfig)


@dataclass
class HeldOut:
    rows: list[int]  # row indices of the packed stream at this sequence length
    batches: list[dict[str, torch.Tensor]]  # per row {"input_ids", "labels", "position_ids"}: [1, T]
    available: int  # rows the stream holds at this length


def heldout_sequences(sources: list[str], tokenizer: Tokenizer, seq_len: int, num_sequences: int,
                      seed: int = DEFAULT_SEED, text_field: str = "text") -> HeldOut:
    """`sources` as in `data.sources` ("bundled": the bundled corpus) -> the last `num_sequences` rows
    of the training loader's first-epoch order (fewer if the stream holds fewer rows)."""
    dataset = PackedDataset.from_sources(sources, tokenizer, seq_len, text_field=text_field)
    order = ShardedEpochSampler(len(dataset), 1, seed).epoch_permutation(0)
    return rows_of(dataset, [int(r) for r in order[::-1][:num_sequences]])


def rows_of(dataset: PackedDataset, rows: list[int]) -> HeldOut:
    """The given rows of a packed stream, one batch [1, T] each."""
    return HeldOut(list(rows), [dataset.get_batch([r]) for r in rows], len(dataset))
