"""The trainer's checkpoints: find, agree across ranks, verify, load, save, commit, quarantine, export.

`CheckpointManager` works over the savable state of a run:

    model pieces       this rank's pieces of the global model tensors  (layout.model_pieces)
    optimizer pieces   this rank's fp32 masters / AdamW moments         (layout.optimizer_pieces)
                       and the optimizer's step / schedule             (sharded_state.optimizer_meta)
    data               the data loader's position                       (loader.state_dict)
    rng                this rank's Python / NumPy / torch RNG states     (trainer/rng.py)
    trainer            the TrainerState: stage, steps, tokens, probes, the recipe

written by `checkpoint/training.py` (atomic directories, manifests, DCP tensor files) so that a
checkpoint resumes under any layout. The layout (`dsa_train.parallel.layout`) answers everything
that depends on the number of ranks; with one process its collectives are no-ops.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch

import dsa_train.checkpoint.training as ckpt
import dsa_train.trainer.recipe_change as recipe_change
import dsa_train.checkpoint.sharded_state as sharded_state
from dsa_train.checkpoint.errors import CheckpointError
from dsa_train.checkpoint.export import ExportOptions
from dsa_train.checkpoint.streamed_export import export_training_checkpoint
from dsa_train.config import CheckpointConfig, ConfigError
from dsa_train.training_engine import TrainingEngine
from dsa_train.trainer.rng import rng_state

log = logging.getLogger(__name__)


class CheckpointManager:
    """The checkpoints of one run directory, for one process or N ranks (`layout`). `recipe()` is
    the resolved recipe as a dict, stored with every checkpoint and compared on resume."""

    def __init__(self, cfg: CheckpointConfig, layout, model: torch.nn.Module, loader, recipe: Callable[[], dict],
                 device: torch.device):
        self.cfg = cfg
        self.directory = cfg.dir
        self.layout = layout
        self.model = model
        self.loader = loader
        self.recipe = recipe
        self.device = device  # where the ranks' flags are combined
        self.pending_save: ckpt.PendingSave | None = None  # checkpoint.async_save: written, not committed
        self.resumed: ckpt.Checkpoint | None = None  # its optimizer state is loaded with the stage's engine
        self.last_saved_step: int | None = None

    # ------------------------------------------------------------------ resume
    def refuse_existing(self) -> None:
        """checkpoint.resume=false: a fresh run must not prune the checkpoints already there."""
        existing = ckpt.list_checkpoints(self.directory)
        if existing:
            raise ConfigError(
                f"checkpoint.resume=false but {self.directory} already holds checkpoints "
                f"(newest {existing[-1].name}); a fresh run would prune them. Resume (checkpoint.resume=auto), "
                "or start fresh under a new run_dir / checkpoint.dir"
            )

    def resume(self) -> ckpt.Checkpoint | None:
        """The newest checkpoint every rank can read (None: none, a fresh start), with the
        recipe changes since it checked, the model's pieces and the data position restored; its
        optimizer state waits for the stage's engine (`load_optimizer_state`). Rejected
        checkpoints are moved aside (quarantined)."""
        directory, checksums, rank = self.directory, self.cfg.verify_checksums, self.layout.rank
        if rank == 0:  # temporary folders of a save that was killed: removed at the next start
            for stale in ckpt.remove_stale(directory):
                log.warning("resume: removed %s, left by an interrupted save", stale)
        self.layout.barrier()
        while True:
            path, rejected = ckpt.find_resume_checkpoint(directory, checksums, rank=rank)
            path, rejected = self.agree(path, rejected)
            for bad, reason in rejected:
                log.warning("resume: rejecting %s: %s", bad, reason)
            if path is not None:
                loaded, problem = None, None
                try:  # this rank's small files (verified): local, so the ranks agree on the outcome below
                    loaded = ckpt.load_checkpoint(path, rank=rank, checksums=checksums)
                except ckpt.CorruptCheckpoint as err:
                    problem = str(err)
                problem = self.first_problem(problem)
                try:
                    if problem is not None:
                        raise ckpt.CorruptCheckpoint(problem)
                    self.check_same_model(path, loaded)
                    # this rank's pieces of the model, whatever layout wrote them (collective; a
                    # failure on any rank fails it on every rank)
                    loaded.load(self.layout.model_pieces(self.model), self.layout.checkpoint_group)
                except ckpt.CorruptCheckpoint as err:  # verified, yet unreadable
                    rejected.append((path, str(err)))
                    log.warning("resume: rejecting %s: %s", path, err)
                    loaded = None
            if rejected:
                self.quarantine([bad for bad, _ in rejected])
            if path is None:
                if rejected:
                    log.warning("resume: no valid checkpoint left in %s, starting fresh", directory)
                else:
                    log.info("resume: no checkpoint in %s, starting fresh", directory)
                return None
            if loaded is not None:
                break
        if rejected:
            log.warning("resume: falling back to %s, the newest checkpoint that verifies", path)
        self.check_recipe(path, loaded.state)
        self.loader.load_state_dict(loaded.data)
        self.resumed = loaded
        return loaded

    def check_recipe(self, path: Path, state: ckpt.TrainerState) -> None:
        """Apply the safe recipe changes since the checkpoint (logged), refuse the rest
        (trainer/recipe_change.py)."""
        if state.recipe is None:
            log.warning("resume: %s was written before checkpoints recorded their recipe: recipe changes not checked", path)
        else:
            for change in recipe_change.compare(state.recipe, self.recipe(), state.stage_index, state.stage_step, path):
                log.warning("resume: %s", change)

    def quarantine(self, paths: list[Path]) -> None:
        """Rename rejected checkpoints aside (rank 0, between barriers)."""
        self.layout.barrier()
        if self.layout.rank == 0:
            for bad in paths:
                if bad.exists():
                    log.warning("resume: moved the rejected checkpoint to %s", ckpt.quarantine(bad))
        self.layout.barrier()

    def agree(self, path: Path | None, rejected: list[tuple[Path, str]]) -> tuple[Path | None, list[tuple[Path, str]]]:
        """Every rank resumes from the same checkpoint: the oldest of the ranks' choices (a rank
        checks the files it reads itself, e.g. its own RNG file), and every rank rejects what any
        rank rejected. One process: unchanged."""
        if not self.layout.distributed:
            return path, rejected
        mine = (ckpt.step_of(path) if path is not None else -1, [(str(p), r) for p, r in rejected])
        every = self.layout.all_gather_object(mine)
        agreed = min(step for step, _ in every)
        bad: dict[str, str] = {}
        for step, theirs in every:
            for p, reason in theirs:
                bad.setdefault(p, reason)
        newer = sorted(({Path(p) for p in bad} | ({path} if path is not None and ckpt.step_of(path) > agreed else set())),
                       key=ckpt.step_of, reverse=True)
        chosen = Path(self.directory) / f"{ckpt.PREFIX}{agreed:08d}" if agreed >= 0 else None
        return chosen, [(p, bad.get(str(p), "rejected on another rank")) for p in newer if p != chosen]

    def first_problem(self, problem: str | None) -> str | None:
        """The first rank's problem, on every rank (None: none had one)."""
        if not self.layout.distributed:
            return problem
        return next((p for p in self.layout.all_gather_object(problem) if p is not None), None)

    def check_same_model(self, path: Path, loaded: ckpt.Checkpoint) -> None:
        """ConfigError when the checkpoint was written for another model than this recipe's
        (names and global shapes of the saved model tensors against this model's)."""
        saved_cfg = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
        ours = self.model.config.to_hf_dict()
        differ = sorted(k for k in set(saved_cfg) | set(ours) if saved_cfg.get(k) != ours.get(k)) if saved_cfg else []
        own = {k[len(sharded_state.MODEL):]: tuple(v.shape) for k, v in self.layout.model_pieces(self.model).items()}
        if self.layout.distributed:  # expert parallel: each rank holds only its experts
            for part in self.layout.all_gather_object(own):
                own.update(part)
        saved = loaded.model_shapes()
        mismatch = sorted(set(own) ^ set(saved)) + sorted(k for k in set(own) & set(saved) if own[k] != saved[k])
        if mismatch:
            details = ", ".join(f"{k}: {saved_cfg.get(k)!r} (checkpoint) vs {ours.get(k)!r}" for k in differ[:6])
            raise ConfigError(
                f"checkpoint.dir: {path} was written for another model ({details or f'{len(mismatch)} tensors differ, e.g. {mismatch[0]}'}); "
                "resume with the recipe that wrote it, or start this one under a new run_dir / checkpoint.dir"
            )
        if differ:
            log.warning("resume: %s has a different model config in %s (same tensors)", path, ", ".join(differ))

    def load_optimizer_state(self, engine: TrainingEngine) -> None:
        """The resumed checkpoint's optimizer state (fp32 masters, AdamW moments, step, schedule)
        into this stage's engine, each rank reading its own ZeRO fragments whatever layout wrote
        them; nothing when the run did not resume or the checkpoint is from a stage boundary. The
        masters come from the checkpoint, never from the model's bf16 weights: rebuilding them from
        bf16 would drop every update below bf16 resolution (at the sparse stage's lr 7.3e-6 most of
        them) at each resume."""
        loaded, self.resumed = self.resumed, None
        if loaded is None or loaded.optimizer is None:
            return
        saved = loaded.saved_keys()
        # state made only where the checkpoint has some: none for parameters that never had a gradient
        pieces = {k: v for k, v in self.layout.optimizer_pieces(engine, create=saved).items() if k in saved}
        try:
            loaded.load(pieces, self.layout.checkpoint_group)
        except ckpt.CorruptCheckpoint as err:
            self.layout.barrier()
            if self.layout.rank == 0 and loaded.path.exists():
                log.warning("resume: moved the rejected checkpoint to %s", ckpt.quarantine(loaded.path))
            raise ckpt.CorruptCheckpoint(f"{err.problem}; the checkpoint was moved aside",
                                         fix="run the same command again: it resumes from the checkpoint before it") from err
        sharded_state.load_optimizer_meta(engine, loaded.optimizer)

    # ------------------------------------------------------------------ save
    def save(self, state: ckpt.TrainerState, engine: TrainingEngine | None = None, data_state: dict | None = None, rng: dict | None = None) -> None:
        """Checkpoint `state` with the model, `engine`'s optimizer state (None: at a stage
        boundary, no optimizer state), the data position and the RNG states (now, unless given:
        the non-finite policy saves those from before the step)."""
        self.commit_pending_save()
        with self.layout.gathered(self.model):
            self._write(state, engine, data_state, rng)

    def _write(self, state: ckpt.TrainerState, engine: TrainingEngine | None, data_state: dict | None, rng: dict | None) -> None:
        state.recipe = self.recipe()
        tensors = self.layout.model_pieces(self.model, to_write=True)  # one holder per replicated piece
        if engine is not None:
            tensors.update(self.layout.optimizer_pieces(engine, to_write=True))
        layout = self.layout
        saved = ckpt.save_checkpoint(
            self.directory,
            dataclasses.replace(state),
            tensors,
            self.loader.state_dict() if data_state is None else data_state,
            rng_state() if rng is None else rng,
            self.cfg.keep_last,
            config_json=self.model.config.to_hf_dict() if layout.rank == 0 else None,
            optimizer=sharded_state.optimizer_meta(engine) if engine is not None else None,
            rank=layout.rank,
            world_size=layout.world_size,
            barrier=layout.barrier,
            process_group=layout.checkpoint_group,
            async_save=self.cfg.async_save,
        )
        self.last_saved_step = state.global_step
        if isinstance(saved, ckpt.PendingSave):
            self.pending_save = saved
            log.info("checkpoint %s: writing in the background", saved.final)
        else:
            log.info("checkpoint %s", saved)

    def commit_pending_save(self, when_done: bool = False) -> None:
        """Commit the checkpoint being written in the background (checkpoint.async_save): now
        (waiting for the write), or with `when_done` only if every rank's write has finished."""
        if self.pending_save is None:
            return
        if when_done and self.layout.any_rank(not self.pending_save.done(), self.device):
            return
        pending, self.pending_save = self.pending_save, None
        path = pending.commit()
        log.info("checkpoint %s (committed after its background write)", path)

    # ------------------------------------------------------------------ export
    def export(self, path: Path, tokenizer_dir: str) -> None:
        """The model in the V3.2 Hugging Face layout, streamed from the checkpoint just committed
        (`checkpoint.streamed_export`, as `dsa-train export`): every rank writes its share of the
        shards, one tensor at a time; nothing is gathered. Every tensor keeps its dtype."""
        if self.last_saved_step is None:
            raise CheckpointError("the run has no checkpoint of its end to export",
                                  fix=f"run `dsa-train export {self.directory} {path}`")
        self.commit_pending_save()
        step_dir = Path(self.directory) / f"{ckpt.PREFIX}{self.last_saved_step:08d}"
        export_training_checkpoint(
            step_dir, path, ExportOptions(dtype=None), tokenizer_dir, model_config=self.model.config,
            torch_dtype=next(self.model.parameters()).dtype, checksums=self.cfg.verify_checksums,
            rank=self.layout.rank, world_size=self.layout.world_size, agree=self.first_problem,
            written_by="dsa-train (the end-of-run export of a training run)")
        log.info("exported %s (from %s)", path, step_dir)
