"""Bundled tokenizer and tokenizer loading."""

import json
import shutil

import pytest

from dsa_train.data import BUNDLED_CORPUS, load_tokenizer
from dsa_train.data.tokenizer import BUNDLED_TOKENIZER_DIR


def test_bundled_tokenizer_special_ids_and_vocab():
    tok = load_tokenizer(None)
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (0, 1, 2, 4096)
    assert load_tokenizer("bundled").content_hash == tok.content_hash
    assert tok.encode("In the beginning")
    # A literal special-token string in a document is plain text, not a BOS/EOS id.
    ids = tok.encode("a <|bos|> b <|eos|>")
    assert min(ids) > 2 and tok.decode(ids) == "a <|bos|> b <|eos|>"


def test_bundled_tokenizer_roundtrips_the_whole_corpus():
    tok = load_tokenizer(None)
    texts = [json.loads(line)["text"] for line in open(BUNDLED_CORPUS)]
    assert len(texts) > 400
    encoded = tok.encode_batch(texts)
    n_tokens = sum(len(ids) for ids in encoded)
    n_bytes = sum(len(t.encode()) for t in texts)
    assert n_bytes / n_tokens > 3.0  # a trained BPE compresses English text
    for text, ids in zip(texts, encoded):
        assert max(ids) < tok.vocab_size and min(ids) > 2  # no special ids from plain text
        assert tok.decode(ids) == text
    assert tok.decode(tok.encode("naïve café — “quotes” 日本")) == "naïve café — “quotes” 日本"


def test_checkpoint_directory_with_config_names_specials(tmp_path):
    shutil.copy(BUNDLED_TOKENIZER_DIR / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<|eos|>"}, "eos_token": "<|bos|>"}))  # deliberately swapped
    tok = load_tokenizer(tmp_path)
    assert (tok.bos_id, tok.eos_id) == (1, 0)
    assert load_tokenizer(tmp_path / "tokenizer.json").vocab_size == 4096
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    with pytest.raises(ValueError, match="<s>"):
        load_tokenizer(tmp_path)


def test_missing_tokenizer_errors_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"No tokenizer.json in directory {tmp_path}"):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "tok.json")):
        load_tokenizer(tmp_path / "tok.json")
