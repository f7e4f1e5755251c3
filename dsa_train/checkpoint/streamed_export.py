"""The V3.2 Hugging Face export of a training checkpoint, streamed tensor by tensor, by one
process or by every rank of a job.

    dsa-train export SRC OUT                     one process: every shard
    CheckpointManager.export (end of a run)      N ranks: shard i is written by rank i mod N

The shard boundaries are planned from the checkpoint's metadata alone (names, shapes, dtypes:
`encoded_specs`, `plan_shards`), so every rank knows every shard's name and contents before a
tensor is read and writes its own shards straight into the shared directory: a shard's header
first, then each tensor as it is read from the checkpoint (`write_safetensors`). A rank holds one
tensor at a time: the tensor read (DCP's read of its chunks) and, when its dtype changes, the
encoded copy. Rank 0 then writes config.json, the index, the tokenizer and the marker
(export.WRITTEN_BY_FILE) and moves the directory into place. No tensor is gathered or sent
between ranks; ranks meet only at `agree`, which also makes a problem on any rank (a corrupt
byte range, a full disk) fail the export on every rank with the first rank's message.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from ..model.config import DSAConfig
from .errors import CheckpointError
from .export import (ExportOptions, ExportResult, copy_tokenizer, encode, encoded_specs, natural_key, place,
                     v32_config_json, write_written_by)
from .hf_layout import CONFIG_FILE
from .shard_writer import plan_shards, shard_names, spec_bytes, write_index, write_safetensors
from .training_source import open_training_checkpoint


def _one_process(problem: str | None) -> str | None:
    return problem


def export_training_checkpoint(
    src: str | os.PathLike,
    out: str | os.PathLike,
    options: ExportOptions,
    tokenizer_dir: str | os.PathLike | None = None,
    config: str | os.PathLike | None = None,
    *,
    model_config: DSAConfig | None = None,
    torch_dtype: torch.dtype | None = None,
    checksums: bool | None = None,
    rank: int = 0,
    world_size: int = 1,
    agree: Callable[[str | None], str | None] = _one_process,
    written_by: str = "dsa-train export",
) -> ExportResult:
    """Export the training checkpoint `src` to OUT (see the module docstring). Every rank calls
    it with its `rank` of `world_size` and `agree`: a collective returning the first rank's
    problem (None: none had one) on every rank. `model_config` replaces the checkpoint's config
    (the trainer's, with the top-k it trained), `torch_dtype` the config's `torch_dtype` when
    `options.dtype` is None (every tensor keeps its dtype). `tokenizer_dir` None: the run's.
    `written_by` goes into the directory's marker (export.WRITTEN_BY_FILE)."""
    out = Path(out)
    ckpt = open_training_checkpoint(src, config, checksums)
    cfg = model_config if model_config is not None else ckpt.config
    tokenizer_dir = tokenizer_dir if tokenizer_dir is not None else ckpt.tokenizer_dir
    meta = getattr(ckpt.state, "meta", ckpt.state)
    names = sorted(ckpt.state, key=natural_key)
    groups = [encoded_specs(n, tuple(meta[n].shape), meta[n].dtype, options) for n in names]
    shards = plan_shards(groups, options.max_shard_bytes)
    files = shard_names(len(shards))
    # one directory for every rank (a single process keeps the pid: concurrent exports)
    tmp = out.parent / (f".{out.name}.partial" + (f"-{os.getpid()}" if world_size == 1 else ""))
    result = ExportResult(path=out, files=[out / f for f in files])

    def together(work: Callable[[], None]) -> None:
        """`work` on this rank, then every rank raises the first rank's problem (one process:
        the error itself)."""
        problem = None
        try:
            work()
        except (OSError, CheckpointError) as e:
            if world_size == 1:
                raise
            problem = f"rank {rank}: {e}"
        first = agree(problem)
        if first is not None:
            raise CheckpointError(f"exporting {src} to {out} failed on {first}")

    def prepare() -> None:
        if rank == 0:
            out.parent.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()

    def write_shards() -> None:
        for i in range(rank, len(shards), world_size):
            specs = [spec for g in shards[i] for spec in groups[g]]
            write_safetensors(tmp / files[i], specs,
                              (t for g in shards[i] for t in encode(names[g], ckpt.state[names[g]], options).values()))
        if rank == 0:
            write_index(tmp, [[s for g in shard for s in groups[g]] for shard in shards], files)
            config_json = v32_config_json(cfg, options, torch_dtype or torch.bfloat16)
            (tmp / CONFIG_FILE).write_text(json.dumps(config_json, indent=2) + "\n")
            if tokenizer_dir is not None:
                result.tokenizer_files = copy_tokenizer(tokenizer_dir, tmp)
            write_written_by(tmp, written_by, str(Path(src).resolve()))

    def finish() -> None:
        if rank == 0:
            place(tmp, out)

    try:
        together(prepare)
        together(write_shards)
        together(finish)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    specs = [s for group in groups for s in group]
    result.tensors = len(specs)
    result.fp8_tensors = sum(dtype == torch.float8_e4m3fn for _, dtype, _ in specs)
    result.total_bytes = sum(spec_bytes(s) for s in specs)
    return result
