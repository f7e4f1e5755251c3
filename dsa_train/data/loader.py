"""Deterministic, resumable, data-parallel-sharded batches over a ``PackedDataset``.

Order: epoch ``e`` visits the sequences in the permutation ``default_rng([seed, e])``. Each
optimizer-visible "global micro-batch" takes ``dp_size * B`` consecutive entries of the
permutation; rank ``r`` gets entries ``r, r + dp_size, ...`` of it (``B = micro_batch_size``),
so ranks see disjoint sequences that together cover the epoch. The tail of the permutation that
does not fill a whole global micro-batch (fewer than ``dp_size * B`` sequences; different ones
each epoch) is skipped, so every rank has the same number of batches per epoch.

Resume: ``state_dict()`` is ``{epoch, batch_in_epoch, ...}`` after the batches consumed so far;
a loader given it by ``load_state_dict`` yields exactly the batch an uninterrupted loader would
yield next. The iterator is infinite: epochs roll over.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Iterator

import numpy as np
import torch

from dsa_train.data.dataset import PackedDataset, collate_sequences
from dsa_train.data.sources import DataSourceError
from dsa_train.data.tokenizer import Tokenizer


@dataclass
class DataLoaderState:
    epoch: int = 0
    batch_in_epoch: int = 0  # batches already consumed in this epoch, on this rank


class ShardedEpochSampler:
    """Per-epoch shuffled sequence indices for one data-parallel rank, cut into micro-batches."""

    def __init__(self, num_sequences: int, batch_size: int, seed: int, dp_rank: int = 0,
                 dp_size: int = 1) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, dp_size={dp_size}), got {dp_rank}")
        if batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {batch_size}")
        self.num_sequences, self.batch_size, self.seed = num_sequences, batch_size, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.batches_per_epoch = num_sequences // (dp_size * batch_size)
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"The dataset has {num_sequences} sequences, fewer than dp_size * "
                f"micro_batch_size = {dp_size} * {batch_size}: no rank gets a full batch. Add "
                f"data, lower data.seq_len, or lower data.micro_batch_size.")

    def epoch_permutation(self, epoch: int) -> np.ndarray:
        """``[num_sequences]``: the global visiting order of epoch ``epoch`` (same on all ranks)."""
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_sequences)

    def epoch_batches(self, epoch: int) -> np.ndarray:
        """``[batches_per_epoch, B]`` sequence indices of this rank for ``epoch``."""
        used = self.batches_per_epoch * self.dp_size * self.batch_size
        rank_indices = self.epoch_permutation(epoch)[:used][self.dp_rank::self.dp_size]
        return rank_indices.reshape(self.batches_per_epoch, self.batch_size)


class PackedDataLoader:
    """Infinite iterator of ``{"input_ids", "labels", "position_ids"}: [B, T] int64`` batches.

    ``num_workers > 0`` reads batches in background worker processes (a torch ``DataLoader``
    over the remaining batches of the epoch); the order and the resume state are unchanged.
    """

    def __init__(self, dataset: PackedDataset, batch_size: int, seed: int, dp_rank: int = 0,
                 dp_size: int = 1, num_workers: int = 0, tokenizer: Tokenizer | None = None, held_out: int = 0):
        if not 0 <= held_out < len(dataset):
            raise ValueError(f"eval.num_sequences={held_out} held-out sequences leave no training data: the data "
                             f"holds {len(dataset)} sequences of {dataset.seq_len} tokens. Lower eval.num_sequences "
                             "or add data.")
        self.dataset = dataset
        self.tokenizer = tokenizer
        self.num_workers = num_workers
        # the last `held_out` rows of the packed stream are never visited (the recipe's evaluation reads them)
        self.held_out = held_out
        self.sampler = ShardedEpochSampler(len(dataset) - held_out, batch_size, seed, dp_rank, dp_size)
        self.state = DataLoaderState()
        self._batch_iter: Iterator[dict[str, torch.Tensor]] | None = None

    @property
    def held_out_rows(self) -> list[int]:
        """Row indices of the packed stream that training never visits: its last `held_out` rows."""
        return list(range(len(self.dataset) - self.held_out, len(self.dataset)))

    @property
    def batches_per_epoch(self) -> int:
        return self.sampler.batches_per_epoch

    def _remaining_batches_of_epoch(self) -> Iterator[dict[str, torch.Tensor]]:
        batches = self.sampler.epoch_batches(self.state.epoch)[self.state.batch_in_epoch:]
        if self.num_workers == 0:
            return (self.dataset.get_batch(rows) for rows in batches)
        return iter(torch.utils.data.DataLoader(
            self.dataset, batch_sampler=batches.tolist(), num_workers=self.num_workers,
            collate_fn=collate_sequences, prefetch_factor=2))

    def __iter__(self) -> "PackedDataLoader":
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.state.batch_in_epoch >= self.batches_per_epoch:
            self.state = DataLoaderState(epoch=self.state.epoch + 1, batch_in_epoch=0)
            self._batch_iter = None
        if self._batch_iter is None:
            self._batch_iter = self._remaining_batches_of_epoch()
        batch = next(self._batch_iter)
        self.state.batch_in_epoch += 1
        return batch

    def _settings(self) -> dict[str, Any]:
        s = self.sampler
        return {"kind": "packed", "seed": s.seed, "dp_rank": s.dp_rank, "dp_size": s.dp_size,
                "micro_batch_size": s.batch_size, "num_sequences": s.num_sequences,
                "seq_len": self.dataset.seq_len}

    def _converted(self, saved: dict[str, Any]) -> dict[str, Any]:
        """A position saved under another data-parallel size or micro-batch size, as this loader's:
        the same number of sequences of the epoch consumed (global micro-batches take consecutive
        entries of the epoch's permutation, so the next step reads the same sequences). Unchanged
        when the sizes match or the position falls between this loader's micro-batches (then the
        mismatch is reported)."""
        s = self.sampler
        dp, mb = saved.get("dp_size"), saved.get("micro_batch_size")
        if (dp, mb) == (s.dp_size, s.batch_size) or dp is None or mb is None:
            return saved
        consumed = int(saved["batch_in_epoch"]) * dp * mb  # sequences of the epoch used so far
        saved_batches = saved.get("num_sequences", s.num_sequences) // (dp * mb)
        epoch = int(saved["epoch"])
        if int(saved["batch_in_epoch"]) >= saved_batches:  # the saved epoch was over: the next one starts
            epoch, consumed = epoch + 1, 0
        if consumed % (s.dp_size * s.batch_size):
            return saved
        return {**saved, "epoch": epoch, "batch_in_epoch": consumed // (s.dp_size * s.batch_size),
                "dp_size": s.dp_size, "micro_batch_size": s.batch_size}

    def state_dict(self) -> dict[str, Any]:
        """Position after the batches consumed so far, plus the settings it is valid for."""
        return {**asdict(self.state), **self._settings()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from ``state_dict``; raises if it was saved under different settings."""
        expected = self._settings()
        state_dict = self._converted(state_dict)
        mismatched = {k: (state_dict.get(k), v) for k, v in expected.items()
                      if k != "dp_rank" and state_dict.get(k) != v}
        if mismatched:
            details = ", ".join(f"{k}: saved {a!r} vs now {b!r}" for k, (a, b) in mismatched.items())
            raise DataSourceError(f"Data loader state does not match this run ({details}); exact "
                                  f"resume needs the same data, seq_len, seed, dp_size and "
                                  f"micro_batch_size.", fix="resume with the settings the checkpoint was "
                                  "written with, or start a new run_dir")
        self.state = DataLoaderState(epoch=int(state_dict["epoch"]),
                                     batch_in_epoch=int(state_dict["batch_in_epoch"]))
        self._batch_iter = None
