"""Streaming loader: pack documents on the fly from a ``datasets.IterableDataset``.

For corpora too large to pre-tokenize. Epoch ``e`` reads the sources as a stream (shuffled with
a ``shuffle_buffer``-document buffer seeded by ``seed`` and ``e``, when ``shuffle_buffer > 0``);
document ``d`` of that stream goes to data-parallel rank ``d % dp_size``. Each rank tokenizes,
frames (``[bos] + tokens + [eos]``) and packs its documents exactly as ``packing.py`` describes
(windows of ``T + 1`` tokens overlapping by one, position ids restarting at documents and rows,
labels -100 at document ends). Leftover tokens at the end of an epoch (fewer than ``T + 1``)
are dropped and the next epoch starts.

Resume counts consumed documents: the state is ``(epoch, doc_index, doc_offset)``, the stream
position where the next row begins (document ``doc_index`` of the epoch's stream, token
``doc_offset`` of its framed tokens). A resumed loader re-reads the stream, skips the documents
before ``doc_index`` without tokenizing them, drops ``doc_offset`` tokens and continues: it yields
exactly the batches an uninterrupted loader would.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from dsa_train.data.dataset import collate_sequences
from dsa_train.data.packing import frame_document, pack_row
from dsa_train.data.naming import setting
from dsa_train.data.sources import (DataSourceError, DocumentStats, is_empty_text, load_documents, resolve_source,
                                    unreadable_source_error)
from dsa_train.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_TOKENIZE_BATCH = 64  # documents tokenized per encode_batch call


class StreamingPackedLoader:
    """Infinite iterator of ``{"input_ids", "labels", "position_ids"}: [B, T] int64`` batches."""

    def __init__(self, sources: Sequence[str], tokenizer: Tokenizer, seq_len: int,
                 batch_size: int, seed: int, dp_rank: int = 0, dp_size: int = 1, *,
                 text_field: str = "text", txt_sample_by: str = "document",
                 add_bos: bool = True, add_eos: bool = True, shuffle_buffer: int = 10_000,
                 split: str = "train", hf_cache_dir: str | None = None) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, dp_size={dp_size}), got {dp_rank}")
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len and micro_batch_size must be >= 1, got {seq_len}, "
                             f"{batch_size}")
        frame_document([], tokenizer.bos_id, tokenizer.eos_id, add_bos, add_eos)  # validate
        self.tokenizer = tokenizer
        self.sources = list(sources)
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.add_bos, self.add_eos = add_bos, add_eos
        self.shuffle_buffer = shuffle_buffer
        self.stats = DocumentStats()
        self.text_field = text_field
        self._documents = load_documents(self.sources, text_field, streaming=True,
                                         txt_sample_by=txt_sample_by, split=split,
                                         cache_dir=hf_cache_dir)
        self.epoch, self.doc_index, self.doc_offset = 0, 0, 0
        self._stream: Iterator[tuple[int, int, list[int]]] | None = None
        # Packing buffer: tokens not yet emitted, with (document index, offset in document).
        self._buffer_tokens: list[int] = []
        self._buffer_doc: list[int] = []
        self._buffer_offset: list[int] = []

    # -- document stream ---------------------------------------------------------------------
    def _epoch_texts(self, epoch: int) -> Iterator[str]:
        documents = self._documents
        if self.shuffle_buffer > 0:
            documents = documents.shuffle(seed=self.seed, buffer_size=self.shuffle_buffer)
            documents.set_epoch(epoch)
        examples = iter(documents)
        while True:
            try:
                example = next(examples)
            except StopIteration:
                return
            except Exception as err:  # a line that is not JSON / not UTF-8: name the file and line
                raise unreadable_source_error(
                    [r for spec in self.sources for r in resolve_source(spec)], err) from err
            yield example["text"]

    def _framed_documents(self, epoch: int, first_doc: int,
                          first_offset: int) -> Iterator[tuple[int, int, list[int]]]:
        """Yield ``(doc_index, start_offset, framed_tokens[start_offset:])`` for this rank."""
        pending: list[tuple[int, str]] = []

        def flush() -> Iterator[tuple[int, int, list[int]]]:
            encoded = self.tokenizer.encode_batch([text for _, text in pending])
            for (index, _), ids in zip(pending, encoded):
                framed = frame_document(ids, self.tokenizer.bos_id, self.tokenizer.eos_id,
                                        self.add_bos, self.add_eos)
                offset = first_offset if index == first_doc else 0
                yield index, offset, framed[offset:]
            pending.clear()

        for index, text in enumerate(self._epoch_texts(epoch)):
            if index < first_doc or index % self.dp_size != self.dp_rank:
                continue
            if is_empty_text(text):
                self.stats.skip(text)
                if text is None and self.stats.n_missing_text in (1, 1000):
                    log.warning("data: a record without the %r field (or null) was skipped (%d so far); "
                                "set %s if the text is under another name", self.text_field,
                                self.stats.n_missing_text, setting("text_field"))
                continue
            self.stats.n_documents += 1
            pending.append((index, text))
            if len(pending) >= _TOKENIZE_BATCH:
                yield from flush()
        if pending:
            yield from flush()

    # -- packing -----------------------------------------------------------------------------
    def _fill_buffer(self, needed: int) -> bool:
        """Read documents until the buffer holds ``needed`` tokens; False at end of epoch."""
        while len(self._buffer_tokens) < needed:
            if self._stream is None:
                self._stream = self._framed_documents(self.epoch, self.doc_index, self.doc_offset)
            item = next(self._stream, None)
            if item is None:
                return False
            index, offset, tokens = item
            self._buffer_tokens.extend(tokens)
            self._buffer_doc.extend([index] * len(tokens))
            self._buffer_offset.extend(range(offset, offset + len(tokens)))
        return True

    def _clear_buffer(self) -> None:
        self._buffer_tokens, self._buffer_doc, self._buffer_offset = [], [], []
        self._stream = None

    def _next_row(self) -> dict[str, torch.Tensor]:
        window_len = self.seq_len + 1
        empty_epochs = 0
        while not self._fill_buffer(window_len):  # epoch exhausted: roll over
            produced_rows = not (self.doc_index == 0 and self.doc_offset == 0)
            empty_epochs = 0 if produced_rows else empty_epochs + 1
            if empty_epochs >= 2:
                raise ValueError(
                    f"Data sources {self.sources} give rank {self.dp_rank} fewer than seq_len + 1"
                    f" = {window_len} tokens per epoch: no training sequence. Add data or lower "
                    f"data.seq_len.")
            self._clear_buffer()
            self.epoch, self.doc_index, self.doc_offset = self.epoch + 1, 0, 0
        window = np.asarray(self._buffer_tokens[:window_len], dtype=np.int64)  # [T + 1]
        is_doc_start = np.asarray(self._buffer_offset[:window_len]) == 0  # [T + 1]
        row = pack_row(window, is_doc_start)
        # Keep the window's last token: it is the first input of the next row.
        del self._buffer_tokens[:self.seq_len]
        del self._buffer_doc[:self.seq_len]
        del self._buffer_offset[:self.seq_len]
        self.doc_index, self.doc_offset = self._buffer_doc[0], self._buffer_offset[0]
        return row

    def __iter__(self) -> "StreamingPackedLoader":
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        return collate_sequences([self._next_row() for _ in range(self.batch_size)])

    # -- resume ------------------------------------------------------------------------------
    def _settings(self) -> dict[str, Any]:
        return {"kind": "streaming", "seed": self.seed, "dp_size": self.dp_size,
                "micro_batch_size": self.batch_size, "seq_len": self.seq_len,
                "shuffle_buffer": self.shuffle_buffer, "add_bos": self.add_bos,
                "add_eos": self.add_eos}

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "doc_index": self.doc_index, "doc_offset": self.doc_offset,
                "dp_rank": self.dp_rank, **self._settings()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        expected = self._settings()
        mismatched = {k: (state_dict.get(k), v) for k, v in expected.items()
                      if state_dict.get(k) != v}
        if mismatched:
            details = ", ".join(f"{k}: saved {a!r} vs now {b!r}" for k, (a, b) in mismatched.items())
            raise DataSourceError(f"Streaming data loader state does not match this run ({details})",
                                  fix="resume with the settings the checkpoint was written with, or start a new run_dir")
        if state_dict.get("dp_rank") != self.dp_rank:
            raise ValueError(f"Streaming data loader state was saved by dp_rank "
                             f"{state_dict.get('dp_rank')}, this is dp_rank {self.dp_rank}: "
                             f"streaming positions are per rank; load each rank's own state.")
        self._clear_buffer()
        self.epoch = int(state_dict["epoch"])
        self.doc_index = int(state_dict["doc_index"])
        self.doc_offset = int(state_dict["doc_offset"])
