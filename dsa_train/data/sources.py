"""Document sources: local files, directories, globs, hub datasets -> a ``text`` column.

A *source* is one string in ``DataConfig.sources``:

* ``"bundled"``: the bundled public-domain demo corpus (``dsa_train/assets/corpus``).
* a file: ``.jsonl`` / ``.json`` (one document per record, text in ``text_field``, default
  ``"text"``; ``.json`` may be JSON lines or one JSON array), ``.parquet`` (one document per
  row, text in ``text_field``), or ``.txt``. A ``.txt`` file is **one document per file** by
  default (``txt_sample_by="document"``); with ``txt_sample_by="paragraph"`` it is split on
  blank lines, one document per paragraph. ``.gz``/``.zst``/... compressed variants
  (``x.jsonl.gz``) work too.
* a directory: every supported file under it (recursively, sorted by path).
* a glob: ``"/data/shards/*.parquet"``, ``"/data/**/*.jsonl"`` (sorted by path).
* a Hugging Face hub dataset: ``"owner/name"`` or ``"owner/name:config"`` (split from
  ``split``). Needs network access (or a populated HF cache); otherwise a clear error.

All loading goes through Hugging Face ``datasets``; with ``streaming=True`` the result is a
``datasets.IterableDataset`` that reads lazily (for corpora that do not fit on disk/in RAM).

Documents whose text is empty or whitespace are skipped and counted (``DocumentStats``), not
fatal. A missing file, an empty file and a missing text field are errors that name the path
and the fix.
"""

from __future__ import annotations

import glob
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Union

import datasets

BUNDLED_SOURCE = "bundled"
BUNDLED_CORPUS = Path(__file__).resolve().parents[1] / "assets" / "corpus" / "demo_corpus.jsonl"

# file suffix -> datasets builder
_BUILDERS = {".txt": "text", ".text": "text", ".jsonl": "json", ".json": "json",
             ".parquet": "parquet"}
_COMPRESSION_SUFFIXES = {".gz", ".bz2", ".xz", ".zst", ".lz4"}
_GLOB_CHARS = set("*?[")

TextDataset = Union[datasets.Dataset, datasets.IterableDataset]


class DataSourceError(ValueError):
    """A data source exists but cannot be used as given (empty, missing field, ...)."""


@dataclass(frozen=True)
class ResolvedSource:
    """One loadable unit: local files of a single format, or one hub dataset."""

    spec: str  # the source string as written in the config
    builder: str  # "text" | "json" | "parquet" | "hub"
    files: tuple[str, ...] = ()  # absolute paths, sorted; empty for hub datasets


@dataclass
class DocumentStats:
    """Counters filled while documents are read."""

    n_documents: int = 0  # non-empty documents yielded
    n_empty_skipped: int = 0  # empty / whitespace-only documents skipped


def builder_for_file(path: str | Path) -> str | None:
    """``datasets`` builder for a file name (compression suffix ignored), or None."""
    suffixes = [s.lower() for s in Path(path).suffixes]
    if suffixes and suffixes[-1] in _COMPRESSION_SUFFIXES:
        suffixes = suffixes[:-1]
    return _BUILDERS.get(suffixes[-1]) if suffixes else None


def _looks_like_local_path(spec: str) -> bool:
    return (spec.startswith(("/", "./", "../", "~")) or builder_for_file(spec) is not None
            or any(c in spec for c in _GLOB_CHARS))


def _group_files(spec: str, paths: list[str]) -> list[ResolvedSource]:
    by_builder: dict[str, list[str]] = {}
    for path in paths:
        builder = builder_for_file(path)
        if builder is not None:
            by_builder.setdefault(builder, []).append(str(Path(path).resolve()))
    return [ResolvedSource(spec, builder, tuple(sorted(files)))
            for builder, files in sorted(by_builder.items())]


def resolve_source(spec: str) -> list[ResolvedSource]:
    """Expand one source string into loadable units (one per file format found)."""
    if spec == BUNDLED_SOURCE:
        return [ResolvedSource(spec, "json", (str(BUNDLED_CORPUS),))]
    expanded = os.path.expanduser(spec)
    if any(c in expanded for c in _GLOB_CHARS):
        matches = sorted(p for p in glob.glob(expanded, recursive=True) if os.path.isfile(p))
        resolved = _group_files(spec, matches)
        if not resolved:
            raise FileNotFoundError(
                f"Data source glob {spec!r} matched no .txt/.jsonl/.json/.parquet file. Check "
                f"the pattern (use '**' for sub-directories) or list the files explicitly.")
        return resolved
    path = Path(expanded)
    if path.is_dir():
        files = sorted(str(p) for p in path.rglob("*") if p.is_file())
        resolved = _group_files(spec, files)
        if not resolved:
            raise FileNotFoundError(
                f"Data source directory {path} has no .txt/.jsonl/.json/.parquet files. Put the "
                f"documents there or point data.sources at the files themselves.")
        return resolved
    if path.is_file():
        if builder_for_file(path) is None:
            raise DataSourceError(
                f"Data source {path}: unsupported file type {''.join(path.suffixes)!r}. "
                f"Supported: .txt, .jsonl, .json, .parquet (optionally compressed, e.g. .gz).")
        return _group_files(spec, [str(path)])
    if _looks_like_local_path(spec):
        raise FileNotFoundError(
            f"Data source {path} does not exist. Fix the path in data.sources (relative paths "
            f"are resolved from the working directory {os.getcwd()}), or use 'bundled' for the "
            f"bundled demo corpus.")
    return [ResolvedSource(spec, "hub")]


def _check_file_not_empty(path: str) -> None:
    size = os.path.getsize(path)
    if size == 0 or (size < (1 << 20) and builder_for_file(path) != "parquet"
                     and not Path(path).suffix.lower() in _COMPRESSION_SUFFIXES
                     and not Path(path).read_bytes().strip()):
        raise DataSourceError(
            f"Data source file {path} is empty. Remove it from data.sources (or from its "
            f"directory/glob), or fill it with documents.")


def _select_text_column(dataset: TextDataset, source: ResolvedSource, text_field: str,
                        streaming: bool) -> TextDataset:
    """Reduce to a single ``text`` column, with a clear error if ``text_field`` is missing."""
    columns = dataset.column_names
    if columns is None and streaming:  # streaming json: columns unknown until the first record
        first = next(iter(dataset), None)
        columns = list(first.keys()) if first is not None else [text_field]
    if text_field not in columns:
        where = source.files[0] if len(source.files) == 1 else (
            f"{source.spec} ({len(source.files)} files)" if source.files else source.spec)
        raise DataSourceError(
            f"Data source {where} has no field {text_field!r}; its fields are {sorted(columns)}. "
            f"Fix: set data.text_field to the field holding the document text.")
    dataset = dataset.select_columns([text_field])
    if text_field != "text":
        dataset = dataset.rename_column(text_field, "text")
    return dataset


def load_resolved_source(source: ResolvedSource, text_field: str = "text", *,
                         streaming: bool = False, txt_sample_by: str = "document",
                         split: str = "train", cache_dir: str | None = None) -> TextDataset:
    """Load one resolved source as a dataset with exactly one column, ``text``."""
    if source.builder == "hub":
        name, _, config_name = source.spec.partition(":")
        try:
            dataset = datasets.load_dataset(name, config_name or None, split=split,
                                            streaming=streaming, cache_dir=cache_dir)
        except Exception as err:
            raise DataSourceError(
                f"Could not load {source.spec!r}: it is not a local file or directory, and "
                f"loading it as a Hugging Face hub dataset (split {split!r}) failed: "
                f"{type(err).__name__}: {err}. Without network access, download it elsewhere "
                f"and point data.sources at the local .jsonl/.parquet files.") from err
        return _select_text_column(dataset, source, text_field, streaming)

    for path in source.files:
        _check_file_not_empty(path)
    kwargs = {}
    if source.builder == "text":
        if txt_sample_by not in ("document", "paragraph"):
            raise ValueError(f"txt_sample_by must be 'document' (one document per .txt file) or "
                             f"'paragraph' (split on blank lines), got {txt_sample_by!r}")
        kwargs["sample_by"] = txt_sample_by
        text_field = "text"  # the text builder always produces a `text` column
    dataset = datasets.load_dataset(source.builder, data_files=list(source.files), split="train",
                                    streaming=streaming, cache_dir=cache_dir, **kwargs)
    return _select_text_column(dataset, source, text_field, streaming)


def load_documents(sources: list[str] | str, text_field: str = "text", *, streaming: bool = False,
                   txt_sample_by: str = "document", split: str = "train",
                   cache_dir: str | None = None) -> TextDataset:
    """Load all sources, in order, as one dataset with a single ``text`` column.

    Returns a ``datasets.Dataset`` (map-style) or, with ``streaming=True``, a
    ``datasets.IterableDataset``. Empty documents are still present here; ``iter_texts``
    skips and counts them.
    """
    if isinstance(sources, str):
        sources = [sources]
    if not sources:
        raise ValueError("data.sources is empty: give at least one source (e.g. ['bundled']).")
    parts = [load_resolved_source(resolved, text_field, streaming=streaming,
                                  txt_sample_by=txt_sample_by, split=split, cache_dir=cache_dir)
             for spec in sources for resolved in resolve_source(spec)]
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def is_empty_text(text: object) -> bool:
    return text is None or (isinstance(text, str) and not text.strip())


def iter_texts(dataset: TextDataset, stats: DocumentStats | None = None,
               batch_size: int = 1000) -> Iterator[list[str]]:
    """Yield lists of non-empty document texts (up to ``batch_size``), counting skipped ones."""
    stats = stats if stats is not None else DocumentStats()
    for batch in dataset.iter(batch_size=batch_size):
        texts = []
        for text in batch["text"]:
            if is_empty_text(text):
                stats.n_empty_skipped += 1
                continue
            if not isinstance(text, str):
                raise DataSourceError(f"Document text must be a string, got {type(text).__name__}"
                                      f": {str(text)[:80]!r}. Check data.text_field.")
            texts.append(text)
        stats.n_documents += len(texts)
        if texts:
            yield texts


def sources_fingerprint(sources: list[str], text_field: str, txt_sample_by: str,
                        split: str) -> str:
    """Hash of what the sources contain now (paths, sizes, mtimes), for cache keys."""
    hasher = hashlib.sha256(f"{text_field}|{txt_sample_by}|{split}".encode())
    for spec in sources:
        for resolved in resolve_source(spec):
            hasher.update(f"|{resolved.spec}|{resolved.builder}".encode())
            for path in resolved.files:
                st = os.stat(path)
                hasher.update(f"|{path}|{st.st_size}|{st.st_mtime_ns}".encode())
    return hasher.hexdigest()
