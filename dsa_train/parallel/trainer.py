"""The distributed trainer: `Trainer` on megatron-core process groups with the DeepSpeed engine.

Every rank builds the same model (same seed, or the same checkpoint), then keeps its share
(`parallelize_model`: TP shards, EP experts, CP forward); data is sharded by data-parallel rank
(`build_dataloader(cfg, dp_rank, dp_size)`); a step holds global_batch_size / (micro_batch_size *
DP) micro-batches per rank. Losses are scaled as in `dsa_train.parallel.step` so that the
update equals the single-process one over the same global batch: the model's LM and MTP losses
are multiplied by DP*CP*N_rank/N_global (N: valid labels of the step on this rank / on all DP
ranks) and the indexer loss by CP (`LossScale`), before the shared `forward_backward` weights
them; reported metrics are reduced back to the single-process values (`reduce_metrics`). Rank 0 logs (W&B, progress) and writes
the shared files; every rank writes its own model shard and optimizer partition in checkpoints.
The export at the end gathers the full model to rank 0.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging

import torch
import torch.distributed as dist

from dsa_train.config import ConfigError, StageConfig, TrainConfig, WandbMode
from dsa_train.engine import trainer as base
from dsa_train.parallel.groups import ParallelState, check_model_divisibility, init_parallel
from dsa_train.parallel.model import parallelize_model
from dsa_train.parallel.step import LossScale, reduce_metrics

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _layout_checked_here():
    """Trainer.__init__ rejects parallel layouts (single process); this trainer checks them itself."""
    saved = base.check_single_process
    base.check_single_process = lambda cfg: None
    try:
        yield
    finally:
        base.check_single_process = saved


class DistributedTrainer(base.Trainer):
    def __init__(self, cfg: TrainConfig):
        state = init_parallel(cfg.parallel)
        self.pstate: ParallelState = state
        sizes = state.sizes
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.dp_rank, self.dp_size = state.dp_rank, sizes.data
        self.barrier = dist.barrier
        self._deferred_resume = False
        if self.rank != 0:
            cfg = copy.deepcopy(cfg)
            cfg.logging.wandb_mode = WandbMode.disabled
            cfg.logging.progress_bar = False
        self.export_at_end = cfg.checkpoint.export
        for name, stage in cfg.stages.items():
            per_step = cfg.data.micro_batch_size * sizes.data
            if stage.global_batch_size % per_step:
                raise ConfigError(
                    f"stages.{name}.global_batch_size={stage.global_batch_size} is not a multiple of "
                    f"data.micro_batch_size * data-parallel size = {cfg.data.micro_batch_size} * {sizes.data}"
                )
        if cfg.device.value == "cuda" or (cfg.device.value == "auto" and torch.cuda.is_available()):
            torch.cuda.set_device(torch.cuda.current_device())
        with _layout_checked_here():
            super().__init__(cfg)
        check_model_divisibility(sizes, self.model.config)
        self.model = parallelize_model(self.model, state, recompute=self.cfg.parallel.recompute,
                                       grouped_experts=self.cfg.parallel.grouped_experts)
        self.loss_scale = LossScale(self.model)
        if self._deferred_resume:
            self._deferred_resume = False
            base.Trainer._resume(self)
        log.info("%s", state.describe())

    # ------------------------------------------------------------------ set-up hooks
    def _resume(self) -> None:
        # checkpoints hold per-rank shards: load them once the model is sharded
        self._deferred_resume = True

    def make_engine(self, stage: StageConfig):
        from dsa_train.parallel.deepspeed_engine import DeepSpeedEngine

        return DeepSpeedEngine(self.model, stage, self.cfg.optim, self.pstate, zero_stage=self.cfg.parallel.zero_stage,
                               micro_batch_size=self.cfg.data.micro_batch_size)

    def any_rank(self, flag: bool) -> bool:
        t = torch.tensor([1.0 if flag else 0.0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    # ------------------------------------------------------------------ steps
    def next_micro_batches(self, stage: StageConfig) -> list[dict[str, torch.Tensor]]:
        sizes = self.pstate.sizes
        accum = stage.global_batch_size // (self.cfg.data.micro_batch_size * sizes.data)
        batches = [{k: v.to(self.device) for k, v in next(self.loader).items()} for _ in range(accum)]
        self.loss_scale.set_for(batches, self.pstate)
        return batches

    def step_metrics(self, stage_index, step, tokens, elapsed, flops):
        return super().step_metrics(stage_index, reduce_metrics(step, self.pstate), tokens, elapsed, flops)

    def probe(self, name: str, stage: StageConfig, when: str) -> None:
        if not self.probes:
            return
        from dsa_train.engine.probe import measure

        self.loss_scale.lm = self.loss_scale.indexer = None  # probes report plain losses
        values = measure(self.model, self.probes, stage, self.device)
        if self.pstate.sizes.context > 1:  # LM loss: partial sums over CP ranks
            t = torch.tensor([values["lm_loss"]], dtype=torch.float64)
            dist.all_reduce(t, group=self.pstate.cp_group)
            values["lm_loss"] = float(t.item())
        self.state.summary.setdefault(name, {})[when] = values
        if self.rank == 0:
            self.wandb.log({f"probe/{name}/{key}": v for key, v in values.items()}, step=self.state.global_step)
            log.info("probe %s %s: %s", name, when, "  ".join(f"{k} {v:.4f}" for k, v in values.items()))

    # ------------------------------------------------------------------ checkpoints / export
    def _gathered(self):
        """ZeRO-3: parameters gathered for the duration (checkpoint writing reads them)."""
        if self.cfg.parallel.zero_stage == 3:
            import deepspeed

            return deepspeed.zero.GatheredParameters(list(self.model.parameters()), modifier_rank=None)
        return contextlib.nullcontext()

    def save(self, engine, data_state=None, rng=None) -> None:
        with self._gathered():
            super().save(engine, data_state=data_state, rng=rng)

    def model_layout(self) -> dict:
        """The tensor-parallel slices in this rank's model file, for `dsa-train export`."""
        shards = {}
        for name, p in self.model.state_dict(keep_vars=True).items():
            shard = getattr(p, "dsa_shard", None)
            if shard is not None:
                shards[name] = list(shard)
        return {"tensor_parallel": self.pstate.sizes.tensor, "shards": shards}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The single-process state dict, gathered to every rank (TP shards concatenated, EP
        experts collected). For small models and the tests; big models export from checkpoints."""
        st = self.pstate
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

    def run(self):
        self.cfg.checkpoint.export = False
        quiet = contextlib.redirect_stdout(io.StringIO()) if self.rank != 0 else contextlib.nullcontext()
        try:
            with quiet:  # the run summary: rank 0 prints it
                result = super().run()
        finally:
            self.cfg.checkpoint.export = self.export_at_end
        if self.export_at_end:
            from dsa_train.model import DSAForCausalLM

            full = self.full_state_dict()
            result.export_dir = self.run_dir / "export"
            if self.rank == 0:
                model = DSAForCausalLM(copy.deepcopy(self.model.config))
                model.load_state_dict(full, strict=False)
                model.save_pretrained(result.export_dir, tokenizer_dir=self.tokenizer_dir())
                log.info("exported %s", result.export_dir)
            dist.barrier()
        return result


def train(cfg: TrainConfig):
    return DistributedTrainer(cfg).run()
