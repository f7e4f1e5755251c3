"""Training checkpoints: everything needed to continue a run exactly.

Layout of one checkpoint, `<checkpoint.dir>/step_<global step, 8 digits>/`:
    model.pt           model state dict
    config.json        the model's Hugging Face config (so `dsa-train export` needs nothing else)
    engine.pt          optimizer + LR schedule state, fp32 masters of bf16 parameters (absent
                       at a stage boundary: the next stage starts with a fresh optimizer)
    data.pt            data loader state (position in the stream)
    rng.pt             python / numpy / torch (/ cuda) RNG states
    trainer_state.json stage index and step, global step, tokens, W&B run id, summary so far

A checkpoint is written to a hidden temporary directory and renamed into place, so a directory
named `step_*` is always complete. Only the newest `keep_last` are kept.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

PREFIX = "step_"
STATE_FILE = "trainer_state.json"


@dataclass
class TrainerState:
    stage_index: int = 0  # stage to run (== number of stages when all are done)
    stage_step: int = 0  # optimizer steps completed in that stage
    global_step: int = 0  # optimizer steps completed over all stages
    tokens_seen: int = 0
    wandb_run_id: str | None = None
    # probe results: {stage name: {"start": {...}, "end": {...}}}
    summary: dict = field(default_factory=dict)


@dataclass
class Checkpoint:
    path: Path
    state: TrainerState
    model: dict
    engine: dict | None
    data: dict
    rng: dict


def save_checkpoint(
    directory: str | os.PathLike,
    state: TrainerState,
    model: torch.nn.Module,
    engine_state: dict | None,
    data_state: dict,
    rng: dict,
    keep_last: int,
) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"{PREFIX}{state.global_step:08d}"
    tmp = directory / f".tmp_{final.name}_{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    torch.save(model.state_dict(), tmp / "model.pt")
    (tmp / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2))
    if engine_state is not None:
        torch.save(engine_state, tmp / "engine.pt")
    torch.save(data_state, tmp / "data.pt")
    torch.save(rng, tmp / "rng.pt")
    (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=2))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    prune_checkpoints(directory, keep_last)
    return final


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Complete checkpoints, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.name.startswith(PREFIX) and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def prune_checkpoints(directory: str | os.PathLike, keep_last: int) -> None:
    if keep_last <= 0:
        return
    for old in list_checkpoints(directory)[:-keep_last]:
        shutil.rmtree(old)


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    path = Path(path)
    state = TrainerState(**json.loads((path / STATE_FILE).read_text()))
    engine_file = path / "engine.pt"
    return Checkpoint(
        path=path,
        state=state,
        model=torch.load(path / "model.pt", map_location="cpu", weights_only=True),
        engine=torch.load(engine_file, map_location="cpu", weights_only=False) if engine_file.exists() else None,
        data=torch.load(path / "data.pt", weights_only=False),
        rng=torch.load(path / "rng.pt", weights_only=False),
    )


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    found = list_checkpoints(directory)
    return found[-1] if found else None
