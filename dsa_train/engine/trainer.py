"""The single-process trainer: runs a recipe's stages in order.

Per stage: set the trainable parameters, build a fresh AdamW + schedule (`Engine`), probe, then
`steps` optimizer steps of `global_batch_size` sequences (gradient accumulation over micro-
batches), probe again and checkpoint. The data loader is shared by all stages, so the data
position carries on from one stage to the next. At the end: export the model in the V3.2
Hugging Face layout and print the summary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import OmegaConf

from dsa_train.config import Attention, ConfigError, Device, StageConfig, TrainConfig, validate
from dsa_train.checkpoint.export import trained_index_topk
from dsa_train.config.validate import doubtful_values
from dsa_train.engine import checkpoint as ckpt
from dsa_train.engine import sharded_state
from dsa_train.engine import faults, recipe_change
from dsa_train.engine.engine import Engine
from dsa_train.engine.nonfinite import NonFiniteError, check_step, poison, poison_gradient
from dsa_train.engine.probe import measure, probe_batches
from dsa_train.engine.run_lock import lock_run
from dsa_train.engine.rng import load_rng_state, rng_state, seed_everything, set_deterministic
from dsa_train.engine.signals import EXIT_PREEMPTED, PreemptionHandler, Preempted, mark_preempted
from dsa_train.engine.step import forward_backward
from dsa_train.engine.summary import format_summary, summary_metrics
from dsa_train.logging.perf import memory_metrics, peak_flops_per_device, throughput_metrics
from dsa_train.logging.progress import StageProgress, describe_step
from dsa_train.logging.wandb_run import METRICS_FILE, WandbRun

log = logging.getLogger(__name__)


class TopkCoversSequence(UserWarning):
    """A sparse stage whose top-k is not below the sequence length: sparse equals dense."""


@dataclass
class TrainResult:
    run_dir: Path
    history: list[dict[str, float]] = field(default_factory=list)  # metrics of every step
    summary: dict = field(default_factory=dict)  # {stage: {"start": probe, "end": probe}}
    export_dir: Path | None = None
    wandb_run_id: str | None = None
    preempted: bool = False


def resolve_device(device: Device) -> torch.device:
    if device == Device.auto:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == Device.cuda and not torch.cuda.is_available():
        raise ConfigError("device: cuda requested but no CUDA device is available")
    return torch.device(device.value)


def check_single_process(cfg: TrainConfig) -> None:
    p = cfg.parallel
    sizes = {
        "parallel.tensor_parallel": p.tensor_parallel,
        "parallel.context_parallel": p.context_parallel,
        "parallel.expert_parallel": p.expert_parallel,
        "parallel.data_parallel": max(p.data_parallel, 1),
    }
    for key, size in sizes.items():
        if size != 1:
            raise ConfigError(f"{key}={size}: the single-process trainer runs one rank; set it to 1")


def build_model(cfg: TrainConfig, vocab_size: int, parallel_state=None) -> torch.nn.Module:
    """The model of the recipe. With a parallel layout and a pretrained checkpoint, this rank's
    part only, already parallelized (meta-device start-up: dsa_train.parallel.startup)."""
    import dsa_train
    from dsa_train.data import check_vocab
    from dsa_train.model import DSAForCausalLM, tiny_config

    dtype = getattr(torch, cfg.model.dtype.value)
    if cfg.model.pretrained is not None and parallel_state is not None and parallel_state.sizes.world > 1:
        from dsa_train.parallel.startup import load_parallel_pretrained

        model = load_parallel_pretrained(cfg.model.pretrained, parallel_state, dtype, recompute=cfg.parallel.recompute,
                                         grouped_experts=cfg.parallel.grouped_experts)
    elif cfg.model.pretrained is not None:
        model = dsa_train.from_pretrained(cfg.model.pretrained, dtype=dtype)
    else:
        arch = {"vocab_size": vocab_size, **cfg.model.arch}
        model = DSAForCausalLM(tiny_config(**arch)).to(dtype)
    check_vocab(vocab_size, model.config.vocab_size)
    return model


class Trainer:
    """One trainer for one process (`dsa-train`) and for N ranks (`distributed=True`: torchrun /
    Slurm, `dsa_train.parallel.train`). With N ranks: megatron-core process groups
    (`init_parallel`), the model built whole on every rank (same seed, or loaded) then
    parallelized (`dsa_train.parallel.model.parallelize_model`), data sharded by data-parallel
    rank, the DeepSpeed engine per stage, the step's numbers combined over ranks by
    `dsa_train.parallel.step.parallel_reduction`. Rank 0 logs (W&B, progress) and writes the
    shared files; in checkpoints every rank writes its pieces of the global tensors (model
    slices, ZeRO optimizer fragments; a replica once), so they resume under any layout
    (engine/sharded_state.py); the export at the end gathers the full model to rank 0."""

    def __init__(self, cfg: TrainConfig, distributed: bool = False):
        from dsa_train.data import DataConfig, build_dataloader

        validate(cfg)
        for doubt in doubtful_values(cfg):  # allowed, but rarely meant: said at start-up, not silent
            log.warning("%s", doubt)
        self.parallel = None  # ParallelState with N ranks
        self.reduction = None  # how a step's numbers combine over ranks (None: one process)
        self.rank, self.world_size, self.dp_rank, self.dp_size = 0, 1, 0, 1
        self.barrier = None  # syncs the ranks around checkpoint commits
        self.checkpoint_group = None  # the gloo group DCP plans checkpoints over (N ranks)
        self.pending_save: ckpt.PendingSave | None = None  # checkpoint.async_save: written, not committed
        self.resume_checkpoint: ckpt.Checkpoint | None = None  # its optimizer state is loaded by run_stage
        if distributed:
            cfg = self._init_ranks(cfg)
        else:
            check_single_process(cfg)
        self.cfg = cfg
        self.stage_names = list(cfg.stages)
        self.device = resolve_device(cfg.device)
        self.run_dir = Path(cfg.run_dir)
        set_deterministic(cfg.deterministic)
        seed_everything(cfg.seed)

        self.loader = build_dataloader(DataConfig(**dataclasses.asdict(cfg.data)), dp_rank=self.dp_rank, dp_size=self.dp_size)
        self.model = build_model(cfg, self.loader.tokenizer.vocab_size, self.parallel).to(self.device)
        if self.parallel is not None:
            if getattr(self.model, "dsa_parallel_state", None) is None:  # else built parallel (meta-device start-up)
                from dsa_train.parallel.model import parallelize_model

                self.model = parallelize_model(self.model, self.parallel, recompute=cfg.parallel.recompute,
                                               grouped_experts=cfg.parallel.grouped_experts)
            # every rank's layout, logged once by rank 0 (other ranks log warnings only)
            import torch.distributed as dist

            layouts = [None] * self.world_size
            dist.all_gather_object(layouts, self.parallel.describe())
            if self.rank == 0:
                for layout in layouts:
                    log.info("%s", layout)
        self.model.train()
        max_pos = self.model.config.max_position_embeddings
        if cfg.data.seq_len > max_pos:
            raise ConfigError(
                f"data.seq_len: {cfg.data.seq_len}-token sequences are longer than the model's "
                f"max_position_embeddings={max_pos}; lower data.seq_len or use a model with longer context (YaRN)"
            )
        for name, stage in cfg.stages.items():
            topk = stage.topk or self.model.config.index_topk
            if stage.attention == Attention.sparse and cfg.data.seq_len <= topk:
                # not an error: the run is correct, only no faster than dense (every key is selected)
                message = (
                    f"stages.{name}.topk: top-{topk} selection on {cfg.data.seq_len}-token sequences "
                    "selects every key, so sparse attention equals dense attention here; raise "
                    f"data.seq_len above {topk} or lower stages.{name}.topk for sparse training"
                )
                warnings.warn(message, TopkCoversSequence, stacklevel=2)
                log.warning(message)
        self.probes = probe_batches(cfg.data, cfg.probe_batches)
        self.peak_flops = peak_flops_per_device(self.device, cfg.logging.peak_flops)
        self.state = ckpt.TrainerState()
        self.engine_state: dict | None = None  # optimizer + schedule to restore on resume
        self.resume_rng: dict | None = None
        self.result = TrainResult(run_dir=self.run_dir)
        self.last_saved_step: int | None = None
        self.finished: str | None = None  # set by a resume of a run whose stages are all done
        self.preemption: PreemptionHandler | None = None
        # one run per run_dir (rank 0 holds the lock for all ranks; released when the run ends)
        self.run_locks = lock_run(self.run_dir, cfg.checkpoint.dir) if self.rank == 0 else []
        try:
            if cfg.checkpoint.resume is False:
                existing = ckpt.list_checkpoints(cfg.checkpoint.dir)
                if existing:
                    raise ConfigError(
                        f"checkpoint.resume=false but {cfg.checkpoint.dir} already holds checkpoints "
                        f"(newest {existing[-1].name}); a fresh run would prune them. Resume (checkpoint.resume=auto), "
                        "or start fresh under a new run_dir / checkpoint.dir"
                    )
            else:
                self._resume()
        except BaseException:
            self.release_run_lock()
            raise
        self.wandb = WandbRun(cfg.logging, self.config_dict(), run_id=self.state.wandb_run_id,
                              metrics_path=self.metrics_path())
        self.state.wandb_run_id = self.wandb.id
        self.result.wandb_run_id = self.wandb.id

    def _init_ranks(self, cfg: TrainConfig) -> TrainConfig:
        import copy

        import torch.distributed as dist

        from dsa_train.config import WandbMode
        from dsa_train.parallel.groups import init_parallel
        from dsa_train.parallel.step import parallel_reduction

        state = init_parallel(cfg.parallel)
        self.parallel, self.reduction = state, parallel_reduction(state)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.dp_rank, self.dp_size = state.dp_rank, state.sizes.data
        self.barrier = dist.barrier
        # DCP's planning collectives run on their own gloo group: CPU objects on any backend, and
        # an async save's background thread never shares a group with the training collectives
        self.checkpoint_group = dist.new_group(backend="gloo")
        for name, stage in cfg.stages.items():
            per_step = cfg.data.micro_batch_size * state.sizes.data
            if stage.global_batch_size % per_step:
                raise ConfigError(
                    f"stages.{name}.global_batch_size={stage.global_batch_size} is not a multiple of "
                    f"data.micro_batch_size * data-parallel size = {cfg.data.micro_batch_size} * {state.sizes.data}"
                )
        if cfg.device.value == "cuda" or (cfg.device.value == "auto" and torch.cuda.is_available()):
            torch.cuda.set_device(torch.cuda.current_device())
        if self.rank != 0:
            cfg = copy.deepcopy(cfg)
            cfg.logging.wandb_mode = WandbMode.disabled
            cfg.logging.progress_bar = False
        return cfg

    def metrics_path(self) -> Path | None:
        """`<run_dir>/metrics.jsonl`, written by rank 0 (`dsa-train report` reads it)."""
        return self.run_dir / METRICS_FILE if self.rank == 0 else None

    def release_run_lock(self) -> None:
        for lock in getattr(self, "run_locks", []):
            lock.release()

    def tokenizer_dir(self) -> str:
        from dsa_train.data import BUNDLED_TOKENIZER_DIR

        return self.cfg.data.tokenizer or str(BUNDLED_TOKENIZER_DIR)

    def config_dict(self) -> dict:
        return OmegaConf.to_container(OmegaConf.structured(self.cfg), resolve=True, enum_to_str=True)

    # ------------------------------------------------------------------ checkpoints
    def _resume(self) -> None:
        directory = self.cfg.checkpoint.dir
        checksums = self.cfg.checkpoint.verify_checksums
        while True:
            path, rejected = ckpt.find_resume_checkpoint(directory, checksums, rank=self.rank)
            path, rejected = self._agree_on_checkpoint(directory, path, rejected)
            for bad, reason in rejected:
                log.warning("resume: rejecting %s: %s", bad, reason)
            if path is not None:
                loaded, problem = None, None
                try:  # this rank's small files (verified): local, so the ranks agree on the outcome below
                    loaded = ckpt.load_checkpoint(path, rank=self.rank, checksums=checksums)
                except ckpt.CorruptCheckpoint as err:
                    problem = str(err)
                problem = self._first_problem(problem)
                try:
                    if problem is not None:
                        raise ckpt.CorruptCheckpoint(problem)
                    self._check_same_model(path, loaded)
                    # this rank's pieces of the model, whatever layout wrote them (collective; a
                    # failure on any rank fails it on every rank)
                    loaded.load(sharded_state.model_pieces(self.model, self.tp_size()), self.checkpoint_group)
                except ckpt.CorruptCheckpoint as err:  # verified, yet unreadable
                    rejected.append((path, str(err)))
                    log.warning("resume: rejecting %s: %s", path, err)
                    loaded = None
            if rejected and self.barrier is not None:
                self.barrier()
            if rejected and self.rank == 0:
                for bad, _ in rejected:
                    if bad.exists():
                        log.warning("resume: moved the rejected checkpoint to %s", ckpt.quarantine(bad))
            if rejected and self.barrier is not None:
                self.barrier()
            if path is None:
                if rejected:
                    log.warning("resume: no valid checkpoint left in %s, starting fresh", directory)
                else:
                    log.info("resume: no checkpoint in %s, starting fresh", directory)
                return
            if loaded is not None:
                break
        if rejected:
            log.warning("resume: falling back to %s, the newest checkpoint that verifies", path)
        self._check_same_recipe(path, loaded.state)
        self.loader.load_state_dict(loaded.data)
        self.state = loaded.state
        self.engine_state = loaded.optimizer
        self.resume_checkpoint = loaded
        self.resume_rng = loaded.rng
        self.result.summary = self.state.summary
        log.info("resumed from %s (stage %d, step %d)", path, self.state.stage_index, self.state.stage_step)
        wandb = getattr(self, "wandb", None)
        if wandb is not None and wandb.id != self.state.wandb_run_id:  # resumed after W&B started (deferred)
            wandb.finish()
            self.wandb = WandbRun(self.cfg.logging, self.config_dict(), run_id=self.state.wandb_run_id,
                               metrics_path=self.metrics_path())
            self.state.wandb_run_id = self.result.wandb_run_id = self.wandb.id

    def _agree_on_checkpoint(self, directory, path: Path | None, rejected: list[tuple[Path, str]]
                             ) -> tuple[Path | None, list[tuple[Path, str]]]:
        """Every rank resumes from the same checkpoint: the oldest of the ranks' choices (a rank
        checks the files it reads itself, e.g. its own RNG file), and every rank rejects what any
        rank rejected. One process: unchanged."""
        if self.parallel is None:
            return path, rejected
        import torch.distributed as dist

        every = [None] * self.world_size
        mine = (ckpt.step_of(path) if path is not None else -1, [(str(p), r) for p, r in rejected])
        dist.all_gather_object(every, mine, group=self.checkpoint_group)
        agreed = min(step for step, _ in every)
        bad: dict[str, str] = {}
        for step, theirs in every:
            for p, reason in theirs:
                bad.setdefault(p, reason)
        newer = sorted(({Path(p) for p in bad} | ({path} if path is not None and ckpt.step_of(path) > agreed else set())),
                       key=ckpt.step_of, reverse=True)
        chosen = Path(directory) / f"{ckpt.PREFIX}{agreed:08d}" if agreed >= 0 else None
        return chosen, [(p, bad.get(str(p), "rejected on another rank")) for p in newer if p != chosen]

    def _first_problem(self, problem: str | None) -> str | None:
        """The first rank's problem, on every rank (None: none had one)."""
        if self.parallel is None:
            return problem
        import torch.distributed as dist

        every = [None] * self.world_size
        dist.all_gather_object(every, problem, group=self.checkpoint_group)
        return next((p for p in every if p is not None), None)

    def _check_same_recipe(self, path: Path, state: ckpt.TrainerState) -> None:
        """Apply the safe recipe changes since the checkpoint (logged), refuse the rest; a finished
        run says so (engine/recipe_change.py)."""
        if state.recipe is None:
            log.warning("resume: %s was written before checkpoints recorded their recipe: recipe changes not checked", path)
        else:
            for change in recipe_change.compare(state.recipe, self.config_dict(), state.stage_index, state.stage_step, path):
                log.warning("resume: %s", change)
        if state.stage_index >= len(self.stage_names):
            self.finished = recipe_change.finished_message(self.stage_names, state.global_step, path, self.run_dir / "export")

    def tp_size(self) -> int:
        return self.parallel.sizes.tensor if self.parallel is not None else 1

    def _check_same_model(self, path: Path, loaded: ckpt.Checkpoint) -> None:
        """ConfigError when the checkpoint was written for another model than this recipe's
        (names and global shapes of the saved model tensors against this model's)."""
        import json

        saved_cfg = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
        ours = self.model.config.to_hf_dict()
        differ = sorted(k for k in set(saved_cfg) | set(ours) if saved_cfg.get(k) != ours.get(k)) if saved_cfg else []
        own = {k[len(sharded_state.MODEL):]: tuple(v.shape)
               for k, v in sharded_state.model_pieces(self.model, self.tp_size()).items()}
        if self.parallel is not None:  # expert parallel: each rank holds only its experts
            import torch.distributed as dist

            every = [None] * self.world_size
            dist.all_gather_object(every, own, group=self.checkpoint_group)
            for part in every:
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

    def save(self, engine: Engine | None, data_state: dict | None = None, rng: dict | None = None) -> None:
        self.commit_pending_save()
        with self._gathered():
            self._save(engine, data_state, rng)

    def commit_pending_save(self, when_done: bool = False) -> None:
        """Commit the checkpoint being written in the background (checkpoint.async_save): now
        (waiting for the write), or with `when_done` only if every rank's write has finished."""
        if self.pending_save is None:
            return
        if when_done and self.any_rank(not self.pending_save.done()):
            return
        pending, self.pending_save = self.pending_save, None
        path = pending.commit()
        log.info("checkpoint %s (committed after its background write)", path)

    def load_optimizer_state(self, engine) -> None:
        """The saved optimizer state (fp32 masters, AdamW moments, step, schedule) into this
        stage's engine, each rank reading its own ZeRO fragments whatever layout wrote them. The
        masters come from the checkpoint, never from the model's bf16 weights: rebuilding them from
        bf16 would drop every update below bf16 resolution (at the sparse stage's lr 7.3e-6 most of
        them) at each resume."""
        loaded, meta = self.resume_checkpoint, self.engine_state
        saved = loaded.saved_keys()
        pieces = {k: v for k, v in sharded_state.optimizer_pieces(engine, self.tp_size(), create=True).items()
                  if k in saved}
        try:
            loaded.load(pieces, self.checkpoint_group)
        except ckpt.CorruptCheckpoint as err:
            if self.barrier is not None:
                self.barrier()
            if self.rank == 0 and loaded.path.exists():
                log.warning("resume: moved the rejected checkpoint to %s", ckpt.quarantine(loaded.path))
            raise ckpt.CorruptCheckpoint(f"{err.problem}; the checkpoint was moved aside",
                                         fix="run the same command again: it resumes from the checkpoint before it") from err
        sharded_state.load_optimizer_meta(engine, meta)

    def _gathered(self):
        """ZeRO-3: parameters gathered for the duration (checkpoint writing reads them)."""
        if self.parallel is not None and self.cfg.parallel.zero_stage == 3:
            import deepspeed

            return deepspeed.zero.GatheredParameters(list(self.model.parameters()), modifier_rank=None)
        return contextlib.nullcontext()

    def _save(self, engine, data_state, rng) -> None:
        self.state.recipe = self.config_dict()
        tensors = sharded_state.model_pieces(self.model, self.tp_size())
        if engine is not None:
            tensors.update(sharded_state.optimizer_pieces(engine, self.tp_size()))
        saved = ckpt.save_checkpoint(
            self.cfg.checkpoint.dir,
            dataclasses.replace(self.state),
            tensors,
            self.loader.state_dict() if data_state is None else data_state,
            rng_state() if rng is None else rng,
            self.cfg.checkpoint.keep_last,
            config_json=self.model.config.to_hf_dict() if self.rank == 0 else None,
            optimizer=sharded_state.optimizer_meta(engine) if engine is not None else None,
            rank=self.rank,
            world_size=self.world_size,
            barrier=self.barrier,
            process_group=self.checkpoint_group,
            async_save=self.cfg.checkpoint.async_save,
        )
        self.last_saved_step = self.state.global_step
        if isinstance(saved, ckpt.PendingSave):
            self.pending_save = saved
            log.info("checkpoint %s: writing in the background", saved.final)
        else:
            log.info("checkpoint %s", saved)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The single-process state dict, gathered to every rank (TP shards concatenated, EP
        experts collected). For small models and the tests; big models export from checkpoints."""
        import torch.distributed as dist

        st = self.parallel
        if st is None:
            return dict(self.model.state_dict())
        out: dict[str, torch.Tensor] = {}
        experts: dict[str, torch.Tensor] = {}
        with self._gathered():
            for name, p in self.model.state_dict(keep_vars=True).items():
                if p is None:
                    continue
                t = p.detach().clone()
                shard = getattr(p, "dsa_shard", None)
                if getattr(p, "allreduce", True) is False:
                    experts[name] = t
                    continue
                if shard is not None:
                    parts = [torch.empty_like(t) for _ in range(st.sizes.tensor)]
                    dist.all_gather(parts, t.contiguous(), group=st.tp_group)
                    t = torch.cat(parts, dim=shard[0])
                out[name] = t
        if st.sizes.expert > 1:
            gathered = [None] * st.sizes.expert
            dist.all_gather_object(gathered, experts, group=st.ep_group)
            for part in gathered:
                out.update(part)
        else:
            out.update(experts)
        return out

    def clear_router_loads(self) -> None:
        """Zero the MoE loads accumulated since the last router-bias update. They are not part of
        a checkpoint, so they must be zero at every step boundary for an exact resume."""
        for module in self.model.modules():
            if isinstance(getattr(module, "load_since_update", None), torch.Tensor):
                module.load_since_update.zero_()

    def make_engine(self, stage: StageConfig):
        if self.parallel is None:
            return Engine(self.model, stage, self.cfg.optim)
        from dsa_train.parallel.deepspeed_engine import DeepSpeedEngine

        return DeepSpeedEngine(self.model, stage, self.cfg.optim, self.parallel, zero_stage=self.cfg.parallel.zero_stage,
                               micro_batch_size=self.cfg.data.micro_batch_size)

    def any_rank(self, flag: bool) -> bool:
        """True when `flag` is true on any rank."""
        if self.parallel is None:
            return flag
        import torch.distributed as dist

        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def check_preemption(self, engine: Engine | None) -> None:
        """At a step boundary: after a preemption signal, checkpoint and raise Preempted."""
        received = self.preemption is not None and self.preemption.requested
        if not self.any_rank(received):
            return
        if self.last_saved_step != self.state.global_step:
            self.save(engine)
        self.commit_pending_save()
        name = self.preemption.describe() if received else "a preemption signal (on another rank)"
        message = (
            f"{'interrupted' if 'SIGINT' in name else 'preempted'} by {name} at global step "
            f"{self.state.global_step}: checkpoint written to {self.cfg.checkpoint.dir}; run the same command "
            "again to resume"
        )
        log.warning(message)
        self.result.preempted = True
        self.result.summary = self.state.summary
        self.wandb.finish()
        code = self.preemption.exit_code if received else EXIT_PREEMPTED
        if code == EXIT_PREEMPTED:
            mark_preempted(self.run_dir)  # a torchrun restart on this allocation exits at once
        raise Preempted(message, result=self.result, code=code)

    def nonfinite_step(self, engine: Engine, bad: list[str], before: tuple[dict, dict]) -> None:
        """Apply the non-finite policy to the step just computed (its update not applied)."""
        from dsa_train.config.schema import NonFinitePolicy

        policy = self.cfg.fault_tolerance
        engine.zero_grad()
        step = self.state.global_step + 1
        consecutive = self.state.nonfinite_consecutive + 1
        what = ", ".join(bad)
        if policy.nonfinite == NonFinitePolicy.stop or consecutive > policy.max_consecutive_nonfinite:
            self.save(engine, data_state=before[0], rng=before[1])
            self.commit_pending_save()
            reason = ("fault_tolerance.nonfinite=stop" if policy.nonfinite == NonFinitePolicy.stop else
                      f"{consecutive} non-finite steps in a row (fault_tolerance.max_consecutive_nonfinite="
                      f"{policy.max_consecutive_nonfinite})")
            raise NonFiniteError(
                f"non-finite {what} at global step {step}: stopping ({reason}). A checkpoint of the state before "
                f"this step is in {self.cfg.checkpoint.dir} (resuming reproduces the step). Lower the stage's lr, "
                "check the data at this position, or resume with fault_tolerance.nonfinite=skip to skip such steps"
            )
        log.warning("non-finite %s at global step %d: update skipped (%d in a row)", what, step, consecutive)
        self.state.nonfinite_consecutive = consecutive
        self.state.nonfinite_skipped += 1

    # ------------------------------------------------------------------ training
    def next_micro_batches(self, stage: StageConfig) -> list[dict[str, torch.Tensor]]:
        accum = stage.global_batch_size // (self.cfg.data.micro_batch_size * self.dp_size)
        return [{k: v.to(self.device) for k, v in next(self.loader).items()} for _ in range(accum)]

    def probe(self, name: str, stage: StageConfig, when: str) -> None:
        if not self.probes:
            return
        values = measure(self.model, self.probes, stage, self.device, self.reduction)
        self.state.summary.setdefault(name, {})[when] = values
        if self.rank == 0:
            self.wandb.log({f"probe/{name}/{key}": v for key, v in values.items()}, step=self.state.global_step)
            log.info("probe %s %s: %s", name, when, "  ".join(f"{k} {v:.4f}" for k, v in values.items()))

    def run_stage(self, index: int, progress: StageProgress) -> None:
        from dsa_train.model.flops import flops_per_token

        name = self.stage_names[index]
        stage = self.cfg.stages[name]
        engine = self.make_engine(stage)
        if self.engine_state is not None:
            self.load_optimizer_state(engine)
            self.engine_state = None
        self.resume_checkpoint = None
        if self.resume_rng is not None:
            load_rng_state(self.resume_rng)
            self.resume_rng = None
        log.info(
            "stage %s: %s attention, trains %s (%d tensors), %d steps x %d sequences",
            name, stage.attention.value, stage.trainable.value, len(engine.trainable), stage.steps,
            stage.global_batch_size,
        )
        if self.state.stage_step == 0:
            self.probe(name, stage, "start")
        flops = flops_per_token(
            self.model.config, self.cfg.data.seq_len, stage.attention.value,
            stage.topk or self.model.config.index_topk, stage_trainable=stage.trainable.value,
        )
        tokens_per_step = stage.global_batch_size * self.cfg.data.seq_len
        dp_size = getattr(self, "dp_size", 1)
        log.info("%s", describe_step(name, stage.global_batch_size, self.cfg.data.seq_len, self.cfg.data.micro_batch_size,
                                     dp_size, flops, self.peak_flops, self.device.type, stage.steps - self.state.stage_step))
        progress.start_stage(name, stage.steps, self.state.stage_step)
        within_step_hook = self.model.register_forward_hook(progress.micro_batch_hook(
            lambda: self.state.global_step + 1, stage.global_batch_size // (self.cfg.data.micro_batch_size * dp_size)))
        while self.state.stage_step < stage.steps:
            self.check_preemption(engine)
            step_number = self.state.global_step + 1
            faults.at("step", step_number)
            logged = (self.state.stage_step + 1) % self.cfg.logging.log_every == 0
            start = time.perf_counter()
            before = (self.loader.state_dict(), rng_state())
            micro_batches = self.next_micro_batches(stage)
            lr = engine.lr
            step_metrics = forward_backward(
                engine, micro_batches, stage, topk_recall_queries=stage.topk_recall_queries if logged else 0,
                reduction=self.reduction,
            )
            faults.at("mid_step", step_number)
            if faults.poison_step(step_number):
                poison(step_metrics, engine)
            if faults.inf_gradient_step(step_number):
                poison_gradient(engine)
            bad = check_step(step_metrics, engine)
            skipped = self.any_rank(bool(bad))
            if skipped:
                self.nonfinite_step(engine, bad or ["values on another rank"], before)
                step_metrics["grad_norm"] = float("nan")
            else:
                step_metrics["grad_norm"] = engine.step()
                self.state.nonfinite_consecutive = 0
            step_metrics["lr"] = lr
            step_metrics["nonfinite_skipped"] = self.state.nonfinite_skipped
            if stage.router_bias_update_rate > 0 and not skipped:
                self.model.update_router_bias(stage.router_bias_update_rate)
            else:  # loads of a step without a bias update (or a skipped one) do not carry over
                self.clear_router_loads()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            elapsed = time.perf_counter() - start
            self.state.stage_step += 1
            self.state.global_step += 1
            self.state.tokens_seen += tokens_per_step
            metrics = self.step_metrics(index, step_metrics, tokens_per_step, elapsed, flops)
            self.result.history.append(metrics)
            if logged:
                self.wandb.log(metrics, step=self.state.global_step)
            progress.update(self.state.stage_step, stage.steps, metrics, logged)
            every = self.cfg.checkpoint.every_n_steps
            if every and self.state.stage_step % every == 0 and self.state.stage_step < stage.steps:
                self.save(engine)
            else:
                self.commit_pending_save(when_done=True)
        within_step_hook.remove()
        self.probe(name, stage, "end")
        self.state.stage_index += 1
        self.state.stage_step = 0
        self.save(None)
        # the next stage builds its own engine: this one's gradient hooks must not outlive it
        engine.close()
        if self.state.stage_index < len(self.stage_names):  # after the last stage only the export is left
            self.check_preemption(None)

    def step_metrics(
        self, stage_index: int, step: dict[str, float], tokens: int, elapsed: float, flops: float
    ) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for key, value in step.items():
            if key in ("lr", "grad_norm"):
                metrics[f"optim/{key}"] = value
            elif key.startswith("moe/"):
                metrics[key] = value
            else:
                metrics[f"train/{key}"] = value
        # tokens: the whole job's step; MFU per device divides by every device's peak
        metrics.update(throughput_metrics(tokens, elapsed, flops, self.peak_flops, num_devices=self.world_size))
        metrics.update(memory_metrics(self.device))
        metrics["progress/stage"] = stage_index
        metrics["progress/global_step"] = self.state.global_step
        metrics["progress/tokens"] = self.state.tokens_seen
        return metrics

    def run(self) -> TrainResult:
        try:
            return self._run()
        finally:
            self.release_run_lock()

    def _run(self) -> TrainResult:
        if self.finished:  # resumed a finished run: say so, no training, no export, no summary table
            log.warning(self.finished)
            if self.rank == 0:
                print(f"dsa-train: {self.finished}")
            self.result.summary = self.state.summary
            self.wandb.finish()
            return self.result
        progress = StageProgress(self.cfg.logging.progress_bar)
        signals = self.cfg.fault_tolerance.preemption_signals
        self.preemption = PreemptionHandler(signals) if signals else None
        try:
            while self.state.stage_index < len(self.stage_names):
                self.run_stage(self.state.stage_index, progress)
        finally:
            progress.close()
            if self.preemption is not None:
                self.preemption.restore()
        self.commit_pending_save()
        # the export selects as the model was last trained: index_topk = the last sparse stage's top-k
        self.model.config.index_topk = trained_index_topk(
            ((s.attention.value, s.topk) for s in self.cfg.stages.values()), self.model.config.index_topk)
        if self.cfg.checkpoint.export:
            self.export()
        self.result.summary = self.state.summary
        self.wandb.set_summary(summary_metrics(self.state.summary))
        self.wandb.finish()
        if self.rank == 0:  # the run summary: rank 0 prints it
            print(format_summary(self.cfg, self.result))
        return self.result

    def export(self) -> None:
        """The model in the V3.2 Hugging Face layout (N ranks: gathered to rank 0, written there)."""
        self.result.export_dir = self.run_dir / "export"
        if self.parallel is None:
            self.model.save_pretrained(self.result.export_dir, tokenizer_dir=self.tokenizer_dir())
        else:
            import copy

            import torch.distributed as dist

            from dsa_train.model import DSAForCausalLM

            full = self.full_state_dict()
            if self.rank == 0:
                model = DSAForCausalLM(copy.deepcopy(self.model.config))
                model.load_state_dict(full, strict=False)
                model.save_pretrained(self.result.export_dir, tokenizer_dir=self.tokenizer_dir())
            dist.barrier()
        log.info("exported %s", self.result.export_dir)


def train(cfg: TrainConfig, distributed: bool = False) -> TrainResult:
    return Trainer(cfg, distributed=distributed).run()
