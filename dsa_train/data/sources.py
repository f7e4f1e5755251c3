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

Local files (the bundled corpus included) load without Hugging Face ``datasets``: the standard
library reads JSON lines, JSON arrays and text (plain, .gz, .bz2, .xz), pyarrow reads parquet
(`LocalDocuments`), in the same order and with the same documents as ``datasets`` would. Hub
datasets, ``.zst``/``.lz4`` files and ``streaming=True`` (a ``datasets.IterableDataset`` that reads
lazily and shuffles in a buffer, for corpora that do not fit on disk/in RAM) go through
``datasets``, imported only then: it is the ``data`` extra (``pip install 'dsa-train[data]'``).

Documents whose text is empty or whitespace are skipped and counted (``DocumentStats``), not
fatal. A missing file, an empty file and a missing text field are errors that name the path
and the fix.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Union

from dsa_train.data.naming import setting
from dsa_train.errors import DSATrainError

if TYPE_CHECKING:
    import datasets

BUNDLED_SOURCE = "bundled"
BUNDLED_CORPUS = Path(__file__).resolve().parents[1] / "assets" / "corpus" / "demo_corpus.jsonl"

# file suffix -> datasets builder
_BUILDERS = {".txt": "text", ".text": "text", ".jsonl": "json", ".json": "json",
             ".parquet": "parquet"}
_COMPRESSION_SUFFIXES = {".gz", ".bz2", ".xz", ".zst", ".lz4"}
_GLOB_CHARS = set("*?[")

TextDataset = Union["datasets.Dataset", "datasets.IterableDataset", "LocalDocuments", "ChainedDocuments"]
# compressions the standard library reads (the local reader); .zst / .lz4 need `datasets` (fsspec)
_STDLIB_COMPRESSION = {"", ".gz", ".bz2", ".xz"}


class DataSourceError(DSATrainError, ValueError):
    """A data source exists but cannot be used as given (empty, missing field, a line that is not
    JSON or not UTF-8, ...). The message names the file (and line)."""


class DataSourceNotFound(DataSourceError, FileNotFoundError):
    """A data source path, directory or glob that names no data file."""


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
    n_missing_text: int = 0  # records without the text field (or with null): skipped, and logged

    def skip(self, text: object) -> None:
        """Count a document that is skipped (is_empty_text(text))."""
        if text is None:
            self.n_missing_text += 1
        else:
            self.n_empty_skipped += 1

    def describe_skipped(self, text_field: str = "text") -> str | None:
        """A warning line when records without the text field were skipped, else None."""
        if not self.n_missing_text:
            return None
        return (f"{self.n_missing_text} record(s) had no {text_field!r} field (or null) and were skipped "
                f"({self.n_documents} documents used); set {setting('text_field')} if the text is under another name")


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


# a `dsa-train prepare-data` output directory: its index.json names this format (data/prepare.py)
FORMAT_NAME = "dsa_train.pretokenized"
INDEX_FILE = "index.json"


def is_prepared_dir(path: str | os.PathLike) -> bool:
    """Whether `path` is a prepare-data output: a folder whose index.json names FORMAT_NAME (the one
    check, for a source, the data cache and prepare-data's --out; a folder of documents that
    happens to hold an index.json of something else is not one)."""
    try:
        return json.loads((Path(path).expanduser() / INDEX_FILE).read_text()).get("format") == FORMAT_NAME
    except (OSError, ValueError, AttributeError):
        return False


def is_local_source(spec: str, workdir: str | os.PathLike = ".") -> bool:
    """Whether a `data.sources` entry names local files (relative ones from `workdir`), as
    `resolve_source` reads it: not the bundled corpus, not a hub dataset."""
    if spec == BUNDLED_SOURCE:
        return False
    return _looks_like_local_path(spec) or (Path(workdir) / os.path.expanduser(spec)).exists()


def resolve_source(spec: str) -> list[ResolvedSource]:
    """Expand one source string into loadable units (one per file format found)."""
    if spec == BUNDLED_SOURCE:
        return [ResolvedSource(spec, "json", (str(BUNDLED_CORPUS),))]
    expanded = os.path.expanduser(spec)
    if any(c in expanded for c in _GLOB_CHARS):
        matches = sorted(p for p in glob.glob(expanded, recursive=True) if os.path.isfile(p))
        resolved = _group_files(spec, matches)
        if not resolved:
            raise DataSourceNotFound(
                f"Data source glob {spec!r} matched no .txt/.jsonl/.json/.parquet file. Check "
                f"the pattern (use '**' for sub-directories) or list the files explicitly.")
        return resolved
    path = Path(expanded)
    if is_prepared_dir(path):
        raise DataSourceError(
            f"Data source {path} is a prepare-data output (already tokenized): it is read on its own, not "
            f"as documents among other sources or streamed",
            fix=f"train on it as the only source, not streamed: data.sources=[{spec}] data.streaming=false; or "
                f"list the documents it was made from instead")
    if path.is_dir():
        files = sorted(str(p) for p in path.rglob("*") if p.is_file())
        resolved = _group_files(spec, files)
        if not resolved:
            raise DataSourceNotFound(
                f"Data source directory {path} has no .txt/.jsonl/.json/.parquet files. Put the "
                f"documents there or point {setting('sources')} at the files themselves.")
        return resolved
    if path.is_file():
        if builder_for_file(path) is None:
            raise DataSourceError(
                f"Data source {path}: unsupported file type {''.join(path.suffixes)!r}. "
                f"Supported: .txt, .jsonl, .json, .parquet (optionally compressed, e.g. .gz).")
        return _group_files(spec, [str(path)])
    if _looks_like_local_path(spec):
        raise DataSourceNotFound(
            f"Data source {path} does not exist. Fix the path in {setting('sources')} (relative paths "
            f"are resolved from the working directory {os.getcwd()}), or use 'bundled' for the "
            f"bundled demo corpus.")
    return [ResolvedSource(spec, "hub")]


def _check_file_not_empty(path: str) -> None:
    size = os.path.getsize(path)
    if size == 0 or (size < (1 << 20) and builder_for_file(path) != "parquet"
                     and not Path(path).suffix.lower() in _COMPRESSION_SUFFIXES
                     and not Path(path).read_bytes().strip()):
        raise DataSourceError(
            f"Data source file {path} is empty. Remove it from {setting('sources')} (or from its "
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
            f"Fix: set {setting('text_field')} to the field holding the document text.")
    dataset = dataset.select_columns([text_field])
    if text_field != "text":
        dataset = dataset.rename_column(text_field, "text")
    return dataset


def hf_datasets(why: str):
    """The `datasets` module, or one line saying how to get it (it is the `data` extra)."""
    try:
        import datasets
    except ImportError:
        raise DataSourceError(f"{why} needs the Hugging Face `datasets` package, which is not installed",
                              fix="pip install 'dsa-train[data]' (or 'dsa-train[train]')") from None
    return datasets


def _compression(path: str) -> str:
    suffix = Path(path).suffix.lower()
    return suffix if suffix in _COMPRESSION_SUFFIXES else ""


def reads_locally(source: ResolvedSource, streaming: bool) -> bool:
    """Whether `LocalDocuments` reads this source (else `datasets` does)."""
    return (not streaming and source.builder in ("json", "text", "parquet")
            and all(_compression(f) in _STDLIB_COMPRESSION for f in source.files))


def needs_hf_datasets(sources: list[str], streaming: bool) -> bool:
    """Whether reading `sources` imports `datasets` (a hub dataset, streaming, a .zst/.lz4 file).
    A source that does not resolve says False: the loader reports it, in its own words."""
    try:
        return any(not reads_locally(r, streaming) for spec in sources for r in resolve_source(spec))
    except DataSourceError:
        return False


class LocalDocuments:
    """The documents of one local source, read without `datasets`: one ``text`` value per record, in
    file order (files sorted by path, records in file order), None where a record lacks the field.
    Implements what the readers use of a `datasets.Dataset`: ``iter(batch_size)``, iteration,
    ``len``, ``column_names``."""

    column_names = ["text"]

    def __init__(self, source: ResolvedSource, text_field: str, txt_sample_by: str):
        self.source, self.text_field, self.txt_sample_by = source, text_field, txt_sample_by
        self._len: int | None = None

    # -- records of one file
    def _json_records(self, path: str) -> Iterator[Any]:
        with _open_text(path) as f:
            head = b""
            while not head.strip():  # the first non-blank bytes tell a JSON array from JSON lines
                chunk = f.read(4096)
                if not chunk:
                    return
                head += chunk
            rest = f.read() if head.lstrip()[:1] == b"[" else None
            if rest is not None:
                yield from json.loads((head + rest).decode("utf-8"))
                return
            pending = head
            while True:
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line.strip():
                        yield json.loads(line.decode("utf-8"))
                chunk = f.read(1 << 20)
                if not chunk:
                    break
                pending += chunk
            if pending.strip():
                yield json.loads(pending.decode("utf-8"))

    def _text_records(self, path: str) -> Iterator[str]:
        with _open_text(path) as f:
            # universal newlines, as `datasets`' text builder reads in text mode
            text = f.read().decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
        if self.txt_sample_by == "document":
            yield text
        else:  # paragraphs: split on blank lines, empty pieces dropped
            yield from (part for part in text.split("\n\n") if part)

    def _texts(self) -> Iterator[Any]:
        field = self.text_field
        for path in self.source.files:
            if self.source.builder == "text":
                yield from self._text_records(path)
            elif self.source.builder == "parquet":
                import pyarrow.parquet as pq

                for batch in pq.ParquetFile(path).iter_batches(columns=[field], batch_size=4096):
                    yield from batch.column(0).to_pylist()
            else:
                for record in self._json_records(path):
                    if not isinstance(record, dict):
                        raise ValueError(f"a JSON record must be an object, got {type(record).__name__}")
                    yield record.get(field)

    # -- the dataset interface
    def check_field(self) -> None:
        """A source whose records never hold the text field is an error that names its fields."""
        if self.source.builder == "text":
            return
        seen: list[str] = []
        if self.source.builder == "parquet":
            import pyarrow.parquet as pq

            for path in self.source.files:
                names = pq.ParquetFile(path).schema_arrow.names
                if self.text_field in names:
                    return
                seen += [n for n in names if n not in seen]
        else:
            try:
                for path in self.source.files:
                    for record in self._json_records(path):
                        if isinstance(record, dict):
                            if self.text_field in record:
                                return
                            seen += [k for k in record if k not in seen]
            except (ValueError, UnicodeDecodeError, OSError) as err:
                raise unreadable_source_error([self.source], err) from err
        where = self.source.files[0] if len(self.source.files) == 1 else f"{self.source.spec} ({len(self.source.files)} files)"
        raise DataSourceError(
            f"Data source {where} has no field {self.text_field!r}; its fields are {sorted(seen)}. "
            f"Fix: set {setting('text_field')} to the field holding the document text.")

    def __iter__(self) -> Iterator[dict]:
        for text in self._texts():
            yield {"text": text}

    def iter(self, batch_size: int) -> Iterator[dict]:
        batch: list = []
        for text in self._texts():
            batch.append(text)
            if len(batch) == batch_size:
                yield {"text": batch}
                batch = []
        if batch:
            yield {"text": batch}

    def __len__(self) -> int:
        if self._len is None:
            self._len = sum(1 for _ in self._texts())
        return self._len


class ChainedDocuments:
    """Several sources' documents one after the other (what `datasets.concatenate_datasets` gives)."""

    column_names = ["text"]

    def __init__(self, parts: list):
        self.parts = parts

    def __iter__(self) -> Iterator[dict]:
        for part in self.parts:
            yield from part

    def iter(self, batch_size: int) -> Iterator[dict]:
        for part in self.parts:
            yield from part.iter(batch_size=batch_size)

    def __len__(self) -> int:
        return sum(len(part) for part in self.parts)


def load_resolved_source(source: ResolvedSource, text_field: str = "text", *,
                         streaming: bool = False, txt_sample_by: str = "document",
                         split: str = "train", cache_dir: str | None = None) -> TextDataset:
    """Load one resolved source as a dataset with exactly one column, ``text``."""
    if source.builder == "text" and txt_sample_by not in ("document", "paragraph"):
        raise DataSourceError(f"txt_sample_by must be 'document' (one document per .txt file) or "
                              f"'paragraph' (split on blank lines), got {txt_sample_by!r}")
    if reads_locally(source, streaming):
        for path in source.files:
            _check_file_not_empty(path)
        # every line read once up front, as `datasets` parses a whole source at load: a line that is not
        # UTF-8 or not JSON is refused now, naming its file and line, not minutes into a run
        where = first_bad_line(source)
        if where is not None:
            raise DataSourceError(f"data source {where}",
                                  fix=f"fix or delete that line (or remove the file from {setting('sources')}), then run again")
        documents = LocalDocuments(source, text_field, txt_sample_by)
        documents.check_field()
        return documents
    datasets = hf_datasets(f"data source {source.spec!r}"
                           + (" with data.streaming=true" if streaming else ""))
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
                f"and point {setting('sources')} at the local .jsonl/.parquet files.") from err
        return _select_text_column(dataset, source, text_field, streaming)

    for path in source.files:
        _check_file_not_empty(path)
    kwargs = {}
    if source.builder == "text":
        if txt_sample_by not in ("document", "paragraph"):
            raise DataSourceError(f"txt_sample_by must be 'document' (one document per .txt file) or "
                             f"'paragraph' (split on blank lines), got {txt_sample_by!r}")
        kwargs["sample_by"] = txt_sample_by
        text_field = "text"  # the text builder always produces a `text` column
    try:
        dataset = datasets.load_dataset(source.builder, data_files=list(source.files), split="train",
                                        streaming=streaming, cache_dir=cache_dir, **kwargs)
    except Exception as err:  # DatasetGenerationError, UnicodeDecodeError, ArrowInvalid, ...
        raise unreadable_source_error([source], err) from err
    return _select_text_column(dataset, source, text_field, streaming)


def _open_text(path: str):
    import bz2
    import gzip
    import lzma

    opener = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}.get(Path(path).suffix.lower(), open)
    return opener(path, "rb")


def first_bad_line(source: ResolvedSource) -> str | None:
    """`<file>:<line>: <problem>` for the first line of a local .jsonl/.txt source that is not
    UTF-8 (or, for JSON lines, not a JSON object); None when every line reads."""
    for path in source.files:
        if Path(path).suffix.lower() in (".zst", ".lz4") or builder_for_file(path) == "parquet":
            continue
        json_lines = source.builder == "json" and not Path(path).name.lower().removesuffix(
            Path(path).suffix if Path(path).suffix.lower() in _COMPRESSION_SUFFIXES else "").endswith(".json")
        try:
            with _open_text(path) as f:
                for number, raw in enumerate(f, 1):
                    try:
                        line = raw.decode("utf-8")
                    except UnicodeDecodeError as err:
                        return (f"{path}:{number}: bytes that are not UTF-8 ({err.reason} at byte {err.start} "
                                f"of the line: {raw[max(0, err.start - 10):err.start + 10]!r})")
                    if json_lines and line.strip():
                        try:
                            record = json.loads(line)
                        except ValueError as err:
                            return f"{path}:{number}: not a JSON line ({err}): {line.strip()[:80]!r}"
                        if not isinstance(record, dict):
                            return f"{path}:{number}: a JSON line must be an object, got {type(record).__name__}"
        except OSError as err:
            return f"{path}: cannot be read ({err})"
    return None


def unreadable_source_error(sources: list[ResolvedSource], err: BaseException) -> DataSourceError:
    """The DataSourceError for a failure while reading `sources`: names the file and line."""
    for source in sources:
        where = first_bad_line(source) if source.builder != "hub" else None
        if where is not None:
            return DataSourceError(f"data source {where}",
                                   fix=f"fix or delete that line (or remove the file from {setting('sources')}), then run again")
    files = [f for s in sources for f in s.files] or [s.spec for s in sources]
    cause = getattr(err, "__cause__", None) or err
    return DataSourceError(f"data source {', '.join(files[:3])}{' ...' if len(files) > 3 else ''} cannot be read: "
                           f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}",
                           fix="check that the files are .jsonl (one JSON object per line), .json, .txt (UTF-8) or .parquet")


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
        raise DataSourceError("data.sources is empty: give at least one source (e.g. ['bundled']).")
    parts = [load_resolved_source(resolved, text_field, streaming=streaming,
                                  txt_sample_by=txt_sample_by, split=split, cache_dir=cache_dir)
             for spec in sources for resolved in resolve_source(spec)]
    if len(parts) == 1:
        return parts[0]
    if streaming:
        return hf_datasets("data.streaming=true").concatenate_datasets(parts)
    return ChainedDocuments(parts)


def is_empty_text(text: object) -> bool:
    return text is None or (isinstance(text, str) and not text.strip())


def iter_texts(dataset: TextDataset, stats: DocumentStats | None = None,
               batch_size: int = 1000, sources: list[str] | None = None) -> Iterator[list[str]]:
    """Yield lists of non-empty document texts (up to ``batch_size``), counting skipped ones.
    A record that cannot be decoded raises DataSourceError naming the file and line of
    ``sources`` (the source strings the dataset was loaded from)."""
    stats = stats if stats is not None else DocumentStats()
    batches = dataset.iter(batch_size=batch_size)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except Exception as err:  # e.g. UnicodeDecodeError from a string column with bad bytes
            if sources is None:
                raise
            raise unreadable_source_error([r for spec in sources for r in resolve_source(spec)], err) from err
        texts = []
        for text in batch["text"]:
            if is_empty_text(text):
                stats.skip(text)
                continue
            if not isinstance(text, str):
                raise DataSourceError(f"Document text must be a string, got {type(text).__name__}"
                                      f": {str(text)[:80]!r}. Check {setting('text_field')}.")
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
