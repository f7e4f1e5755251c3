"""Size-capped safetensors shards plus `model.safetensors.index.json`.

Tensors come in groups that must share a shard (an FP8 weight and its scales). The shards are
cut greedily in arrival order: a group starts a new shard when it would push the current one past
`max_bytes` (`starts_new_shard`). Two ways to fill them, one file format (`write_safetensors`):

    ShardWriter      tensors arrive one group at a time; it holds one output shard, written when
                     the next group would not fit (save_pretrained, Hugging Face sources)
    plan_shards      the shard boundaries from the groups' shapes and dtypes alone, before any
                     tensor is read: each shard is then written by whichever rank is given it,
                     tensor by tensor as they are read (the export of a training checkpoint,
                     checkpoint/streamed_export.py), holding one tensor at a time

Shards are named `model-XXXXX-of-YYYYY.safetensors`; a single shard is `model.safetensors` with
no index (the Hugging Face convention).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable
from pathlib import Path

import torch

from .errors import CheckpointError
from .hf_layout import INDEX_FILE
from .safetensors_file import DTYPE_NAMES

# (name, dtype, shape) of one stored tensor, known before its values are
Spec = tuple[str, torch.dtype, tuple[int, ...]]


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def spec_bytes(spec: Spec) -> int:
    _, dtype, shape = spec
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def starts_new_shard(shard_bytes: int, shard_empty: bool, group_bytes: int, max_bytes: int) -> bool:
    """The one rule that cuts shards: a group that would push a non-empty shard past the cap
    starts the next one (a group larger than the cap gets a shard of its own)."""
    return not shard_empty and shard_bytes + group_bytes > max_bytes


def plan_shards(groups: list[list[Spec]], max_bytes: int) -> list[list[int]]:
    """The shards ShardWriter would write for these groups, as lists of group indices."""
    if max_bytes <= 0:
        raise CheckpointError(f"max shard size must be positive, got {max_bytes} bytes")
    shards: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, group in enumerate(groups):
        group_bytes = sum(spec_bytes(s) for s in group)
        if starts_new_shard(size, not current, group_bytes, max_bytes):
            shards.append(current)
            current, size = [], 0
        current.append(i)
        size += group_bytes
    if current:
        shards.append(current)
    return shards


def shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def write_index(directory: Path, shards: list[list[Spec]], names: list[str]) -> None:
    """model.safetensors.index.json for several shards (none for a single one)."""
    if len(shards) <= 1:
        return
    weight_map = {spec[0]: name for shard, name in zip(shards, names) for spec in shard}
    total = sum(spec_bytes(s) for shard in shards for s in shard)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def write_safetensors(path: Path, specs: list[Spec], tensors: Iterable[torch.Tensor]) -> None:
    """One safetensors file of `specs`, the header written first, then each tensor of `tensors`
    (in the order of `specs`) as it arrives: the writer holds no tensor of its own. The data are
    laid out in the order of `specs`; the header is padded with spaces to 8 bytes."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in specs:
        size = spec_bytes((name, dtype, shape))
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    count = 0
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for (name, dtype, shape), t in zip(specs, tensors):
            t = t.detach()
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise CheckpointError(f"tensor {name} arrived as {t.dtype} {list(t.shape)}, but its shard's header "
                                      f"says {dtype} {list(shape)}; the export's plan and its tensors disagree")
            if t.numel():
                f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
            count += 1
        if count != len(specs):
            raise CheckpointError(f"{path}: {len(specs) - count} of its {len(specs)} tensors never arrived")
    os.chmod(path, 0o666 & ~_umask())


class ShardWriter:
    def __init__(self, directory: str | os.PathLike, max_bytes: int):
        if max_bytes <= 0:
            raise CheckpointError(f"max shard size must be positive, got {max_bytes} bytes")
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self._shard: dict[str, torch.Tensor] = {}
        self._shard_bytes = 0
        self._written: list[tuple[Path, list[Spec]]] = []
        self.total_bytes = 0

    def add(self, group: dict[str, torch.Tensor]) -> None:
        size = sum(nbytes(t) for t in group.values())
        if starts_new_shard(self._shard_bytes, not self._shard, size, self.max_bytes):
            self._flush()
        for name, t in group.items():
            self._shard[name] = t.detach()
        self._shard_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        if not self._shard:
            return
        path = self.directory / f".shard-{len(self._written) + 1:05d}.partial"
        specs = [(name, t.dtype, tuple(t.shape)) for name, t in self._shard.items()]
        write_safetensors(path, specs, self._shard.values())
        self._written.append((path, specs))
        self._shard, self._shard_bytes = {}, 0

    def finish(self) -> list[Path]:
        """Write the last shard, give every shard its final name, write the index."""
        self._flush()
        n = len(self._written)
        if n == 0:
            raise CheckpointError("nothing to write: the model has no tensors")
        names = shard_names(n)
        files = []
        for (path, _), name in zip(self._written, names):
            os.replace(path, self.directory / name)
            files.append(self.directory / name)
        write_index(self.directory, [specs for _, specs in self._written], names)
        return files
