"""A Hugging Face model directory: config.json, the safetensors files and their index, checked.

`open_hf_dir` reads config.json and every shard's header (no weights), and checks that the
index and the files agree: every listed file exists and is complete, every index entry is in
the file it names, every tensor of a listed file has an index entry, no tensor is stored twice.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import CheckpointError
from .safetensors_file import TensorEntry, read_header

INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"


@dataclass
class HFDir:
    path: Path
    config: dict  # config.json as written
    entries: dict[str, TensorEntry]  # every stored tensor, by name
    files: list[Path]  # in the order to read them
    indexed: bool  # True when model.safetensors.index.json was used

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())


def is_hf_dir(path: str | os.PathLike) -> bool:
    path = Path(path)
    return (path / CONFIG_FILE).is_file() and ((path / INDEX_FILE).is_file() or any(path.glob("*.safetensors")))


def read_config_json(path: str | os.PathLike) -> dict:
    """config.json of a model directory (or a config file given directly)."""
    path = Path(path)
    cfg_file = path / CONFIG_FILE if path.is_dir() else path
    if not cfg_file.is_file():
        raise CheckpointError(f"no {CONFIG_FILE} in {path}; pass a Hugging Face model directory (config.json + *.safetensors)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON ({e}); fix or re-download it") from e
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{cfg_file} is not a JSON object; fix or re-download it")
    return cfg


def _weight_map(path: Path) -> dict[str, str]:
    index = path / INDEX_FILE
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index} is not a valid safetensors index ({e!r}); re-download or re-export it") from e
    for name, fname in weight_map.items():
        # shard names are file names inside the checkpoint directory (checked by name, not by
        # resolving: a Hugging Face cache snapshot holds symlinks into its blob store)
        parts = Path(str(fname)).parts
        if not isinstance(fname, str) or not parts or Path(fname).is_absolute() or ".." in parts:
            raise CheckpointError(
                f"{index} maps tensor {name} to {fname!r}, outside the checkpoint directory {path}; refusing to "
                "open it", fix="an index names shard files inside its own directory: regenerate the index or "
                "re-download the checkpoint")
    return weight_map


def open_hf_dir(path: str | os.PathLike) -> HFDir:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory; pass a Hugging Face model directory (config.json + *.safetensors)")
    config = read_config_json(path)
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = _weight_map(path)
        files_listed: dict[str, list[str]] = {}
        for name, fname in weight_map.items():
            files_listed.setdefault(fname, []).append(name)
        for fname, names in files_listed.items():
            if not (path / fname).is_file():
                raise CheckpointError(
                    f"{index} maps {len(names)} tensors (e.g. {names[0]}) to {fname}, which is missing from {path}; "
                    "the download is incomplete"
                )
        files = [path / f for f in sorted(files_listed)]
    else:
        files = sorted(path.glob("*.safetensors"))
        weight_map = None
        if not files:
            raise CheckpointError(f"no *.safetensors files and no {INDEX_FILE} in {path}; expected a Hugging Face model directory")

    entries: dict[str, TensorEntry] = {}
    for fpath in files:
        for name, entry in read_header(fpath).items():
            if name in entries:
                raise CheckpointError(f"tensor {name} is stored twice, in {entries[name].file} and in {fpath}; remove the stale file")
            if weight_map is not None and weight_map.get(name) != fpath.name:
                where = weight_map.get(name)
                raise CheckpointError(
                    f"tensor {name} is in {fpath} but {index} "
                    + (f"maps it to {where}" if where else "has no entry for it")
                    + "; the index is out of date, regenerate it (or re-download the checkpoint)"
                )
            entries[name] = entry
    if weight_map is not None:
        for name, fname in weight_map.items():
            if name not in entries:
                raise CheckpointError(
                    f"{index} maps tensor {name} to {fname}, but {path / fname} has no such tensor; "
                    "the shard or the index is wrong, re-download or re-export the checkpoint"
                )
    return HFDir(path=path, config=config, entries=entries, files=files, indexed=weight_map is not None)
