"""Tokenizer loading: the bundled demo tokenizer or a checkpoint's own ``tokenizer.json``.

``load_tokenizer(None)`` gives the bundled byte-level BPE (vocab 4096, ``<|bos|>`` = 0,
``<|eos|>`` = 1, ``<|pad|>`` = 2, trained on the bundled corpus by
``scripts/build_demo_assets.py``). ``load_tokenizer("/ckpt/DeepSeek-V3.1-Terminus")`` uses the
checkpoint's ``tokenizer.json`` (Hugging Face layout) and reads the BOS/EOS tokens from its
``tokenizer_config.json``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from tokenizers import Tokenizer as HFTokenizer

from dsa_train.data.naming import leave_unset, setting
from dsa_train.errors import DSATrainError


class TokenizerError(DSATrainError, ValueError):
    """A tokenizer that cannot be used (or does not fit the model); the message says the fix."""


class TokenizerNotFound(TokenizerError, FileNotFoundError):
    pass

BUNDLED_TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "assets" / "tokenizer"

# Special-token spellings tried (in order) when tokenizer_config.json does not name them.
_BOS_CANDIDATES = ("<|bos|>", "<｜begin▁of▁sentence｜>", "<|begin_of_text|>", "<s>", "[BOS]")
_EOS_CANDIDATES = ("<|eos|>", "<｜end▁of▁sentence｜>", "<|end_of_text|>", "<|endoftext|>", "</s>",
                   "[EOS]")
_PAD_CANDIDATES = ("<|pad|>", "<｜▁pad▁｜>", "<pad>", "[PAD]")


@dataclass
class Tokenizer:
    """A thin wrapper over a ``tokenizers.Tokenizer`` with the ids the data pipeline needs.

    ``encode`` never adds special tokens and encodes special-token strings found in the text
    as plain text: document framing (BOS/EOS) is the packer's job.
    """

    backend: HFTokenizer
    path: Path  # the tokenizer.json it was read from
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None = None
    content_hash: str = field(default="")  # sha256 of the canonical serialization

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can emit (base vocab + added tokens); ids are < this."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encode many documents at once (multi-threaded inside ``tokenizers``)."""
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=False)

    def __repr__(self) -> str:
        return (f"Tokenizer(path={str(self.path)!r}, vocab_size={self.vocab_size}, "
                f"bos_id={self.bos_id}, eos_id={self.eos_id}, hash={self.content_hash[:12]})")


def tokenizer_hash(backend: HFTokenizer) -> str:
    """SHA-256 of the tokenizer's canonical JSON (independent of file formatting)."""
    canonical = json.dumps(json.loads(backend.to_str()), sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def _special_token_from_config(config: dict, key: str) -> str | None:
    value = config.get(key)
    if isinstance(value, dict):  # {"content": "<｜begin▁of▁sentence｜>", "lstrip": false, ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def _resolve_special_id(backend: HFTokenizer, configured: str | None,
                        candidates: Sequence[str], tokenizer_json: Path, what: str) -> int | None:
    if configured is not None:
        token_id = backend.token_to_id(configured)
        if token_id is None:
            raise TokenizerError(f"{tokenizer_json.parent / 'tokenizer_config.json'} names {what} "
                             f"{configured!r}, but {tokenizer_json} has no such token.")
        return token_id
    for token in candidates:
        token_id = backend.token_to_id(token)
        if token_id is not None:
            return token_id
    return None


def resolve_tokenizer_json(path_or_dir: str | Path | None) -> Path:
    """Map ``None``/"bundled", a checkpoint directory or a tokenizer.json path to the file."""
    if path_or_dir is None or str(path_or_dir) == "bundled":
        return BUNDLED_TOKENIZER_DIR / "tokenizer.json"
    path = Path(path_or_dir).expanduser()
    if path.is_dir():
        candidate = path / "tokenizer.json"
        if not candidate.is_file():
            raise TokenizerNotFound(
                f"No tokenizer.json in directory {path}. Point {setting('tokenizer')} at a Hugging Face "
                f"checkpoint folder that has a tokenizer.json, at a tokenizer.json file, or "
                f"{leave_unset('tokenizer')} to use the bundled demo tokenizer.")
        return candidate
    if not path.is_file():
        raise TokenizerNotFound(
            f"Tokenizer not found: {path} does not exist. Pass a checkpoint directory holding "
            f"tokenizer.json, a tokenizer.json file, or {leave_unset('tokenizer')} for the bundled demo tokenizer.")
    return path


def load_tokenizer(path_or_dir: str | Path | None = None) -> Tokenizer:
    """Load a tokenizer.

    Args:
        path_or_dir: ``None`` or ``"bundled"`` for the bundled demo tokenizer; a directory
            (a Hugging Face checkpoint: its ``tokenizer.json`` and, if present,
            ``tokenizer_config.json`` for ``bos_token``/``eos_token``/``pad_token``); or the
            path of a ``tokenizer.json`` file.
    """
    tokenizer_json = resolve_tokenizer_json(path_or_dir)
    try:
        backend = HFTokenizer.from_file(str(tokenizer_json))
    except Exception as err:  # tokenizers raises a bare Exception on malformed files
        raise TokenizerError(f"Could not read tokenizer {tokenizer_json}: {err}. Is it a Hugging "
                         f"Face `tokenizers` tokenizer.json?") from err
    # Literal special-token strings inside documents (e.g. "<|eos|>" in scraped text) are
    # tokenized as plain text: only the packer inserts BOS/EOS ids.
    backend.encode_special_tokens = True
    config_path = tokenizer_json.parent / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    return Tokenizer(
        backend=backend,
        path=tokenizer_json,
        bos_id=_resolve_special_id(backend, _special_token_from_config(config, "bos_token"),
                                   _BOS_CANDIDATES, tokenizer_json, "bos_token"),
        eos_id=_resolve_special_id(backend, _special_token_from_config(config, "eos_token"),
                                   _EOS_CANDIDATES, tokenizer_json, "eos_token"),
        pad_id=_resolve_special_id(backend, _special_token_from_config(config, "pad_token"),
                                   _PAD_CANDIDATES, tokenizer_json, "pad_token"),
        content_hash=tokenizer_hash(backend),
    )


def check_vocab(tokenizer_vocab_size: int, model_vocab_size: int) -> None:
    """Raise if the tokenizer can emit ids the model's embedding has no row for.

    A model with *more* rows than the tokenizer (padded vocab, e.g. DeepSeek-V3's 129280 rows
    for ~128.8K tokens) is fine; fewer rows would index out of bounds in the embedding.
    """
    if tokenizer_vocab_size > model_vocab_size:
        raise TokenizerError(
            f"Tokenizer vocab size {tokenizer_vocab_size} exceeds the model's vocab_size "
            f"{model_vocab_size} (embedding rows): token ids up to {tokenizer_vocab_size - 1} "
            f"would index past the embedding. Fix: set model.vocab_size >= "
            f"{tokenizer_vocab_size}, or use the tokenizer that belongs to this checkpoint "
            f"(data.tokenizer=<checkpoint dir>).")
