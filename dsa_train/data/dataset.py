"""``PackedDataset``: map-style view of packed sequences over a pre-tokenized, memory-mapped stream.

``PackedDataset(path)`` opens a directory written by ``prepare_data`` (``tokens.bin``,
``doc_offsets.bin``, ``index.json``). ``PackedDataset.from_sources(...)`` builds that
directory once under a cache dir, keyed by a hash of (sources and their sizes/mtimes, read
settings, tokenizer hash, add_bos/add_eos), then opens it. ``seq_len`` is not part of the key:
rows are cut on the fly, so one cached stream serves every sequence length.

``dataset[r]`` -> ``{"input_ids": [T], "labels": [T], "position_ids": [T]}`` int64 (see
``packing.py`` for the convention).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from dsa_train.data.packing import doc_start_mask, num_rows, pack_row
from dsa_train.data.prepare import (DOC_OFFSETS_FILE, FORMAT_NAME, FORMAT_VERSION, INDEX_FILE,
                                    prepare_data, remove_stale_temporaries)
from dsa_train.data.sources import DataSourceError, DataSourceNotFound, is_prepared_dir, sources_fingerprint
from dsa_train.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """``$DSA_TRAIN_CACHE`` or ``~/.cache/dsa_train``."""
    return Path(os.environ.get("DSA_TRAIN_CACHE", Path.home() / ".cache" / "dsa_train"))


@contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    """Inter-process lock (several ranks on a node building the same cache entry)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _complete(entry: Path) -> bool:
    """A cache entry whose index and token stream agree (a truncated one is built again)."""
    try:
        index = json.loads((entry / INDEX_FILE).read_text())
        size = (entry / index["tokens_file"]).stat().st_size
        return size == int(index["n_tokens"]) * np.dtype(index["token_dtype"]).itemsize
    except (OSError, ValueError, KeyError, TypeError):
        return False


class PackedDataset(torch.utils.data.Dataset):
    """Fixed-length training sequences cut from a memory-mapped token stream.

    Args:
        path: a directory written by ``prepare_data``.
        seq_len: tokens per sequence ``T``; default: the ``seq_len`` recorded at prepare time.
        tokenizer: if given, the dataset must have been tokenized by this tokenizer (hash and
            vocab size are checked); a mismatch raises with both values and the fix.
    """

    def __init__(self, path: str | Path, seq_len: int | None = None,
                 tokenizer: Tokenizer | None = None) -> None:
        self.path = Path(path).expanduser()
        index_path = self.path / INDEX_FILE
        if not index_path.is_file():
            raise DataSourceNotFound(f"{index_path} not found: {self.path} is not a prepared "
                                    f"dataset. Create it with `dsa-train prepare-data --out "
                                    f"{self.path} ...`.")
        self.index = json.loads(index_path.read_text())
        if self.index.get("format") != FORMAT_NAME or self.index.get("version") != FORMAT_VERSION:
            raise DataSourceError(f"{index_path}: format {self.index.get('format')!r} version "
                             f"{self.index.get('version')!r}, expected {FORMAT_NAME!r} version "
                             f"{FORMAT_VERSION}. Re-run `dsa-train prepare-data`.")
        if tokenizer is not None:
            self.check_tokenizer(tokenizer)
        self.seq_len = int(seq_len if seq_len is not None else self.index["seq_len"])
        if self.seq_len < 1:
            raise DataSourceError(f"seq_len must be >= 1, got {self.seq_len}")
        self.n_tokens = int(self.index["n_tokens"])
        self.token_dtype = np.dtype(self.index["token_dtype"])
        tokens_path = self.path / self.index["tokens_file"]
        expected_bytes = self.n_tokens * self.token_dtype.itemsize
        if not tokens_path.is_file() or tokens_path.stat().st_size != expected_bytes:
            raise DataSourceError(f"{tokens_path} is missing or truncated (expected {expected_bytes} bytes)",
                                  fix=f"prepare it again: `{self.prepare_command()}`")
        self.num_sequences = num_rows(self.n_tokens, self.seq_len)
        if self.num_sequences == 0:
            raise DataSourceError(f"{self.path} holds {self.n_tokens} tokens, fewer than seq_len + 1 = "
                             f"{self.seq_len + 1}: not a single training sequence. Add data or "
                             f"lower data.seq_len.")
        self._tokens: np.ndarray | None = None  # opened lazily: memmaps must not be pickled
        self._doc_offsets: np.ndarray | None = None

    def prepare_command(self, tokenizer: str | None = None) -> str:
        """The `dsa-train prepare-data` command that writes this dataset again (from its index)."""
        import shlex

        index = self.index
        parts = ["dsa-train", "prepare-data", "--source", *map(str, index.get("sources") or ["SOURCE"])]
        tok = tokenizer if tokenizer is not None else index.get("tokenizer_path")
        if tok:
            parts += ["--tokenizer", str(tok)]
        parts += ["--out", str(self.path), "--seq-len", str(index.get("seq_len", 4096))]
        if index.get("text_field", "text") != "text":
            parts += ["--text-field", index["text_field"]]
        if index.get("txt_sample_by", "document") != "document":
            parts += ["--txt-sample-by", index["txt_sample_by"]]
        parts += [*(["--no-bos"] if index.get("add_bos") is False else []),
                  *(["--no-eos"] if index.get("add_eos") is False else []), "--overwrite"]
        return shlex.join(parts)

    def check_tokenizer(self, tokenizer: Tokenizer) -> None:
        recorded_hash, recorded_vocab = self.index["tokenizer_hash"], self.index["vocab_size"]
        if recorded_hash != tokenizer.content_hash or recorded_vocab != tokenizer.vocab_size:
            raise DataSourceError(
                f"{self.path} was tokenized with a different tokenizer: recorded "
                f"{self.index.get('tokenizer_path')} (vocab {recorded_vocab}, hash "
                f"{recorded_hash[:12]}), but the run uses {tokenizer.path} (vocab "
                f"{tokenizer.vocab_size}, hash {tokenizer.content_hash[:12]})",
                fix="set data.tokenizer to the tokenizer used at prepare time, or prepare the data again with the "
                    f"run's tokenizer: `{self.prepare_command(str(tokenizer.path.parent))}`")

    # -- memmaps ---------------------------------------------------------------------------
    @property
    def tokens(self) -> np.ndarray:
        """The token stream ``S [n_tokens]`` (memmap)."""
        if self._tokens is None:
            self._tokens = np.memmap(self.path / self.index["tokens_file"], dtype=self.token_dtype,
                                     mode="r", shape=(self.n_tokens,))
        return self._tokens

    @property
    def doc_offsets(self) -> np.ndarray:
        """``[n_documents + 1]`` int64 start offsets of documents in the stream (memmap)."""
        if self._doc_offsets is None:
            self._doc_offsets = np.memmap(
                self.path / self.index.get("doc_offsets_file", DOC_OFFSETS_FILE), dtype=np.int64,
                mode="r", shape=(int(self.index["n_documents"]) + 1,))
        return self._doc_offsets

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_tokens"] = state["_doc_offsets"] = None
        return state

    # -- Dataset ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.num_sequences

    def __getitem__(self, row: int) -> dict[str, torch.Tensor]:
        if not 0 <= row < self.num_sequences:
            raise IndexError(f"row {row} out of range [0, {self.num_sequences})")
        start = row * self.seq_len
        window = np.asarray(self.tokens[start: start + self.seq_len + 1], dtype=np.int64)
        return pack_row(window, doc_start_mask(self.doc_offsets, start, self.seq_len + 1))

    def get_batch(self, rows: Sequence[int]) -> dict[str, torch.Tensor]:
        """Stack rows into ``input_ids / labels / position_ids [B, T]``."""
        return collate_sequences([self[int(r)] for r in rows])

    # -- building ----------------------------------------------------------------------------
    @classmethod
    def from_sources(cls, sources: Sequence[str], tokenizer: Tokenizer, seq_len: int, *,
                     cache_dir: str | Path | None = None, text_field: str = "text",
                     txt_sample_by: str = "document", add_bos: bool = True,
                     add_eos: bool = True, split: str = "train") -> "PackedDataset":
        """Open the cached pre-tokenized stream for these sources, building it if needed.

        A single source that is itself a prepared directory is opened directly.
        """
        sources = list(sources)
        if len(sources) == 1 and is_prepared_dir(sources[0]):
            return cls(sources[0], seq_len=seq_len, tokenizer=tokenizer)
        cache_root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
        key = hashlib.sha256(json.dumps({
            "format": [FORMAT_NAME, FORMAT_VERSION],
            "sources": sources_fingerprint(sources, text_field, txt_sample_by, split),
            "tokenizer": tokenizer.content_hash,
            "add_bos": add_bos, "add_eos": add_eos,
        }, sort_keys=True).encode()).hexdigest()[:20]
        entry = cache_root / "packed" / key
        if _complete(entry) and not os.access(entry.parent, os.W_OK):  # a read-only cache that holds it
            return cls(entry, seq_len=seq_len, tokenizer=tokenizer)
        try:
            with _exclusive_lock(cache_root / "packed" / f"{key}.lock"):
                cls._build_entry(entry, sources, tokenizer, seq_len, cache_root, text_field, txt_sample_by,
                                 add_bos, add_eos, split)
        except OSError as err:
            if err.filename is None or not str(err.filename).startswith(str(cache_root)):
                raise
            raise DataSourceError(
                f"the data cache {cache_root} cannot be written: {err.strerror or err} ({err.filename})",
                fix="make it writable, or point DSA_TRAIN_CACHE at a writable directory (or prepare the data once with "
                    "`dsa-train prepare-data --out DIR ...` and train with data.sources=[DIR])") from err
        return cls(entry, seq_len=seq_len, tokenizer=tokenizer)

    @staticmethod
    def _build_entry(entry: Path, sources, tokenizer, seq_len, cache_root: Path, text_field, txt_sample_by,
                     add_bos, add_eos, split) -> None:
        remove_stale_temporaries(entry)  # of a build that was killed
        if is_prepared_dir(entry) and not _complete(entry):  # the cache is ours: rebuilt, not reported
            log.warning("data cache %s is truncated: building it again", entry)
        if not _complete(entry):
            prepare_data(sources, tokenizer, entry, seq_len, text_field=text_field, txt_sample_by=txt_sample_by,
                         add_bos=add_bos, add_eos=add_eos, split=split, hf_cache_dir=str(cache_root / "hf_datasets"),
                         overwrite=True)


def collate_sequences(sequences: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """List of ``{key: [T]}`` -> ``{key: [B, T]}``."""
    return {key: torch.stack([s[key] for s in sequences]) for key in sequences[0]}
