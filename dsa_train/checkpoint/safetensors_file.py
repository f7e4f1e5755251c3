"""One `.safetensors` file: its header, validated against the file size, and tensor reads.

The format is an 8-byte little-endian header length N, N bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`, then the data
(offsets are relative to the end of the header). Reading the header alone tells every tensor's
dtype and shape and whether the file is complete, so a whole checkpoint is checked before any
weight is read. Tensors are read with plain file reads into fresh buffers (no memory map): the
process holds exactly the tensors it keeps plus the one being read.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import CheckpointError

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str  # safetensors spelling: "BF16", "F8_E4M3", ...
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int
    file: Path

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def read_header(path: str | os.PathLike) -> dict[str, TensorEntry]:
    """{name: TensorEntry} of one safetensors file; CheckpointError if it is truncated or corrupt."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path} is {size} bytes, too short for a safetensors file: it is truncated; re-download or re-export it")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, _MAX_HEADER_BYTES):
                raise CheckpointError(
                    f"{path} declares a {n}-byte header but the file has {size} bytes: it is truncated or not a "
                    "safetensors file; re-download or re-export it"
                )
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} has a corrupt safetensors header ({e}); re-download or re-export it") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} has a corrupt safetensors header (not a JSON object); re-download or re-export it")
    data_start = 8 + n
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(s) for s in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"tensor {name} in {path} has a corrupt header entry {info!r}; re-download or re-export it") from e
        if dtype not in DTYPES:
            raise CheckpointError(f"tensor {name} in {path} has dtype {dtype}, which dsa_train cannot read")
        entry = TensorEntry(name, dtype, shape, data_start + int(begin), data_start + int(end), path)
        expected = entry.numel * DTYPES[dtype].itemsize
        if entry.nbytes != expected:
            raise CheckpointError(
                f"tensor {name} in {path}: header says {entry.nbytes} bytes for a {dtype} tensor of shape "
                f"{list(shape)} ({expected} bytes); the file is corrupt, re-download or re-export it"
            )
        if entry.end > size:
            raise CheckpointError(
                f"tensor {name} in {path} ends at byte {entry.end} but the file has only {size} bytes: the file is "
                "truncated (an interrupted download or copy?); re-download or re-export it"
            )
        entries[name] = entry
    return entries


class SafetensorsReader:
    """Reads tensors of one file through one open handle (open it with `with`)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._f = None

    def __enter__(self) -> "SafetensorsReader":
        try:
            self._f = open(self.path, "rb")
        except OSError as e:
            raise CheckpointError(f"cannot open {self.path}: {e}") from e
        return self

    def __exit__(self, *exc) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def read(self, entry: TensorEntry) -> torch.Tensor:
        """The tensor, in its stored dtype, in a buffer of its own."""
        buf = torch.empty(entry.nbytes, dtype=torch.uint8)
        self._f.seek(entry.begin)
        got = self._f.readinto(memoryview(buf.numpy()))
        if got != entry.nbytes:
            raise CheckpointError(
                f"tensor {entry.name} in {self.path}: read {got} of {entry.nbytes} bytes; the file is truncated, "
                "re-download or re-export it"
            )
        return buf.view(entry.torch_dtype).reshape(entry.shape)
