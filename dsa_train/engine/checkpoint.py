"""Training checkpoints: everything needed to continue a run exactly, written crash-safely.

Layout of `<checkpoint.dir>/`:
    step_<global step, 8 digits>/   one complete checkpoint (below)
    latest                          name of the newest committed checkpoint, updated last
    .tmp_step_*/  .old_step_*/      a save in progress / being replaced (removed by the next save)
    corrupt_step_*/                 a checkpoint that failed verification on resume (kept for a look)

One checkpoint:
    model.pt           model state dict (rank 0; `model.rank<r>.pt` for ranks that hold other keys)
    layout.json        written by distributed runs next to each rank's model file
                       (`layout.rank<r>.json`): {"tensor_parallel": TP, "shards": {name: [dim,
                       start, stop]}} for tensor-parallel slices; every other tensor of the file
                       is whole (a replica, or an expert only this expert-parallel rank holds).
                       `dsa-train export` merges the ranks' files with it.
    config.json        the model's Hugging Face config (so `dsa-train export` needs nothing else)
    engine.pt          optimizer + LR schedule state, fp32 masters of bf16 parameters (absent
                       at a stage boundary: the next stage starts with a fresh optimizer);
                       `engine.rank<r>.pt` for the other ranks that pass their own state
    data.pt            data loader state (position in the stream); `data.rank<r>.pt` per rank
    rng.pt             python / numpy / torch (/ cuda) RNG states; `rng.rank<r>.pt` per rank
    trainer_state.json stage index and step, global step, tokens, W&B run id, non-finite
                       counters, summary so far
    manifest.json      every file above with its size and sha256, written last

Guarantees (docs/reliability.md):
* A save writes into `.tmp_step_N/`, fsyncs every file and the directory, renames it to `step_N`
  (atomic), fsyncs the parent, then replaces `latest` (write + fsync + rename). A directory named
  `step_*` is therefore always complete; a crash at any point leaves the previous checkpoints
  untouched.
* Old checkpoints are pruned to `keep_last` only after the new one is committed, and the one just
  written is never pruned.
* A failed save removes its temporary directory and raises CheckpointSaveError naming the
  checkpoint that is still intact and the fix for the cause (space, permission, other I/O). A
  single-process save that runs out of space first prunes what a successful save would prune
  (all but the newest keep_last - 1 older checkpoints, never the newest) and tries once more.
* Loading verifies the manifest (sizes always, sha256 unless disabled) and raises
  CorruptCheckpoint naming the file; `find_resume_checkpoint` falls back to the newest
  checkpoint that verifies. A checkpoint without a manifest cannot be verified: it raises
  UnverifiedCheckpoint (the run stops and says how to proceed) unless checksums are disabled.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from dsa_train.engine import faults
from dsa_train.errors import DSATrainError

log = logging.getLogger(__name__)

PREFIX = "step_"
STATE_FILE = "trainer_state.json"
MANIFEST = "manifest.json"
LATEST = "latest"
TMP_PREFIX = ".tmp_"
OLD_PREFIX = ".old_"
CORRUPT_PREFIX = "corrupt_"
MANIFEST_VERSION = 1


class CorruptCheckpoint(DSATrainError, RuntimeError):
    """A checkpoint whose files do not match its manifest (or cannot be read)."""


class UnverifiedCheckpoint(DSATrainError, RuntimeError):
    """A checkpoint without a manifest: its files cannot be checked, so it is not used unless the
    user says to trust it (checkpoint.verify_checksums=false). Not moved aside: it may be fine."""


class CheckpointSaveError(DSATrainError, RuntimeError):
    """A save that failed; the previous checkpoints are untouched."""


@dataclass
class TrainerState:
    stage_index: int = 0  # stage to run (== number of stages when all are done)
    stage_step: int = 0  # optimizer steps completed in that stage
    global_step: int = 0  # optimizer steps completed over all stages
    tokens_seen: int = 0
    wandb_run_id: str | None = None
    # probe results: {stage name: {"start": {...}, "end": {...}}}
    summary: dict = field(default_factory=dict)
    # non-finite policy: steps skipped in total and in a row (up to the last completed step)
    nonfinite_skipped: int = 0
    nonfinite_consecutive: int = 0
    # the recipe (resolved TrainConfig as a dict) the checkpoint was written under: a resume
    # compares it with the recipe it is given (engine/recipe_change.py); None in older checkpoints
    recipe: dict | None = None


@dataclass
class Checkpoint:
    path: Path
    state: TrainerState
    model: dict
    engine: dict | None
    data: dict
    rng: dict


def step_of(path: Path) -> int:
    return int(path.name[len(PREFIX):])


LAYOUT_STEM = "layout"  # `layout.json` / `layout.rank<r>.json`: how a rank's model file is sharded


def rank_file(stem: str, rank: int) -> str:
    ext = ".json" if stem == LAYOUT_STEM else ".pt"
    return f"{stem}{ext}" if rank == 0 else f"{stem}.rank{rank:05d}{ext}"


# ---------------------------------------------------------------------------------- writing
class _HashingWriter:
    """File-like wrapper: hashes and counts what passes, and gives the fault switch its hook."""

    def __init__(self, f, write_faults: faults.WriteFaults):
        self.f = f
        self.sha = hashlib.sha256()
        self.size = 0
        self.write_faults = write_faults
        self.error: BaseException | None = None

    def write(self, data) -> int:
        data = bytes(data) if not isinstance(data, (bytes, bytearray)) else data
        try:
            self.write_faults.on_write()
            n = self.f.write(data)
        except BaseException as e:
            self.error = e  # torch.save's zip writer replaces it by a RuntimeError on the way out
            raise
        self.sha.update(data)
        self.size += len(data)
        return n

    def flush(self) -> None:
        self.f.flush()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, write: Callable, write_faults: faults.WriteFaults) -> dict:
    with open(path, "wb") as f:
        w = _HashingWriter(f, write_faults)
        try:
            write(w)
        except Exception as e:
            if w.error is not None and e is not w.error:
                raise w.error from e
            raise
        f.flush()
        os.fsync(f.fileno())
    return {"size": w.size, "sha256": w.sha.hexdigest()}


def _write_json_file(path: Path, obj, write_faults: faults.WriteFaults) -> dict:
    data = json.dumps(obj, indent=2).encode()
    return _write_file(path, lambda w: w.write(data), write_faults)


def _remove_stale(directory: Path) -> None:
    for p in directory.iterdir():
        if p.name.startswith((TMP_PREFIX, OLD_PREFIX)):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def _write_latest(directory: Path, name: str) -> None:
    tmp = directory / f"{TMP_PREFIX}{LATEST}"
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / LATEST)
    _fsync_dir(directory)


def save_checkpoint(
    directory: str | os.PathLike,
    state: TrainerState,
    model: torch.nn.Module | None,
    engine_state: dict | None,
    data_state: dict,
    rng: dict,
    keep_last: int,
    *,
    rank: int = 0,
    world_size: int = 1,
    barrier: Callable[[], None] | None = None,
    model_layout: dict | None = None,
    _retrying: list[str] | None = None,
) -> Path:
    """Write a checkpoint atomically (see the module docstring) and prune to `keep_last`.

    Several ranks: every rank calls this with its own `data_state`, `rng` and, when it holds
    state of its own, `model` / `engine_state` (None otherwise); `barrier` synchronizes them.
    Rank 0 writes the shared files, merges the ranks' manifests and commits."""
    directory = Path(directory)
    barrier = barrier or (lambda: None)
    final = directory / f"{PREFIX}{state.global_step:08d}"
    tmp = directory / f"{TMP_PREFIX}{final.name}"
    # the fault switch's `enospc` models a disk that is full until a checkpoint is pruned
    write_faults = faults.WriteFaults(state.global_step, disk_freed=bool(_retrying))
    try:
        if rank == 0:
            directory.mkdir(parents=True, exist_ok=True)
            _remove_stale(directory)
            tmp.mkdir()
        barrier()
        entries: dict[str, dict] = {}
        if model is not None:
            name = rank_file("model", rank)
            entries[name] = _write_file(tmp / name, lambda w: torch.save(model.state_dict(), w), write_faults)
        if model is not None and model_layout is not None:
            name = rank_file(LAYOUT_STEM, rank)
            entries[name] = _write_json_file(tmp / name, model_layout, write_faults)
        if rank == 0 and model is not None and hasattr(model, "config"):
            entries["config.json"] = _write_json_file(tmp / "config.json", model.config.to_hf_dict(), write_faults)
        if engine_state is not None:
            name = rank_file("engine", rank)
            entries[name] = _write_file(tmp / name, lambda w: torch.save(engine_state, w), write_faults)
        for stem, obj in (("data", data_state), ("rng", rng)):
            name = rank_file(stem, rank)
            entries[name] = _write_file(tmp / name, lambda w, obj=obj: torch.save(obj, w), write_faults)
        if rank == 0:
            entries[STATE_FILE] = _write_json_file(tmp / STATE_FILE, asdict(state), write_faults)
        if world_size > 1:
            _write_json_file(tmp / f".manifest.rank{rank:05d}.json", entries, faults.WriteFaults(-1))
        barrier()
        if rank == 0:
            for r in range(1, world_size):
                part = tmp / f".manifest.rank{r:05d}.json"
                entries.update(json.loads(part.read_text()))
                part.unlink()
            manifest = {"version": MANIFEST_VERSION, "global_step": state.global_step,
                        "world_size": world_size, "files": dict(sorted(entries.items()))}
            _write_json_file(tmp / MANIFEST, manifest, faults.WriteFaults(-1))
            _fsync_dir(tmp)
            old = None
            if final.exists():  # the same step saved again (e.g. after a resume): replace it
                old = directory / f"{OLD_PREFIX}{final.name}"
                os.replace(final, old)
            os.replace(tmp, final)
            _fsync_dir(directory)
            faults.at("commit", state.global_step)
            _write_latest(directory, final.name)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            prune_checkpoints(directory, keep_last, newest=final)
        barrier()
    except OSError as err:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if _is_out_of_space(err) and world_size == 1 and not _retrying:
            pruned = make_room(directory, keep_last, final)
            if pruned:
                log.warning("saving %s failed (%s): pruned %s to make room (checkpoint.keep_last=%d), trying again",
                            final, err.strerror or err, ", ".join(p.name for p in pruned), keep_last)
                return save_checkpoint(directory, state, model, engine_state, data_state, rng, keep_last, rank=rank,
                                       world_size=world_size, barrier=barrier, model_layout=model_layout,
                                       _retrying=[p.name for p in pruned])
        raise save_error(directory, final, err, _retrying) from err
    return final


def _is_out_of_space(err: OSError) -> bool:
    return err.errno in (errno.ENOSPC, errno.EDQUOT)


def make_room(directory: Path, keep_last: int, final: Path) -> list[Path]:
    """After a save of `final` ran out of space: delete the checkpoints that a successful save
    would prune anyway (all but the newest keep_last - 1 older than `final`), never the newest
    complete one. Nothing when keep_last is 0 (keep all)."""
    if keep_last <= 0:
        return []
    older = [p for p in list_checkpoints(directory) if step_of(p) < step_of(final)]
    doomed = older[:-max(keep_last - 1, 1)]
    for old in doomed:
        shutil.rmtree(old)
    return doomed


def save_error(directory: Path, final: Path, err: OSError, pruned: list[str] | None = None) -> CheckpointSaveError:
    """The message for a failed save: what failed, what is intact, and the fix that works for it."""
    previous = [p for p in list_checkpoints(directory) if p != final] if directory.is_dir() else []
    intact = f"the newest complete checkpoint is still {previous[-1]}" if previous else "there was no earlier checkpoint"
    deleted = (f"Pruned {', '.join(pruned)} (checkpoint.keep_last) to make room, not enough" if pruned
               else "Nothing was deleted")
    if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return CheckpointSaveError(
            f"saving checkpoint {final} failed: {err}: {directory} is not writable (a permission problem, not a full "
            f"disk). Nothing was deleted: {intact}",
            fix="make the directory writable, or point checkpoint.dir (or run_dir) at a writable one, and run the same "
                "command again: it resumes from that checkpoint")
    if _is_out_of_space(err):
        return CheckpointSaveError(
            f"saving checkpoint {final} failed: {err}. {deleted}: {intact}",
            fix=f"Free space under {directory} (or point checkpoint.dir at a larger disk, or lower checkpoint.keep_last: "
                "a save that runs out of space then prunes older checkpoints first, never the newest) and run the same "
                "command again: it resumes from that checkpoint")
    return CheckpointSaveError(
        f"saving checkpoint {final} failed: {err}. Nothing was deleted: {intact}",
        fix=f"check the storage under {directory} and run the same command again: it resumes from that checkpoint")


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Committed checkpoints (complete directories named step_*), oldest first. Not verified."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [
        p for p in directory.iterdir()
        if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()
        and ((p / MANIFEST).is_file() or (p / STATE_FILE).is_file())
    ]
    return sorted(found, key=step_of)


def prune_checkpoints(directory: str | os.PathLike, keep_last: int, newest: Path | None = None) -> None:
    """Delete all but the newest `keep_last` checkpoints up to `newest` (never `newest` itself)."""
    if keep_last <= 0:
        return
    found = list_checkpoints(directory)
    if newest is not None:
        found = [p for p in found if step_of(p) <= step_of(newest)]
    for old in found[:-keep_last]:
        if newest is None or old != newest:
            shutil.rmtree(old)


def read_latest(directory: str | os.PathLike) -> str | None:
    f = Path(directory) / LATEST
    try:
        return f.read_text().strip() or None
    except OSError:
        return None


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest committed checkpoint (not verified; see `find_resume_checkpoint`)."""
    found = list_checkpoints(directory)
    return found[-1] if found else None


# ---------------------------------------------------------------------------------- reading
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def read_manifest(path: Path) -> dict | None:
    """The manifest of checkpoint `path`; None for a checkpoint written before manifests."""
    f = path / MANIFEST
    if not f.is_file():
        if (path / STATE_FILE).is_file():
            return None
        raise CorruptCheckpoint(f"checkpoint {path} has no {MANIFEST} (incomplete)")
    try:
        manifest = json.loads(f.read_text())
        manifest["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpoint(f"checkpoint {path}: {MANIFEST} is unreadable ({e})") from e
    return manifest


def verify_checkpoint(path: str | os.PathLike, checksums: bool = True, files: list[str] | None = None) -> None:
    """CorruptCheckpoint unless every file in the manifest (or those of `files` it lists) exists
    with its recorded size and, with `checksums`, its sha256."""
    path = Path(path)
    manifest = read_manifest(path)
    if manifest is None:
        if checksums:
            raise UnverifiedCheckpoint(
                f"checkpoint {path} has no {MANIFEST}, so its files cannot be verified (written by an older "
                "version, or the manifest was removed); corrupt weights would go unnoticed",
                fix="if you trust it, run again with checkpoint.verify_checksums=false (dsa-train export: "
                    "--no-verify-checksums); otherwise move it out of the directory to use an older checkpoint")
        log.warning("checkpoint %s has no %s (written by an older version): not verified "
                    "(checkpoint.verify_checksums=false)", path, MANIFEST)
        return
    for name, entry in manifest["files"].items():
        if files is not None and name not in files:
            continue
        f = path / name
        if not f.is_file():
            raise CorruptCheckpoint(f"checkpoint {path}: {name} is missing")
        size = f.stat().st_size
        if size != entry["size"]:
            raise CorruptCheckpoint(
                f"checkpoint {path}: {name} has {size} bytes, the manifest says {entry['size']} (truncated or overwritten)"
            )
        if checksums and _sha256(f) != entry["sha256"]:
            raise CorruptCheckpoint(f"checkpoint {path}: {name} does not match its sha256 in {MANIFEST} (corrupt)")


def _rank_files(path: Path, rank: int) -> dict[str, str | None]:
    """Which file of `path` holds each part for `rank` (rank files fall back to rank 0's)."""
    out: dict[str, str | None] = {}
    for stem in ("model", "engine", "data", "rng"):
        own = rank_file(stem, rank)
        if (path / own).is_file():
            out[stem] = own
        elif stem in ("model", "engine") and (path / rank_file(stem, 0)).is_file():
            out[stem] = rank_file(stem, 0)
        else:
            out[stem] = None
    return out


def load_checkpoint(path: str | os.PathLike, *, rank: int = 0, verify: bool = True, checksums: bool = True) -> Checkpoint:
    """Read checkpoint `path` for `rank`, verifying the files it reads against the manifest."""
    path = Path(path)
    parts = _rank_files(path, rank)
    for stem in ("model", "data", "rng"):
        if parts[stem] is None:
            raise CorruptCheckpoint(
                f"checkpoint {path} has no {rank_file(stem, rank)} for rank {rank}"
                + (" (was it written by fewer ranks? resume with the same world size)" if rank else "")
            )
    if verify:
        verify_checkpoint(path, checksums, files=[STATE_FILE, *(f for f in parts.values() if f)])

    def _load(name: str, weights_only: bool):
        try:
            return torch.load(path / name, map_location="cpu", weights_only=weights_only)
        except Exception as e:  # truncated zip, bad pickle, ...
            raise CorruptCheckpoint(f"checkpoint {path}: cannot read {name} ({type(e).__name__}: {e})") from e

    try:
        state = TrainerState(**json.loads((path / STATE_FILE).read_text()))
    except (OSError, ValueError, TypeError) as e:
        raise CorruptCheckpoint(f"checkpoint {path}: cannot read {STATE_FILE} ({e})") from e
    return Checkpoint(
        path=path,
        state=state,
        model=_load(parts["model"], True),
        engine=_load(parts["engine"], False) if parts["engine"] else None,
        data=_load(parts["data"], False),
        rng=_load(parts["rng"], False),
    )


def find_resume_checkpoint(
    directory: str | os.PathLike, checksums: bool = True
) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint that verifies, and the newer ones rejected with their reasons."""
    rejected: list[tuple[Path, str]] = []
    for path in reversed(list_checkpoints(directory)):
        try:
            verify_checkpoint(path, checksums)
            return path, rejected
        except (CorruptCheckpoint, OSError) as e:
            rejected.append((path, str(e)))
    return None, rejected


def quarantine(path: Path) -> Path:
    """Rename a rejected checkpoint out of the `step_*` namespace (kept for inspection)."""
    target = path.with_name(CORRUPT_PREFIX + path.name)
    n = 1
    while target.exists():
        target = path.with_name(f"{CORRUPT_PREFIX}{path.name}.{n}")
        n += 1
    os.replace(path, target)
    return target
