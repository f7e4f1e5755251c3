"""Document sources: formats, directories/globs, errors that name the path, empty documents."""

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dsa_train.data.sources import (BUNDLED_CORPUS, DataSourceError, DocumentStats, iter_texts,
                                    load_documents)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def texts_of(dataset, stats=None):
    return [t for batch in iter_texts(dataset, stats) for t in batch]


def test_jsonl_with_custom_field_and_empty_documents_skipped(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [
        {"body": "first doc", "id": 1}, {"body": "", "id": 2}, {"body": "  \n ", "id": 3},
        {"body": None, "id": 4}, {"body": "last doc", "id": 5}])
    dataset = load_documents([str(path)], text_field="body", cache_dir=str(tmp_path / "hf"))
    assert dataset.column_names == ["text"]
    stats = DocumentStats()
    assert texts_of(dataset, stats) == ["first doc", "last doc"]
    # "" and whitespace are empty documents; null (like a record without the field) is counted apart
    assert (stats.n_documents, stats.n_empty_skipped, stats.n_missing_text) == (2, 2, 1)


def test_txt_one_document_per_file_or_per_paragraph(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("Alpha line one.\nAlpha line two.\n\nAlpha para two.\n")
    (tmp_path / "docs" / "b.txt").write_text("Beta.\n")
    per_file = texts_of(load_documents([str(tmp_path / "docs")], cache_dir=str(tmp_path / "hf")))
    assert len(per_file) == 2 and per_file[0].startswith("Alpha line one.\nAlpha line two.")
    assert "Alpha para two." in per_file[0] and per_file[1].strip() == "Beta."
    per_paragraph = texts_of(load_documents([str(tmp_path / "docs" / "a.txt")],
                                            txt_sample_by="paragraph",
                                            cache_dir=str(tmp_path / "hf")))
    assert [t.strip() for t in per_paragraph] == ["Alpha line one.\nAlpha line two.",
                                                  "Alpha para two."]


def test_parquet_and_glob_and_mixed_sources_in_order(tmp_path):
    for i in range(2):
        pq.write_table(pa.table({"text": [f"pq{i}-a", f"pq{i}-b"], "n": [0, 1]}),
                       tmp_path / f"shard{i}.parquet")
    jsonl = write_jsonl(tmp_path / "extra.jsonl", [{"text": "js-a"}])
    dataset = load_documents([str(tmp_path / "shard*.parquet"), str(jsonl)],
                             cache_dir=str(tmp_path / "hf"))
    assert texts_of(dataset) == ["pq0-a", "pq0-b", "pq1-a", "pq1-b", "js-a"]


def test_streaming_yields_same_documents(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"text": f"doc {i}"} for i in range(5)] + [{"text": ""}])
    streamed = load_documents([str(path)], streaming=True, cache_dir=str(tmp_path / "hf"))
    stats = DocumentStats()
    assert texts_of(streamed, stats) == [f"doc {i}" for i in range(5)]
    assert stats.n_empty_skipped == 1


def test_bundled_source():
    dataset = load_documents(["bundled"])
    assert len(dataset) == sum(1 for _ in open(BUNDLED_CORPUS)) > 400


def test_missing_file_error_names_path(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_documents([str(missing)])
    with pytest.raises(FileNotFoundError, match="matched no"):
        load_documents([str(tmp_path / "*.parquet")])
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(FileNotFoundError, match="emptydir"):
        load_documents([str(tmp_path / "emptydir")])


@pytest.mark.parametrize("name,content", [("e.jsonl", ""), ("e.txt", "\n\n  \n")])
def test_empty_file_error_names_path(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DataSourceError, match=f"{path}.*empty"):
        load_documents([str(path)], cache_dir=str(tmp_path / "hf"))


def test_missing_text_field_error_names_path_and_fields(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"content": "x"}])
    with pytest.raises(DataSourceError, match=rf"{path}.*'text'.*\['content'\].*data.text_field"):
        load_documents([str(path)], cache_dir=str(tmp_path / "hf"))
    with pytest.raises(DataSourceError, match="no field 'text'"):
        load_documents([str(path)], streaming=True)


def test_unsupported_file_type(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text("text\nhello\n")
    with pytest.raises(DataSourceError, match="unsupported file type"):
        load_documents([str(path)])


@pytest.mark.integration
def test_hub_dataset_without_network_gives_clear_error(tmp_path):
    code = ("from dsa_train.data import load_documents\n"
            f"load_documents(['no-such-owner-xyz/no-such-dataset'], cache_dir={str(tmp_path)!r})\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0
    assert "DataSourceError" in result.stderr and "not a local file" in result.stderr


def _via_datasets(specs, **kwargs):
    """The same sources read by Hugging Face `datasets` (the reader the local one replaces)."""
    import datasets

    from dsa_train.data.sources import resolve_source

    out = []
    for spec in specs:
        for src in resolve_source(spec):
            kw = {"sample_by": kwargs.get("txt_sample_by", "document")} if src.builder == "text" else {}
            ds = datasets.load_dataset(src.builder, data_files=list(src.files), split="train",
                                       cache_dir=kwargs.get("cache_dir"), **kw)
            field = "text" if src.builder == "text" else kwargs.get("text_field", "text")
            out += list(ds[field])
    return out


def test_local_reader_gives_the_documents_datasets_gives(tmp_path):
    """Every local format, compressed or not, split into documents exactly as `datasets` splits
    them (same order, same text, None where a record lacks the field)."""
    import bz2
    import gzip

    from dsa_train.data.sources import LocalDocuments

    records = [{"text": "a\r\nb"}, {"text": "", "x": 1}, {"other": "no text"}, {"text": "ünï ☃"}, {"text": None}]
    write_jsonl(tmp_path / "a.jsonl", records)
    (tmp_path / "b.json").write_text(json.dumps(records))
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in records).encode()))
    (tmp_path / "d.txt").write_text("p1 line\r\np1 more\n\n\n\np2\n\nlast")
    (tmp_path / "e.txt.bz2").write_bytes(bz2.compress("solo\n".encode()))
    pq.write_table(pa.table({"text": ["x", None, "z"], "n": [1, 2, 3]}), tmp_path / "f.parquet")
    hf = str(tmp_path / "hf")
    for sample_by in ("document", "paragraph"):
        specs = [str(tmp_path / n) for n in ("a.jsonl", "b.json", "c.jsonl.gz", "d.txt", "e.txt.bz2", "f.parquet")]
        ours = load_documents(specs, txt_sample_by=sample_by, cache_dir=hf)
        assert all(isinstance(p, LocalDocuments) for p in ours.parts)
        got = [t for batch in ours.iter(batch_size=2) for t in batch["text"]]
        assert got == _via_datasets(specs, txt_sample_by=sample_by, cache_dir=hf)
        assert len(ours) == len(got)


@pytest.mark.integration
def test_local_files_and_the_bundled_corpus_load_without_datasets(tmp_path):
    """`datasets` is the `data` extra: local sources never import it; a hub source says how to get it."""
    path = write_jsonl(tmp_path / "a.jsonl", [{"text": "one"}, {"text": "two"}])
    code = (
        "import sys; sys.modules['datasets'] = None\n"  # any `import datasets` now raises ImportError
        "from dsa_train.data.sources import load_documents, iter_texts, DataSourceError\n"
        f"docs = load_documents(['bundled', {str(path)!r}])\n"
        "n = sum(len(b) for b in iter_texts(docs))\n"
        "assert n > 400, n\n"
        "try:\n"
        "    load_documents(['some-owner/some-dataset'])\n"
        "except DataSourceError as err:\n"
        "    print('HUB:', err)\n"
        "print('OK', n)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "OK" in result.stdout and "dsa-train[data]" in result.stdout and "datasets" in result.stdout
