"""Size-capped safetensors shards plus `model.safetensors.index.json`, written as tensors arrive.

Tensors come in groups that must share a shard (an FP8 weight and its scales). A shard is
written as soon as the next group would push it past `max_bytes`, so the writer holds one shard
at a time. Shards are named `model-XXXXX-of-YYYYY.safetensors` once their count is known; a
single shard is `model.safetensors` with no index (the Hugging Face convention).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from .errors import CheckpointError
from .hf_layout import INDEX_FILE


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class ShardWriter:
    def __init__(self, directory: str | os.PathLike, max_bytes: int):
        if max_bytes <= 0:
            raise CheckpointError(f"max shard size must be positive, got {max_bytes} bytes")
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self._shard: dict[str, torch.Tensor] = {}
        self._shard_bytes = 0
        self._written: list[tuple[Path, list[str]]] = []
        self._seen_storage: set[int] = set()
        self.total_bytes = 0

    def add(self, group: dict[str, torch.Tensor]) -> None:
        size = sum(nbytes(t) for t in group.values())
        if self._shard and self._shard_bytes + size > self.max_bytes:
            self._flush()
        for name, t in group.items():
            t = t.detach().contiguous()
            ptr = t.untyped_storage().data_ptr()
            if ptr in self._seen_storage and t.numel():  # tied weights: safetensors wants no aliasing
                t = t.clone()
            self._seen_storage.add(t.untyped_storage().data_ptr())
            self._shard[name] = t
        self._shard_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        if not self._shard:
            return
        path = self.directory / f".shard-{len(self._written) + 1:05d}.partial"
        save_file(self._shard, str(path), metadata={"format": "pt"})
        os.chmod(path, 0o666 & ~_umask())
        self._written.append((path, list(self._shard)))
        self._shard, self._shard_bytes, self._seen_storage = {}, 0, set()

    def finish(self) -> list[Path]:
        """Write the last shard, give every shard its final name, write the index."""
        self._flush()
        n = len(self._written)
        if n == 0:
            raise CheckpointError("nothing to write: the model has no tensors")
        if n == 1:
            final = self.directory / "model.safetensors"
            os.replace(self._written[0][0], final)
            return [final]
        weight_map, files = {}, []
        for i, (path, names) in enumerate(self._written):
            final = self.directory / f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(path, final)
            files.append(final)
            weight_map.update({name: final.name for name in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return files
