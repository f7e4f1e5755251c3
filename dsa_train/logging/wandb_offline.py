"""Reads the history of an offline W&B run from its `run-<id>.wandb` file.

The file is W&B's transaction log: a 7-byte header (":W&B", magic 0xBEE1, version 0) followed
by LevelDB-log framed records (32 KiB blocks; each fragment has a CRC32C, a length and a type)
holding protobuf `Record`s. This reader needs no network and no W&B account; it is how the
tests check that metrics reached the run, and a quick way to inspect a run before `wandb sync`.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK_SIZE = 32 * 1024
HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _records(data: bytes):
    if not data.startswith(HEADER):
        raise ValueError("not a W&B transaction log (bad header)")
    pos, pending = len(HEADER), b""
    while pos + 7 <= len(data):
        room = BLOCK_SIZE - pos % BLOCK_SIZE
        if room < 7:  # block trailer padding
            pos += room
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        payload = data[pos + 7: pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:  # zero padding at the end of a block
            pos += BLOCK_SIZE - pos % BLOCK_SIZE if pos % BLOCK_SIZE else 0
            continue
        if kind == FULL:
            yield payload
        elif kind == FIRST:
            pending = payload
        elif kind == MIDDLE:
            pending += payload
        elif kind == LAST:
            yield pending + payload
            pending = b""


def find_run_file(wandb_dir: str | Path, run_id: str | None = None) -> Path:
    """The `run-*.wandb` file under `wandb_dir` of run `run_id` (any run when None; the newest
    by modification time if several match)."""
    pattern = f"run-{run_id}.wandb" if run_id else "run-*.wandb"
    files = sorted(Path(wandb_dir).rglob(pattern), key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"no {pattern} file under {wandb_dir}")
    return files[-1]


def read_history(run_file: str | Path) -> list[dict]:
    """Every `run.log` row: {"_step": step, key: value, ...}."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for payload in _records(Path(run_file).read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") != "history":
            continue
        row = {}
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            row[key] = json.loads(item.value_json)
        if record.history.HasField("step"):
            row.setdefault("_step", record.history.step.num)
        rows.append(row)
    return rows


def read_config(run_file: str | Path) -> dict:
    """The run config as logged (the last config record wins, key by key)."""
    from wandb.proto import wandb_internal_pb2

    config: dict = {}
    for payload in _records(Path(run_file).read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        items = record.config.update if kind == "config" else record.run.config.update if kind == "run" else []
        for item in items:
            key = item.key or "/".join(item.nested_key)
            config[key] = json.loads(item.value_json)
    return config
