"""The trainer, one for one process (`dsa-train`) and for N ranks (torchrun / Slurm:
`dsa_train.launch.rank`): runs a recipe's stages in order.

Per stage: a fresh engine (the stage's trainable parameters, AdamW + schedule; DeepSpeed with N
ranks), probe, `steps` optimizer steps of `global_batch_size` sequences (gradient accumulation
over micro-batches, `train_step`), probe again and checkpoint. The data loader is shared by all
stages, so the data position carries on from one stage to the next. At the end: export the model
in the V3.2 Hugging Face layout and print the summary.

The parts it asks:
    layout        dsa_train.parallel.layout: ranks, process groups, the model's parallelization,
                  the engine, how a step's numbers combine over ranks (one process: trivial)
    checkpoints   trainer/checkpoint_manager.py: resume, save, commit, export
    the step      trainer/step.train_step with the hooks of trainer/hooks.py (the non-finite policy,
                  the router-bias update; fault injection only with DSA_FAULT set)
Rank 0 logs (W&B, progress) and writes the shared files.
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import OmegaConf

from dsa_train.trainer.engine import make_engine
import dsa_train.trainer.recipe_change as recipe_change
from dsa_train.checkpoint import from_pretrained
from dsa_train.stage import trained_index_topk
from dsa_train.config import ConfigError, Device, TrainConfig, validate
from dsa_train.config.run_files import record_run_start
from dsa_train.config.validate import check_sequence_fits, doubtful_values
from dsa_train.data import BUNDLED_TOKENIZER_DIR, build_dataloader, check_vocab
from dsa_train.checkpoint.training import TrainerState
from dsa_train.trainer.checkpoint_manager import CheckpointManager
from dsa_train.training_engine import TrainingEngine
from dsa_train.trainer.hooks import NonFiniteGuard, RouterBias, fault_hooks
from dsa_train.trainer.probe import measure, probe_batches
from dsa_train.trainer.rng import load_rng_state, rng_state, seed_everything, set_deterministic
from dsa_train.trainer.run_lock import lock_run
from dsa_train.signals import EXIT_PREEMPTED, PreemptionHandler, Preempted, mark_preempted
from dsa_train.trainer.step import StepHooks, train_step
from dsa_train.trainer.summary import format_summary, summary_metrics
from dsa_train.eval.in_training import TrainingEval
from dsa_train.logging.perf import memory_metrics, peak_flops_per_device, throughput_metrics
from dsa_train.logging.progress import StageProgress, describe_step
from dsa_train.logging.profile import profiled
from dsa_train.logging.wandb_run import METRICS_FILE, WandbRun
from dsa_train.model import DSAForCausalLM, tiny_config
from dsa_train.parallel.layout import init_layout
from dsa_train.trainer.startup import load_parallel_pretrained
from dsa_train.stage import Stage

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


def build_model(cfg: TrainConfig, vocab_size: int, parallel_state=None) -> torch.nn.Module:
    """The model of the recipe. With a parallel layout and a pretrained checkpoint, this rank's
    part only, already parallelized (meta-device start-up: dsa_train.trainer.startup)."""
    dtype = getattr(torch, cfg.model.dtype.value)
    if cfg.model.pretrained is not None and parallel_state is not None and parallel_state.sizes.world > 1:
        model = load_parallel_pretrained(cfg.model.pretrained, parallel_state, dtype, recompute=cfg.parallel.recompute,
                                         grouped_experts=cfg.parallel.grouped_experts)
    elif cfg.model.pretrained is not None:
        model = from_pretrained(cfg.model.pretrained, dtype=dtype)
    else:
        arch = {"vocab_size": vocab_size, **cfg.model.arch}
        model = DSAForCausalLM(tiny_config(**arch)).cast(dtype)  # the dtype policy: model/dtypes.py
    check_vocab(vocab_size, model.config.vocab_size)
    return model


def warn_if_topk_covers_sequence(seq_len: int, stages: dict[str, Stage], model_config) -> None:
    """A warning (and log line) for each sparse stage whose top-k selects every key of a sequence."""
    for name, stage in stages.items():
        topk = stage.topk_for(model_config)
        if stage.sparse and seq_len <= topk:
            # not an error: the run is correct, only no faster than dense (every key is selected)
            message = (
                f"stages.{name}.topk: top-{topk} selection on {seq_len}-token sequences "
                "selects every key, so sparse attention equals dense attention here; raise "
                f"data.seq_len above {topk} or lower stages.{name}.topk for sparse training"
            )
            warnings.warn(message, TopkCoversSequence, stacklevel=3)
            log.warning(message)


class Trainer:
    """Runs the stages of `cfg` in this process: one process, or one of N ranks with
    `distributed=True` (the layout of dsa_train.parallel.layout: process groups, the model
    parallelized, data sharded by data-parallel rank, the DeepSpeed engine per stage)."""

    def __init__(self, cfg: TrainConfig, distributed: bool = False):
        validate(cfg)
        for doubt in doubtful_values(cfg):  # allowed, but rarely meant: said at start-up, not silent
            log.warning("%s", doubt)
        self.layout, cfg = init_layout(cfg, distributed)
        self.cfg = cfg
        self.stage_names = list(cfg.stages)
        self.stages = {name: Stage.of(name, stage) for name, stage in cfg.stages.items()}
        self.device = resolve_device(cfg.device)
        self.peak_flops = peak_flops_per_device(self.device, cfg.logging.peak_flops)  # before any load: can fail
        self.run_dir = Path(cfg.run_dir)
        set_deterministic(cfg.deterministic)
        seed_everything(cfg.seed)

        layout = self.layout
        self.loader = build_dataloader(cfg.data, dp_rank=layout.dp_rank, dp_size=layout.dp_size,
                                       held_out=cfg.eval.num_sequences if cfg.eval.enabled else 0)
        model = build_model(cfg, self.loader.tokenizer.vocab_size, layout.parallel_state).to(self.device)
        self.model = layout.prepare_model(model, cfg)
        self.model.train()
        check_sequence_fits(cfg, self.model.config.max_position_embeddings)
        warn_if_topk_covers_sequence(cfg.data.seq_len, self.stages, self.model.config)
        self.probes = probe_batches(cfg.data, cfg.probe_batches)
        # the recipe's eval group (None when off): the loader's held-out rows, at stage ends / every N steps
        self.evaluation = TrainingEval.of(cfg.eval, self.loader, cfg.data.seq_len, self.stages, self.model.config)
        self.state = TrainerState()
        self.resume_rng: dict | None = None
        self.step_start: tuple[dict, dict] | None = None  # data position and RNG states before the current step
        self.result = TrainResult(run_dir=self.run_dir)
        self.finished: str | None = None  # set by a resume of a run whose stages are all done
        self.preemption: PreemptionHandler | None = None
        # the stage being run: its type, engine and the hooks of its steps (open_stage)
        self.stage: Stage | None = None
        self.engine: TrainingEngine | None = None
        self.step_hooks: list[StepHooks] = []
        self.checkpoints = CheckpointManager(cfg.checkpoint, layout, self.model, self.loader, self.config_dict,
                                             self.device)
        # one run per run_dir (rank 0 holds the lock for all ranks; released when the run ends)
        self.run_locks = lock_run(self.run_dir, cfg.checkpoint.dir) if layout.rank == 0 else []
        try:
            if cfg.checkpoint.resume is False:
                self.checkpoints.refuse_existing()
            else:
                self.resume()
        except BaseException:
            self.release_run_lock()
            raise
        if layout.rank == 0:  # .hydra/ and train.log: only once the run holds run_dir and its resume checks passed
            record_run_start(self.run_dir)
        self.wandb = WandbRun(cfg.logging, self.config_dict(), run_id=self.state.wandb_run_id,
                              metrics_path=self.metrics_path())
        self.state.wandb_run_id = self.wandb.id
        self.result.wandb_run_id = self.wandb.id

    def metrics_path(self) -> Path | None:
        """`<run_dir>/metrics.jsonl`, written by rank 0 (`dsa-train report` reads it)."""
        return self.run_dir / METRICS_FILE if self.layout.rank == 0 else None

    def release_run_lock(self) -> None:
        for lock in getattr(self, "run_locks", []):
            lock.release()

    def tokenizer_dir(self) -> str:
        return self.cfg.data.tokenizer or str(BUNDLED_TOKENIZER_DIR)

    def config_dict(self) -> dict:
        return OmegaConf.to_container(OmegaConf.structured(self.cfg), resolve=True, enum_to_str=True)

    def resume(self) -> None:
        """Continue from the newest valid checkpoint, if any (checkpoint.resume: auto / true)."""
        loaded = self.checkpoints.resume()
        if loaded is None:
            return
        if loaded.state.stage_index >= len(self.stage_names):
            self.finished = recipe_change.finished_message(self.stage_names, loaded.state.global_step, loaded.path,
                                                           self.run_dir / "export")
        self.state = loaded.state
        self.resume_rng = loaded.rng
        self.result.summary = self.state.summary
        log.info("resumed from %s (stage %d, step %d)", loaded.path, self.state.stage_index, self.state.stage_step)

    # ------------------------------------------------------------------ one stage
    def run_stage(self, index: int, progress: StageProgress) -> None:
        """probe -> steps -> probe -> checkpoint."""
        stage = self.stages[self.stage_names[index]]
        self.open_stage(stage)
        if self.state.stage_step == 0:
            self.probe(stage, "start")
        flops = self.announce_stage(stage, progress)
        within_step_hook = self.model.register_forward_hook(progress.micro_batch_hook(
            lambda: self.state.global_step + 1, self.micro_batches_per_step(stage)))
        while self.state.stage_step < stage.config.steps:
            self.check_preemption(self.engine)
            for hook in self.step_hooks:
                hook.before_step()
            logged = (self.state.stage_step + 1) % self.cfg.logging.log_every == 0
            start = time.perf_counter()
            self.step_start = (self.loader.state_dict(), rng_state())  # the non-finite policy's checkpoint
            with profiled(self.state.global_step + 1, self.cfg.logging.profile_steps, self.run_dir, self.device,
                          self.layout.rank, self.cfg.logging.profile_trace):
                step_metrics = self.train_step(self.next_micro_batches(stage), measure_recall=logged)
            metrics = self.record_step(index, stage, step_metrics, start, flops, logged)
            progress.update(self.state.stage_step, stage.config.steps, metrics, logged)
            self.checkpoint_within_stage(stage)
            if self.evaluation is not None and self.evaluation.due_within(self.state.stage_step, stage.config.steps):
                self.evaluate(stage, at_end=False)
        within_step_hook.remove()
        self.probe(stage, "end")
        if self.evaluation is not None:
            self.evaluate(stage, at_end=True)
        self.close_stage()

    def open_stage(self, stage: Stage) -> None:
        """The stage's engine (with the resumed optimizer state) and step hooks."""
        self.stage = stage
        self.engine = make_engine(self.layout, self.model, stage, self.cfg)
        self.checkpoints.load_optimizer_state(self.engine)
        if self.resume_rng is not None:
            load_rng_state(self.resume_rng)
            self.resume_rng = None
        self.step_hooks = [
            *fault_hooks(lambda: self.state.global_step + 1),  # only with DSA_FAULT set
            NonFiniteGuard(self.cfg.fault_tolerance, self.state, lambda flag: self.layout.any_rank(flag, self.device),
                           self.save_step_start, self.cfg.checkpoint.dir),
            RouterBias(self.model, stage.config.router_bias_update_rate),
        ]
        log.info("%s", stage.describe(len(self.engine.trainable)))

    def announce_stage(self, stage: Stage, progress: StageProgress) -> float:
        """Log what a step of the stage is and how long it may take, start its progress bar; returns FLOPs/token."""
        flops = stage.flops_per_token(self.model.config, self.cfg.data.seq_len)
        data, steps = self.cfg.data, stage.config.steps
        log.info("%s", describe_step(stage.name, stage.config.global_batch_size, data.seq_len, data.micro_batch_size,
                                     self.layout.dp_size, flops, self.peak_flops, self.device.type,
                                     steps - self.state.stage_step))
        progress.start_stage(stage.name, steps, self.state.stage_step)
        return flops

    def close_stage(self) -> None:
        """The stage's end: its checkpoint; a preemption signal stops the run here."""
        self.state.stage_index += 1
        self.state.stage_step = 0
        self.checkpoints.save(self.state)
        # the next stage builds its own engine: this one's gradient hooks must not outlive it
        self.engine.close()
        if self.state.stage_index < len(self.stage_names):  # after the last stage only the export is left
            self.check_preemption(None)

    def micro_batches_per_step(self, stage: Stage) -> int:
        return stage.config.global_batch_size // (self.cfg.data.micro_batch_size * self.layout.dp_size)

    def next_micro_batches(self, stage: Stage) -> list[dict[str, torch.Tensor]]:
        return [{k: v.to(self.device) for k, v in next(self.loader).items()}
                for _ in range(self.micro_batches_per_step(stage))]

    # ------------------------------------------------------------------ one step
    def train_step(self, micro_batches: list[dict[str, torch.Tensor]], measure_recall: bool = False) -> dict[str, float]:
        """One optimizer step of the current stage with the trainer's hooks; its metrics."""
        stage = self.stage
        return train_step(self.engine, micro_batches, stage, stage.config.topk_recall_queries if measure_recall else 0,
                          self.layout.reduction, hooks=self.step_hooks)

    def record_step(self, stage_index: int, stage: Stage, step: dict[str, float], start: float, flops: float,
                    logged: bool) -> dict[str, float]:
        """Count the step done; its metrics (train/*, optim/*, moe/*, perf/*, progress/*) into
        the history and, when `logged`, to W&B / metrics.jsonl."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - start
        tokens = stage.config.global_batch_size * self.cfg.data.seq_len
        self.state.stage_step += 1
        self.state.global_step += 1
        self.state.tokens_seen += tokens
        metrics: dict[str, float] = {}
        for key, value in step.items():
            if key in ("lr", "grad_norm"):
                metrics[f"optim/{key}"] = value
            elif key.startswith("moe/"):
                metrics[key] = value
            else:
                metrics[f"train/{key}"] = value
        # tokens: the whole job's step; MFU per device divides by every device's peak
        metrics.update(throughput_metrics(tokens, elapsed, flops, self.peak_flops, num_devices=self.layout.world_size))
        metrics.update(memory_metrics(self.device))
        metrics["progress/stage"] = stage_index
        metrics["progress/global_step"] = self.state.global_step
        metrics["progress/tokens"] = self.state.tokens_seen
        self.result.history.append(metrics)
        if logged:
            self.wandb.log(metrics, step=self.state.global_step)
        return metrics

    def checkpoint_within_stage(self, stage: Stage) -> None:
        """Every checkpoint.every_n_steps steps (not the stage's last: its end saves), else
        commit a finished background save."""
        every = self.cfg.checkpoint.every_n_steps
        if every and self.state.stage_step % every == 0 and self.state.stage_step < stage.config.steps:
            self.checkpoints.save(self.state, self.engine)
        else:
            self.checkpoints.commit_pending_save(when_done=True)

    def save_step_start(self, engine: TrainingEngine) -> None:
        """A committed checkpoint of the state before the current step (the non-finite stop)."""
        data_state, rng = self.step_start
        self.checkpoints.save(self.state, engine, data_state=data_state, rng=rng)
        self.checkpoints.commit_pending_save()

    def check_preemption(self, engine: TrainingEngine | None) -> None:
        """At a step boundary: after a preemption signal, checkpoint and raise Preempted."""
        received = self.preemption is not None and self.preemption.requested
        if not self.layout.any_rank(received, self.device):
            return
        if self.checkpoints.last_saved_step != self.state.global_step:
            self.checkpoints.save(self.state, engine)
        self.checkpoints.commit_pending_save()
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

    def probe(self, stage: Stage, when: str) -> None:
        """The probe batches' metrics at the stage's start or end, for the run summary."""
        if not self.probes:
            return
        name = stage.name
        values = measure(self.model, self.probes, stage, self.device, self.layout.reduction)
        self.state.summary.setdefault(name, {})[when] = values
        if self.layout.rank == 0:
            self.wandb.log({f"probe/{name}/{key}": v for key, v in values.items()}, step=self.state.global_step)
            log.info("probe %s %s: %s", name, when, "  ".join(f"{k} {v:.4f}" for k, v in values.items()))

    def evaluate(self, stage: Stage, at_end: bool) -> None:
        """The recipe's eval group (dsa_train/eval/in_training.py): rank 0 logs it under eval/; a
        stage end's values go into the run summary (its "sparse vs dense LM loss by position")."""
        saved_rng = rng_state()  # invisible to training: a resumed run draws what an uninterrupted one does
        try:
            values = self.evaluation.run(self.model, self.layout, self.device)
        finally:
            load_rng_state(saved_rng)
        if values is None:  # not rank 0
            return
        self.wandb.log({f"eval/{key}": v for key, v in values.items()}, step=self.state.global_step)
        log.info("eval %s step %d: %s", stage.name, self.state.global_step,
                 "  ".join(f"{k} {values[k]:.4f}" for k in ("dense/loss", "sparse/loss", "oracle/loss") if k in values))
        if at_end:
            self.state.summary.setdefault(stage.name, {})["eval"] = values

    # ------------------------------------------------------------------ the run
    def run(self) -> TrainResult:
        try:
            return self._run()
        finally:
            self.release_run_lock()

    def _run(self) -> TrainResult:
        if self.finished:  # resumed a finished run: say so, no training, no export, no summary table
            log.warning(self.finished)
            if self.layout.rank == 0:
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
        self.checkpoints.commit_pending_save()
        # the export selects as the model was last trained: index_topk = the last sparse stage's top-k
        self.model.config.index_topk = trained_index_topk(
            ((stage.attention, stage.config.topk) for stage in self.stages.values()), self.model.config.index_topk)
        if self.cfg.checkpoint.export:
            self.result.export_dir = self.run_dir / "export"
            self.checkpoints.export(self.result.export_dir, self.tokenizer_dir())
        self.result.summary = self.state.summary
        self.wandb.set_summary(summary_metrics(self.state.summary))
        self.wandb.finish()
        if self.layout.rank == 0:  # the run summary: rank 0 prints it
            print(format_summary(self.cfg, self.result))
        return self.result


def train(cfg: TrainConfig, distributed: bool = False) -> TrainResult:
    return Trainer(cfg, distributed=distributed).run()
