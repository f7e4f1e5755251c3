"""What a checkpoint holds against what its config says the model needs.

`match_weights` compares the stored tensors (names, shapes, dtypes: headers only) with the
parameters of the model built from config.json, and `raise_if_unloadable` turns the first
problem into an error that names the tensor, the file and the fix. Both run before any weight is
read, so a checkpoint that cannot load fails before anything is allocated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from ..model.config import DSAConfig
from .errors import CheckpointError
from .stored import StoredTensor, check_dtype

_IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.attn\.bias|\.attn\.masked_bias)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def is_indexer_tensor(name: str) -> bool:
    return ".self_attn.indexer." in name


@dataclass
class WeightMatch:
    expected: dict[str, tuple[int, ...]]  # the model's state dict: name -> shape
    stored: dict[str, StoredTensor]
    matched: list[str] = field(default_factory=list)  # stored and expected, in reading order
    missing: list[str] = field(default_factory=list)  # expected, not stored (indexer apart)
    missing_indexer: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    wrong_shape: list[str] = field(default_factory=list)
    dtype_errors: list[str] = field(default_factory=list)
    tied_lm_head: bool = False  # lm_head.weight comes from embed_tokens

    @property
    def dense(self) -> bool:
        """No indexer tensors at all: a V3 / V3.1 checkpoint whose indexers are initialized fresh."""
        return bool(self.missing_indexer) and not any(is_indexer_tensor(n) for n in self.matched)


def mtp_layers_stored(config: DSAConfig, stored_names) -> bool:
    prefix = f"model.layers.{config.num_hidden_layers}."
    return any(n.startswith(prefix) for n in stored_names)


def match_weights(expected: dict[str, tuple[int, ...]], stored: dict[str, StoredTensor], config: DSAConfig, block: int) -> WeightMatch:
    m = WeightMatch(expected=expected, stored=stored)
    for name, st in stored.items():
        if name in expected:
            m.matched.append(name)
            if tuple(st.shape) != tuple(expected[name]):
                m.wrong_shape.append(name)
            else:
                try:
                    check_dtype(st, block)
                except CheckpointError as e:
                    m.dtype_errors.append(str(e))
        elif _IGNORED.search(name):
            continue
        elif (lm := _LAYER.match(name)) and int(lm.group(1)) >= config.num_hidden_layers and not config.num_nextn_predict_layers:
            continue  # MTP weights of a model loaded without its MTP module
        else:
            m.unexpected.append(name)
    m.matched.sort(key=lambda n: (str(stored[n].file), stored[n].entry.begin, n))
    for name in expected:
        if name in stored:
            continue
        if is_indexer_tensor(name):
            m.missing_indexer.append(name)
        elif name == "lm_head.weight" and config.tie_word_embeddings:
            m.tied_lm_head = True
        else:
            m.missing.append(name)
    return m


def _examples(names: list[str], stored: dict[str, StoredTensor] | None = None, n: int = 4) -> str:
    shown = [f"{x} ({stored[x].file.name})" if stored and x in stored else x for x in names[:n]]
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(shown) + more


def raise_if_unloadable(m: WeightMatch, path: Path, config: DSAConfig) -> None:
    if m.unexpected and len(m.matched) < len(m.expected) / 2:
        raise CheckpointError(
            f"{len(m.unexpected)} of the {len(m.stored)} tensors in {path} are foreign to a DeepSeek-V3-architecture model "
            f"(e.g. {_examples(m.unexpected, m.stored)}); this is a checkpoint of another architecture, or its "
            f"config.json (model_type {config.model_type}) does not describe its weights"
        )
    if m.wrong_shape:
        name = m.wrong_shape[0]
        st = m.stored[name]
        raise CheckpointError(
            f"tensor {st.where()} has shape {list(st.shape)}, but config.json implies {list(m.expected[name])} "
            f"({len(m.wrong_shape)} tensors differ); config.json does not match the weights: check hidden_size, "
            "intermediate sizes, head dims, ranks and vocab_size"
        )
    if m.unexpected:
        hint = ""
        layers = sorted({int(x.group(1)) for n in m.unexpected if (x := _LAYER.match(n))})
        if layers:
            hint = (
                f" The weights have layers up to {layers[-1]} but config.json has num_hidden_layers="
                f"{config.num_hidden_layers} + num_nextn_predict_layers={config.num_nextn_predict_layers}."
            )
        raise CheckpointError(
            f"{len(m.unexpected)} tensors in {path} are not part of the model config.json describes, e.g. "
            f"{_examples(m.unexpected, m.stored)}.{hint} config.json does not match the weights (layers, experts, "
            "first_k_dense_replace), or this is a checkpoint of another architecture"
        )
    if m.missing:
        raise CheckpointError(
            f"{len(m.missing)} tensors the config needs are missing from {path}: {_examples(m.missing)}. "
            "The checkpoint is incomplete (a shard or index entry is missing) or config.json does not describe it"
        )
    if m.missing_indexer and not m.dense:
        raise CheckpointError(
            f"{path} has some lightning-indexer tensors but lacks {_examples(m.missing_indexer)}; a V3.2 checkpoint "
            "needs all of them (re-export it), a dense V3 checkpoint none"
        )
    if m.dtype_errors:
        raise CheckpointError(m.dtype_errors[0])
