"""Training checkpoints: everything needed to continue a run exactly, written crash-safely,
sharded and independent of the parallel layout that wrote them.

Layout of `<checkpoint.dir>/`:
    step_<global step, 8 digits>/   one complete checkpoint (below)
    latest                          name of the newest committed checkpoint, updated last
    .tmp_step_*/  .old_step_*/      a save in progress / being replaced (removed by the next save)
    corrupt_step_*/                 a checkpoint that failed verification on resume (kept for a look)

One checkpoint:
    state/             the tensors, a torch.distributed.checkpoint (DCP) directory
                       (checkpoint/sharded_state.py): `model/<name>` (model values), `optim/master/<name>`
                       (fp32 masters of bf16 parameters), `optim/exp_avg|exp_avg_sq/<name>` (AdamW
                       moments), each a *global* tensor of the single-process shape; every rank
                       writes only its pieces (`__<rank>_0.distcp`), a replica once; `.metadata`
                       says where each chunk is. Absent optimizer keys at a stage boundary (the next
                       stage starts with a fresh optimizer).
    config.json        the model's Hugging Face config (so `dsa-train export` needs nothing else)
    optimizer.json     AdamW's step count and the LR schedule's position (absent at a stage boundary)
    data.pt            the data loader's position (one for the job: ranks move in lockstep; a
                       different data-parallel size converts it, data/loader.py)
    rng.pt             python / numpy / torch (/ cuda) RNG states; `rng.rank<r>.pt` per rank
    trainer_state.json stage index and step, global step, tokens, W&B run id, non-finite
                       counters, summary so far, the recipe
    manifest.json      every file with its size; the small files with their sha256, the DCP data
                       files with the sha256 of every byte range (one per written chunk); written last

Guarantees (docs/reliability.md, docs/checkpoints.md):
* A save writes into `.tmp_step_N/`, fsyncs every file and the directory, renames it to `step_N`
  (atomic), fsyncs the parent, then replaces `latest` (write + fsync + rename). A directory named
  `step_*` is therefore always complete; a crash at any point leaves the previous checkpoints
  untouched. With `checkpoint.async_save` the tensors are written in the background and the
  commit (rename + `latest`) happens only once every rank's write finished.
* Old checkpoints are pruned to `keep_last` only after the new one is committed, and the one just
  written is never pruned.
* A failed save removes its temporary directory and raises CheckpointSaveError naming the
  checkpoint that is still intact and the fix for the cause (space, permission, other I/O). A
  single-process save that runs out of space first prunes what a successful save would prune
  (all but the newest keep_last - 1 older checkpoints, never the newest) and tries once more.
* Loading checks every file's size, the sha256 of the small files a rank reads, and (while
  reading) the sha256 of each byte range of the tensor files it reads — nothing else; it raises
  CorruptCheckpoint naming the file; `find_resume_checkpoint` falls back to the newest
  checkpoint that verifies. A checkpoint without a manifest cannot be verified: it raises
  UnverifiedCheckpoint (the run stops and says how to proceed) unless checksums are disabled. A
  checkpoint in the per-rank format of earlier versions (`model.pt`) raises OldFormatCheckpoint.
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

import dsa_train.checkpoint.sharded_state as sharded
from dsa_train.faults import NO_FAULTS, CheckpointFaults, checkpoint_faults
from dsa_train.errors import DSATrainError

log = logging.getLogger(__name__)

PREFIX = "step_"
STATE_FILE = "trainer_state.json"
MANIFEST = "manifest.json"
LATEST = "latest"
TMP_PREFIX = ".tmp_"
OLD_PREFIX = ".old_"
CORRUPT_PREFIX = "corrupt_"
MANIFEST_VERSION = 2
OPTIMIZER_FILE = "optimizer.json"
DATA_FILE = "data.pt"
CONFIG_FILE = "config.json"
STATE_DIR = sharded.STATE_DIR
DCP_METADATA = f"{STATE_DIR}/.metadata"


class CorruptCheckpoint(DSATrainError, RuntimeError):
    """A checkpoint whose files do not match its manifest (or cannot be read)."""


class UnverifiedCheckpoint(DSATrainError, RuntimeError):
    """A checkpoint without a manifest: its files cannot be checked, so it is not used unless the
    user says to trust it (checkpoint.verify_checksums=false). Not moved aside: it may be fine."""


class OldFormatCheckpoint(DSATrainError, RuntimeError):
    """A checkpoint in the per-rank format of earlier versions (one `model.pt` / `engine.pt` per
    rank): this version resumes only sharded checkpoints. Not moved aside: it is intact."""


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
    # compares it with the recipe it is given (trainer/recipe_change.py); None in older checkpoints
    recipe: dict | None = None


@dataclass
class Checkpoint:
    """A checkpoint opened for one rank: the small state read, the tensors read on demand into
    the pieces of the layout now (`load`)."""

    path: Path
    state: TrainerState
    optimizer: dict | None  # optimizer.json (None at a stage boundary)
    data: dict
    rng: dict
    regions: dict | None  # {file under state/: {"offset+length": sha256}}; None: checksums off

    def model_shapes(self) -> dict[str, tuple[int, ...]]:
        """parameter / buffer name -> global shape of the saved model."""
        return sharded.global_shapes(self.path / STATE_DIR, sharded.MODEL)

    def saved_keys(self) -> set[str]:
        return set(sharded.read_metadata(self.path / STATE_DIR).state_dict_metadata)

    def load(self, pieces: dict[str, sharded.GlobalPieces], process_group=None) -> None:
        """Fill `pieces` (this rank's, any layout) from the checkpoint; every rank calls it."""
        sharded.load_pieces(self.path / STATE_DIR, pieces, self.regions,
                            lambda m: CorruptCheckpoint(f"checkpoint {self.path}: {m}"), process_group)


def step_of(path: Path) -> int:
    return int(path.name[len(PREFIX):])


def rank_file(stem: str, rank: int) -> str:
    return f"{stem}.pt" if rank == 0 else f"{stem}.rank{rank:05d}.pt"


# ---------------------------------------------------------------------------------- writing
class _HashingWriter:
    """File-like wrapper: hashes and counts what passes, and gives the fault wrapper its hook."""

    def __init__(self, f, write_faults: CheckpointFaults):
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


def _write_file(path: Path, write: Callable, write_faults: CheckpointFaults = NO_FAULTS) -> dict:
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


def _write_json_file(path: Path, obj, write_faults: CheckpointFaults = NO_FAULTS) -> dict:
    data = json.dumps(obj, indent=2).encode()
    return _write_file(path, lambda w: w.write(data), write_faults)


def _remove_stale(directory: Path) -> list[Path]:
    removed = []
    for p in directory.iterdir():
        if p.name.startswith((TMP_PREFIX, OLD_PREFIX)):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            removed.append(p)
    return removed


def remove_stale(directory: str | os.PathLike) -> list[Path]:
    """Remove the temporary folders of saves that did not finish (`.tmp_step_*`, `.old_step_*`)."""
    directory = Path(directory)
    return _remove_stale(directory) if directory.is_dir() else []


def _write_latest(directory: Path, name: str) -> None:
    tmp = directory / f"{TMP_PREFIX}{LATEST}"
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / LATEST)
    _fsync_dir(directory)


def _io_error(err: BaseException) -> OSError | None:
    """The OSError behind a failed write (DCP wraps the ranks' errors in a CheckpointException)."""
    if isinstance(err, OSError):
        return err
    failures = getattr(err, "failures", None) or {}
    for value in failures.values():
        value = value[0] if isinstance(value, tuple) else value
        found = _io_error(value) if isinstance(value, BaseException) else None
        if found is not None:
            return found
    cause = err.__cause__ or err.__context__
    return _io_error(cause) if cause is not None and cause is not err else None


def _checkpoint_exception() -> type:
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


# what a failed write may raise: DCP's CheckpointException (the ranks' errors) is a BaseException
WRITE_ERRORS = (Exception, _checkpoint_exception())

# errno named in an error's text (torch and DCP re-raise OSErrors as RuntimeError with the text only)
_ERRNO_TEXT = {"No space left on device": errno.ENOSPC, "Disk quota exceeded": errno.EDQUOT,
               "Read-only file system": errno.EROFS, "Permission denied": errno.EACCES,
               "File too large": errno.EFBIG}
# what torch's writers say when a write came up short (the OSError itself is lost on the way)
_SHORT_WRITE_TEXT = ("unexpected pos", "file write failed", "PytorchStreamWriter failed", "write failed")


def _chain(err: BaseException):
    seen = set()
    stack = [err]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        for value in (getattr(e, "failures", None) or {}).values():
            value = value[0] if isinstance(value, tuple) else value
            if isinstance(value, BaseException):
                stack.append(value)
        stack += [e.__cause__, e.__context__]


def free_bytes(path: Path) -> tuple[int, int] | None:
    """(free, total) bytes of the file system holding `path` (its nearest existing parent)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return None
    return usage.free, usage.total


def is_nearly_full(free: int, total: int) -> bool:
    """Free space below what any checkpoint write needs: under 1 MiB, or under 1% of the file
    system (at most 64 MiB). A write that failed on a full disk leaves about nothing free."""
    return free < max(1 << 20, min(64 << 20, total // 100))


def write_failure(err: BaseException, where: Path) -> OSError | None:
    """The OSError a failed write stands for when the writer did not raise one: an errno named
    in the error's text, else a short write (torch's `unexpected pos`, ...) or any failure while
    the file system under `where` is (nearly) full -- ENOSPC, with the free space said."""
    texts = [str(e) for e in _chain(err)]
    for text in texts:
        for phrase, code in _ERRNO_TEXT.items():
            if phrase in text:
                return OSError(code, os.strerror(code))
    space = free_bytes(where)
    if space is not None and is_nearly_full(*space):
        free, total = space
        short = next((t.splitlines()[0] for t in texts if any(s in t for s in _SHORT_WRITE_TEXT)), None)
        how = f"the writer failed ({short.strip()[:80]})" if short else f"{type(err).__name__}"
        return OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({how} with {free} of {total} bytes free)")
    return None


@dataclass
class PendingSave:
    """A save whose tensors are still being written (`checkpoint.async_save`). `done()` says
    whether this rank's write finished; `commit()` (every rank, together) waits for it, writes the
    manifest and commits the checkpoint: before that, `step_N` does not exist."""

    final: Path
    finish: Callable[[], Path]
    future: object

    def done(self) -> bool:
        return self.future.done()

    def commit(self) -> Path:
        return self.finish()


def save_checkpoint(
    directory: str | os.PathLike,
    state: TrainerState,
    tensors: dict[str, sharded.GlobalPieces],
    data_state: dict,
    rng: dict,
    keep_last: int,
    *,
    config_json: dict | None = None,
    optimizer: dict | None = None,
    rank: int = 0,
    world_size: int = 1,
    barrier: Callable[[], None] | None = None,
    process_group=None,
    async_save: bool = False,
    _retrying: list[str] | None = None,
) -> Path | PendingSave:
    """Write a checkpoint atomically (see the module docstring) and prune to `keep_last`.

    Every rank calls this with the pieces of the global tensors it holds (`tensors`, see
    checkpoint/sharded_state.py: `model_pieces` + `optimizer_pieces`) and its RNG state; rank 0 also
    writes the shared small files (`config_json`, `optimizer`, `data_state`, the trainer state).
    `barrier` synchronizes the ranks, `process_group` is the group DCP plans over. With
    `async_save` the tensors are written in the background: the returned PendingSave commits
    the checkpoint when every rank calls its `commit()`."""
    directory = Path(directory)
    barrier = barrier or (lambda: None)
    final = directory / f"{PREFIX}{state.global_step:08d}"
    tmp = directory / f"{TMP_PREFIX}{final.name}"
    # DSA_FAULT's wrapper (a no-op without it); its `enospc` models a disk that is full until a
    # checkpoint is pruned
    write_faults = checkpoint_faults(state.global_step, disk_freed=bool(_retrying))

    def failed(err: BaseException):
        # classified by errno and by free space, whatever type the writer raised (torch's zip writer
        # inside DCP turns a full disk into `RuntimeError: ... unexpected pos`), before the
        # temporary folder is removed (it holds what filled the disk)
        io = _io_error(err) or write_failure(err, tmp if tmp.exists() else directory)
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if io is None:
            raise err
        if _is_out_of_space(io) and world_size == 1 and not _retrying:
            pruned = make_room(directory, keep_last, final)
            if pruned:
                log.warning("saving %s failed (%s): pruned %s to make room (checkpoint.keep_last=%d), trying again",
                            final, io.strerror or io, ", ".join(p.name for p in pruned), keep_last)
                return save_checkpoint(directory, state, tensors, data_state, rng, keep_last, config_json=config_json,
                                       optimizer=optimizer, rank=rank, world_size=world_size, barrier=barrier,
                                       process_group=process_group, async_save=False,
                                       _retrying=[p.name for p in pruned])
        raise save_error(directory, final, io, _retrying) from err

    entries: dict[str, dict] = {}
    try:
        if rank == 0:
            directory.mkdir(parents=True, exist_ok=True)
            _remove_stale(directory)
            tmp.mkdir()
        barrier()
        if rank == 0:
            if config_json is not None:
                entries[CONFIG_FILE] = _write_json_file(tmp / CONFIG_FILE, config_json, write_faults)
            if optimizer is not None:
                entries[OPTIMIZER_FILE] = _write_json_file(tmp / OPTIMIZER_FILE, optimizer, write_faults)
            entries[DATA_FILE] = _write_file(tmp / DATA_FILE, lambda w: torch.save(data_state, w), write_faults)
        name = rank_file("rng", rank)
        entries[name] = _write_file(tmp / name, lambda w: torch.save(rng, w), write_faults)
        if rank == 0:
            entries[STATE_FILE] = _write_json_file(tmp / STATE_FILE, asdict(state), write_faults)
        writer, future = sharded.save_pieces(tmp / STATE_DIR, tensors, process_group, on_write=write_faults.on_write,
                                             async_save=async_save)
    except WRITE_ERRORS as err:
        return failed(err)
    except BaseException:  # Ctrl-C, a signal outside the training loop: no temporary folder left behind
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise

    def finish() -> Path:
        try:
            if future is not None:
                future.result()
            for rel, regions in writer.regions.items():
                entries[f"{STATE_DIR}/{rel}"] = {"size": (tmp / STATE_DIR / rel).stat().st_size, "regions": regions}
            if rank == 0:
                meta = tmp / DCP_METADATA
                entries[DCP_METADATA] = {"size": meta.stat().st_size, "sha256": _sha256(meta)}
            _commit(directory, tmp, final, state, entries, keep_last, rank, world_size, barrier, write_faults)
        except WRITE_ERRORS as err:
            return failed(err)
        except BaseException:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    if future is not None:
        return PendingSave(final, finish, future)
    return finish()


def _commit(directory: Path, tmp: Path, final: Path, state: TrainerState, entries: dict, keep_last: int, rank: int,
            world_size: int, barrier: Callable[[], None], write_faults: CheckpointFaults = NO_FAULTS) -> None:
    """Merge the ranks' manifest parts, write the manifest, rename the directory into place,
    point `latest` at it and prune (`write_faults.on_commit` between the rename and `latest`)."""
    if world_size > 1:
        _write_json_file(tmp / f".manifest.rank{rank:05d}.json", entries)
    barrier()
    if rank == 0:
        for r in range(1, world_size):
            part = tmp / f".manifest.rank{r:05d}.json"
            entries.update(json.loads(part.read_text()))
            part.unlink()
        manifest = {"version": MANIFEST_VERSION, "global_step": state.global_step,
                    "world_size": world_size, "files": dict(sorted(entries.items()))}
        _write_json_file(tmp / MANIFEST, manifest)
        _fsync_dir(tmp / STATE_DIR)
        _fsync_dir(tmp)
        old = None
        if final.exists():  # the same step saved again (e.g. after a resume): replace it
            old = directory / f"{OLD_PREFIX}{final.name}"
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(directory)
        write_faults.on_commit()
        _write_latest(directory, final.name)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        prune_checkpoints(directory, keep_last, newest=final)
    barrier()


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


def is_old_format(path: Path) -> bool:
    """A checkpoint of the earlier per-rank format (`model.pt` per rank, no `state/`)."""
    return not (path / STATE_DIR).is_dir() and (path / "model.pt").is_file()


def old_format_error(path: Path) -> OldFormatCheckpoint:
    return OldFormatCheckpoint(
        f"checkpoint {path} is in the per-rank format of an earlier dsa_train (model.pt per rank); this version "
        "resumes only sharded checkpoints (state/)",
        fix=f"export its model with `dsa-train export {path} OUT` and start a new run_dir from it "
            "(model.pretrained=OUT), or resume it with the dsa_train version that wrote it")


def verify_checkpoint(path: str | os.PathLike, checksums: bool = True, files: list[str] | None = None,
                      old_format_ok: bool = False) -> None:
    """CorruptCheckpoint unless every file in the manifest (or those of `files` it lists) exists
    with its recorded size and, with `checksums`, the small ones their sha256. The tensor files'
    byte ranges are checked when a rank reads them (`Checkpoint.load`). `old_format_ok`: verify an
    earlier version's per-rank checkpoint too (the export reads it), else OldFormatCheckpoint."""
    path = Path(path)
    if is_old_format(path) and not old_format_ok:
        raise old_format_error(path)
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
        if checksums and "sha256" in entry and _sha256(f) != entry["sha256"]:
            raise CorruptCheckpoint(f"checkpoint {path}: {name} does not match its sha256 in {MANIFEST} (corrupt)")


def files_for_rank(path: Path, rank: int) -> list[str]:
    """The files rank `rank` reads itself (the tensor files only by byte range, checked then) and
    every tensor file (its size)."""
    own_rng = rank_file("rng", rank) if (path / rank_file("rng", rank)).is_file() else rank_file("rng", 0)
    tensor_files = [f"{STATE_DIR}/{p.name}" for p in sharded.dcp_files(path / STATE_DIR)]
    return [STATE_FILE, CONFIG_FILE, OPTIMIZER_FILE, DATA_FILE, own_rng, DCP_METADATA, *tensor_files]


def load_checkpoint(path: str | os.PathLike, *, rank: int = 0, verify: bool = True, checksums: bool = True) -> Checkpoint:
    """Open checkpoint `path` for `rank` (any layout): its small files read and verified, the
    tensors read later into the pieces of the layout now (`Checkpoint.load`), each byte range
    checked as it is read."""
    path = Path(path)
    if is_old_format(path):
        raise old_format_error(path)
    if not (path / STATE_DIR / ".metadata").is_file():
        raise CorruptCheckpoint(f"checkpoint {path} has no {DCP_METADATA} (incomplete)")
    manifest = None
    if verify:
        verify_checkpoint(path, checksums, files=files_for_rank(path, rank))
        manifest = read_manifest(path)
    regions = None
    if checksums and manifest is not None:
        regions = {name[len(STATE_DIR) + 1:]: entry.get("regions", {}) for name, entry in manifest["files"].items()
                   if name.startswith(STATE_DIR + "/") and name != DCP_METADATA}

    def _load(name: str):
        try:
            return torch.load(path / name, map_location="cpu", weights_only=False)
        except Exception as e:  # truncated zip, bad pickle, ...
            raise CorruptCheckpoint(f"checkpoint {path}: cannot read {name} ({type(e).__name__}: {e})") from e

    def _json(name: str):
        try:
            return json.loads((path / name).read_text())
        except (OSError, ValueError) as e:
            raise CorruptCheckpoint(f"checkpoint {path}: cannot read {name} ({e})") from e

    try:
        state = TrainerState(**_json(STATE_FILE))
    except TypeError as e:
        raise CorruptCheckpoint(f"checkpoint {path}: cannot read {STATE_FILE} ({e})") from e
    if not (path / DATA_FILE).is_file():
        raise CorruptCheckpoint(f"checkpoint {path} has no {DATA_FILE}")
    rng_name = rank_file("rng", rank) if (path / rank_file("rng", rank)).is_file() else rank_file("rng", 0)
    if not (path / rng_name).is_file():
        raise CorruptCheckpoint(f"checkpoint {path} has no {rng_name}")
    return Checkpoint(
        path=path,
        state=state,
        optimizer=_json(OPTIMIZER_FILE) if (path / OPTIMIZER_FILE).is_file() else None,
        data=_load(DATA_FILE),
        rng=_load(rng_name),
        regions=regions,
    )


def find_resume_checkpoint(
    directory: str | os.PathLike, checksums: bool = True, rank: int = 0
) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint that verifies (the files `rank` reads; tensor files by size), and
    the newer ones rejected with their reasons. A checkpoint of the old per-rank format stops the
    search with OldFormatCheckpoint (it is intact, only unreadable here)."""
    rejected: list[tuple[Path, str]] = []
    for path in reversed(list_checkpoints(directory)):
        try:
            files = files_for_rank(path, rank) if (path / STATE_DIR).is_dir() else None
            verify_checkpoint(path, checksums, files=files)
            if not (path / STATE_DIR / ".metadata").is_file() and read_manifest(path) is not None:
                raise CorruptCheckpoint(f"checkpoint {path} has no {DCP_METADATA} (incomplete)")
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


def read_tensors(path: str | os.PathLike, prefix: str = sharded.MODEL, checksums: bool = True) -> dict[str, torch.Tensor]:
    """Offline, in one process: every full global tensor of checkpoint `path` whose key starts
    with `prefix` (default the model's; "" for all), keyed without the prefix. For small models,
    tests and tools; `dsa-train export` streams tensor by tensor instead."""
    path = Path(path)
    manifest = read_manifest(path) if checksums else None
    regions = None
    if manifest is not None:
        regions = {name[len(STATE_DIR) + 1:]: entry.get("regions", {}) for name, entry in manifest["files"].items()
                   if name.startswith(STATE_DIR + "/") and name != DCP_METADATA}
    md = sharded.read_metadata(path / STATE_DIR).state_dict_metadata
    names = [k[len(prefix):] for k, v in md.items() if k.startswith(prefix) and hasattr(v, "size")]
    return dict(sharded.read_full_tensors(path / STATE_DIR, names, prefix, regions,
                                          lambda m: CorruptCheckpoint(f"checkpoint {path}: {m}")))
