"""Pre-tokenize sources into a memory-mapped token stream (``dsa-train prepare-data``).

Output directory layout (opened by ``PackedDataset``)::

    out_dir/
      tokens.bin        the framed-document token stream S [n_tokens], uint16 (vocab <= 65536)
                        or uint32, raw little-endian; documents are [bos] + tokens + [eos]
      doc_offsets.bin   int64 [n_documents + 1]: document d is S[doc_offsets[d]:doc_offsets[d+1]]
      index.json        metadata: token dtype, counts, vocab_size, tokenizer_hash, bos/eos ids,
                        add_bos/add_eos, seq_len (the default; any seq_len can read the stream),
                        the sources and read settings

The stream does not depend on ``seq_len``: packing into rows is a view computed on the fly
(see ``packing.py``), so one prepared directory serves every sequence length.
"""

from __future__ import annotations

import argparse
import logging
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from dsa_train.data.packing import frame_document, num_rows
from dsa_train.data.naming import flags_named
from dsa_train.data.sources import (FORMAT_NAME, INDEX_FILE, DataSourceError, DocumentStats, is_prepared_dir,
                                    iter_texts, load_documents)
from dsa_train.data.tokenizer import Tokenizer, load_tokenizer
from dsa_train.tempdirs import remove_dead_temporaries

class PreparedDataExists(DataSourceError, FileExistsError):
    """prepare-data would replace a prepared dataset without --overwrite."""


class OutNotOurs(DataSourceError, FileExistsError):
    """--out is a folder prepare-data did not write (or one holding a source): never replaced."""


FORMAT_VERSION = 1
TOKENS_FILE = "tokens.bin"
DOC_OFFSETS_FILE = "doc_offsets.bin"


def token_dtype_for_vocab(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


def prepare_data(sources: Sequence[str] | str, tokenizer: Tokenizer | str | None,
                 out_dir: str | Path, seq_len: int, *, text_field: str = "text",
                 txt_sample_by: str = "document", add_bos: bool = True, add_eos: bool = True,
                 split: str = "train", hf_cache_dir: str | None = None,
                 overwrite: bool = False, log: bool = False) -> Path:
    """Tokenize ``sources`` and write a pre-tokenized dataset to ``out_dir``.

    Args:
        sources: source strings (see ``sources.py``): files, directories, globs, "bundled".
        tokenizer: a loaded ``Tokenizer`` or anything ``load_tokenizer`` accepts.
        seq_len: recorded as the default sequence length (``PackedDataset`` may use another).
    Returns:
        ``out_dir``. Written to a temporary sibling and renamed, so a crash never leaves a
        half-written dataset that looks complete.
    """
    if seq_len < 2:  # as data.seq_len: a row of one token has no next token to predict
        raise DataSourceError(f"prepare-data: --seq-len must be >= 2, got {seq_len}", fix="pass e.g. --seq-len 4096")
    sources = [sources] if isinstance(sources, str) else list(sources)
    out_dir = Path(out_dir)
    check_out_dir(out_dir, sources, overwrite)  # before any work
    remove_stale_temporaries(out_dir)
    if not isinstance(tokenizer, Tokenizer):
        tokenizer = load_tokenizer(tokenizer)
    start_time = time.time()
    dtype = token_dtype_for_vocab(tokenizer.vocab_size)
    dataset = load_documents(sources, text_field, streaming=False, txt_sample_by=txt_sample_by,
                             split=split, cache_dir=hf_cache_dir)
    # Validate framing up front (raises if add_bos but no BOS token, ...).
    frame_document([], tokenizer.bos_id, tokenizer.eos_id, add_bos, add_eos)

    tmp_dir = out_dir.parent / f"{tmp_prefix(out_dir)}{os.getpid()}"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True)
    try:  # the temporary folder goes on every failure path (errors, Ctrl-C, a start-up signal)
        return _write(sources, tokenizer, out_dir, tmp_dir, seq_len, dataset, dtype, text_field, txt_sample_by,
                      add_bos, add_eos, split, start_time, log)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def _write(sources, tokenizer, out_dir: Path, tmp_dir: Path, seq_len, dataset, dtype, text_field, txt_sample_by,
           add_bos, add_eos, split, start_time, log) -> Path:
    stats = DocumentStats()
    doc_offsets = [0]
    with open(tmp_dir / TOKENS_FILE, "wb") as tokens_file:
        tty, last_line = sys.stderr.isatty(), time.monotonic()
        for texts in iter_texts(dataset, stats, sources=sources):
            framed = [frame_document(ids, tokenizer.bos_id, tokenizer.eos_id, add_bos, add_eos)
                      for ids in tokenizer.encode_batch(texts)]
            for doc in framed:
                doc_offsets.append(doc_offsets[-1] + len(doc))
            chunk = np.concatenate([np.asarray(doc, dtype=np.int64) for doc in framed])
            tokens_file.write(chunk.astype(dtype).tobytes())
            if log and (tty or time.monotonic() - last_line >= 30):  # a log file: a line per 30 s
                last_line = time.monotonic()
                print(f"prepare-data: {stats.n_documents} documents, {doc_offsets[-1]} tokens",
                      file=sys.stderr, end="\r" if tty else "\n")
    if stats.n_documents == 0:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise DataSourceError(f"Sources {sources} hold no non-empty documents "
                         f"({stats.n_empty_skipped} empty ones skipped, {stats.n_missing_text} without the "
                         f"{text_field!r} field); nothing to train on.")
    skipped = stats.describe_skipped(text_field)
    if skipped:  # never silent: the count is also in the index (n_records_without_text_skipped)
        logging.getLogger(__name__).warning("prepare-data: %s: %s", ", ".join(map(str, sources)), skipped)
    np.asarray(doc_offsets, dtype=np.int64).tofile(tmp_dir / DOC_OFFSETS_FILE)
    n_tokens = doc_offsets[-1]
    index = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "tokens_file": TOKENS_FILE,
        "token_dtype": dtype.name,
        "n_tokens": n_tokens,
        "doc_offsets_file": DOC_OFFSETS_FILE,
        "n_documents": stats.n_documents,
        "n_empty_documents_skipped": stats.n_empty_skipped,
        "n_records_without_text_skipped": stats.n_missing_text,
        "vocab_size": tokenizer.vocab_size,
        "tokenizer_hash": tokenizer.content_hash,
        "tokenizer_path": str(tokenizer.path),
        "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id,
        "add_bos": add_bos,
        "add_eos": add_eos,
        "seq_len": seq_len,
        "num_sequences_at_seq_len": num_rows(n_tokens, seq_len),
        "sources": sources,
        "text_field": text_field,
        "txt_sample_by": txt_sample_by,
        "split": split,
        "seconds": round(time.time() - start_time, 3),
    }
    (tmp_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    if out_dir.exists():  # checked at the start: empty, or a prepared dataset of ours (--overwrite)
        _remove_prepared(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp_dir, out_dir)
    if log:
        print(("\r" if sys.stderr.isatty() else "") + f"prepare-data: wrote {out_dir}: {stats.n_documents} documents "
              f"({stats.n_empty_skipped} empty skipped), {n_tokens} tokens, "
              f"{index['num_sequences_at_seq_len']} sequences of {seq_len}", file=sys.stderr)
    return out_dir


OUR_FILES = (INDEX_FILE, TOKENS_FILE, DOC_OFFSETS_FILE)


def tmp_prefix(out_dir: Path) -> str:
    return f".{out_dir.name}.tmp-"


def _is_within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def check_out_dir(out_dir: Path, sources: Sequence[str], overwrite: bool) -> None:
    """Refuse, before any work, an --out that prepare-data must not replace: a folder holding (or
    being) one of the sources, a file, or a non-empty folder that is not a prepared dataset holding
    only prepare-data's own files (those are replaced with --overwrite only). An empty folder is used."""
    out = out_dir.expanduser().resolve()
    for source in sources:
        src = Path(str(source)).expanduser()
        if not src.exists():
            continue  # a hub dataset or a glob; a local path that is not there is not ours to protect
        src = src.resolve()
        if _is_within(src, out) or _is_within(out, src):
            raise OutNotOurs(f"prepare-data: --out {out_dir} {'holds' if _is_within(src, out) else 'is inside'} the "
                             f"source {source}; nothing was written or deleted",
                             fix=f"choose an --out outside the sources, e.g. --out {_beside(out if _is_within(src, out) else src)}")
    if out.is_file() or (out.exists() and not out.is_dir()):
        raise OutNotOurs(f"prepare-data: --out {out_dir} is a file, not a folder; nothing was written",
                         fix=f"choose a folder for --out, e.g. --out {_beside(out)}")
    if not out.is_dir():
        return
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return
    ours = is_prepared_dir(out) and set(entries) <= set(OUR_FILES)
    if not ours:
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise OutNotOurs(f"prepare-data: --out {out_dir} is a folder that prepare-data did not write ({len(entries)} "
                         f"entries: {shown}); it is never replaced, with or without --overwrite; nothing was written",
                         fix=f"choose a new or empty folder, e.g. --out {_beside(out)}")
    if not overwrite:
        raise PreparedDataExists(f"prepare-data: {out_dir} already holds a prepared dataset",
                                 fix="pass --overwrite to replace it, or choose another --out")


def _beside(path: Path) -> Path:
    """A new name next to `path` for a suggested --out (one that does not exist yet)."""
    n, candidate = 1, path.parent / f"{path.stem}-prepared"
    while candidate.exists():
        n += 1
        candidate = path.parent / f"{path.stem}-prepared{n}"
    return candidate


def _remove_prepared(out_dir: Path) -> None:
    """Delete a prepared dataset of ours: its own files, then the folder (never anything else)."""
    for name in OUR_FILES:
        (out_dir / name).unlink(missing_ok=True)
    out_dir.rmdir()  # fails (OSError) rather than delete anything prepare-data did not write


def remove_stale_temporaries(out_dir: Path) -> list[Path]:
    """Temporary folders of earlier prepare-data runs for `out_dir` (`.<name>.tmp-<pid>`) whose
    process is gone (killed, or a machine restart): removed at the next start."""
    removed = remove_dead_temporaries(out_dir.parent, tmp_prefix(out_dir))
    for p in removed:
        logging.getLogger(__name__).warning("prepare-data: removed %s, left by an interrupted run", p)
    return removed


# DataConfig field -> the flag that sets it here (dsa_train/data/naming.py)
FLAGS = {"sources": "--source", "tokenizer": "--tokenizer", "text_field": "--text-field",
         "txt_sample_by": "--txt-sample-by", "split": "--split"}


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dsa-train prepare-data",
        description="Tokenize documents into a memory-mapped dataset that training opens "
                    "directly (data.sources=[OUT]).")
    parser.add_argument("--source", action="append", nargs="+", required=True, metavar="SOURCE",
                        help="file, directory, glob, hub dataset or 'bundled' (repeatable)")
    parser.add_argument("--tokenizer", default=None,
                        help="checkpoint directory or tokenizer.json (default: bundled demo)")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seq-len", type=int, required=True, help="default sequence length")
    parser.add_argument("--text-field", default="text", help="text field of .jsonl/.parquet")
    parser.add_argument("--txt-sample-by", choices=["document", "paragraph"], default="document",
                        help=".txt files: one document per file, or one per blank-line paragraph")
    parser.add_argument("--split", default="train", help="split of hub datasets")
    parser.add_argument("--no-bos", action="store_true", help="do not prepend BOS to documents")
    parser.add_argument("--no-eos", action="store_true", help="do not append EOS to documents")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``dsa-train prepare-data``; returns the process exit code."""
    args = build_arg_parser().parse_args(argv)
    sources = [s for group in args.source for s in group]
    with flags_named(FLAGS):  # an error names --text-field, not the recipe's data.text_field
        prepare_data(sources, args.tokenizer, args.out, args.seq_len, text_field=args.text_field,
                     txt_sample_by=args.txt_sample_by, add_bos=not args.no_bos,
                     add_eos=not args.no_eos, split=args.split, overwrite=args.overwrite, log=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
