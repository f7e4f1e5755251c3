"""prepare-data: memmap roundtrip equals in-memory packing; tokenizer/vocab validation."""

import json
import shutil

import numpy as np
import pytest
import torch

from dsa_train.data import (PackedDataset, check_vocab, load_tokenizer, pack_documents,
                            prepare_data)
from dsa_train.data.prepare import main as prepare_main
from dsa_train.data.tokenizer import BUNDLED_TOKENIZER_DIR


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    texts = [json.loads(line)["text"] for line in open(
        BUNDLED_TOKENIZER_DIR.parent / "corpus" / "demo_corpus.jsonl")][:25]
    path = tmp_path_factory.mktemp("src") / "docs.jsonl"
    records = [{"text": t} for t in texts]
    records.insert(3, {"text": ""})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path, texts


@pytest.mark.parametrize("add_bos,add_eos", [(True, True), (False, True)])
def test_prepared_memmap_equals_in_memory_packing(tmp_path, tokenizer, small_corpus, add_bos,
                                                  add_eos):
    path, texts = small_corpus
    out = prepare_data([str(path)], tokenizer, tmp_path / "prepared", seq_len=96,
                       add_bos=add_bos, add_eos=add_eos, hf_cache_dir=str(tmp_path / "hf"))
    index = json.loads((out / "index.json").read_text())
    assert index["token_dtype"] == "uint16" and index["vocab_size"] == 4096
    assert index["n_documents"] == 25 and index["n_empty_documents_skipped"] == 1
    assert index["tokenizer_hash"] == tokenizer.content_hash
    for seq_len in (96, 33):  # the stream serves any seq_len
        dataset = PackedDataset(out, seq_len=seq_len, tokenizer=tokenizer)
        expected = pack_documents([tokenizer.encode(t) for t in texts], seq_len, tokenizer.bos_id,
                                  tokenizer.eos_id, add_bos, add_eos)
        assert len(dataset) == len(expected) > 10
        for r in range(len(dataset)):
            for key in ("input_ids", "labels", "position_ids"):
                assert torch.equal(dataset[r][key], expected[r][key]), (seq_len, r, key)


def test_cli_main_and_reopen(tmp_path, small_corpus):
    path, _ = small_corpus
    out = tmp_path / "cli_out"
    argv = ["--source", str(path), "--out", str(out), "--seq-len", "64"]
    assert prepare_main(argv) == 0
    dataset = PackedDataset(out)  # seq_len defaults to the prepared one
    assert dataset.seq_len == 64 and dataset[0]["input_ids"].shape == (64,)
    with pytest.raises(FileExistsError, match="--overwrite"):
        prepare_main(argv)
    assert prepare_main(argv + ["--overwrite", "--no-bos"]) == 0
    assert json.loads((out / "index.json").read_text())["add_bos"] is False


def test_progress_into_a_log_file_is_whole_lines(tmp_path, small_corpus, capsys):
    """Stderr not a terminal (a log file, a pipe): no carriage returns, so the progress line and the
    summary do not run together ("... 5 tokensprepare-data: wrote ...")."""
    path, _ = small_corpus
    assert prepare_main(["--source", str(path), "--out", str(tmp_path / "out"), "--seq-len", "64"]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err and err.endswith("\n")
    assert [line for line in err.splitlines() if line.startswith("prepare-data: wrote")]


def test_tokenizer_mismatch_on_open_is_a_clear_error(tmp_path, tokenizer, small_corpus):
    path, _ = small_corpus
    out = prepare_data([str(path)], tokenizer, tmp_path / "prepared", seq_len=64,
                       hf_cache_dir=str(tmp_path / "hf"))
    # Another tokenizer: the bundled one with an extra added token (vocab 4097, new hash).
    other_dir = tmp_path / "other_tok"
    shutil.copytree(BUNDLED_TOKENIZER_DIR, other_dir)
    other = load_tokenizer(other_dir)
    other.backend.add_special_tokens(["<|extra|>"])
    other.backend.save(str(other_dir / "tokenizer.json"))
    other = load_tokenizer(other_dir)
    assert other.vocab_size == 4097
    with pytest.raises(ValueError, match=r"different tokenizer.*vocab 4096.*vocab 4097.*prepare-data"):
        PackedDataset(out, tokenizer=other)
    with pytest.raises(ValueError, match="different tokenizer"):
        PackedDataset.from_sources([str(out)], other, 64)


def test_open_errors(tmp_path, tokenizer, small_corpus):
    with pytest.raises(FileNotFoundError, match="prepare-data"):
        PackedDataset(tmp_path / "nothing")
    path, _ = small_corpus
    out = prepare_data([str(path)], tokenizer, tmp_path / "p", seq_len=64,
                       hf_cache_dir=str(tmp_path / "hf"))
    with pytest.raises(ValueError, match="fewer than seq_len"):
        PackedDataset(out, seq_len=10_000_000)
    with open(out / "tokens.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match="truncated"):
        PackedDataset(out)


def test_check_vocab():
    check_vocab(4096, 4096)
    check_vocab(128815, 129280)  # padded embedding is fine
    with pytest.raises(ValueError, match=r"4096.*1000.*vocab_size >= 4096"):
        check_vocab(4096, 1000)


def test_large_vocab_uses_uint32(tmp_path):
    from dsa_train.data.prepare import token_dtype_for_vocab
    assert token_dtype_for_vocab(65536) == np.uint16
    assert token_dtype_for_vocab(129280) == np.uint32
