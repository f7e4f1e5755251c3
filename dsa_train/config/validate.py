"""Checks that a structured config cannot express by types alone. Every error names its key."""

from __future__ import annotations

from dsa_train.config.schema import Attention, TrainConfig, Trainable


class ConfigError(ValueError):
    pass


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


def validate(cfg: TrainConfig) -> None:
    _require(bool(cfg.stages), "stages", "a recipe needs at least one stage")
    _require(
        cfg.model.pretrained is None or not cfg.model.arch,
        "model.arch",
        "architecture fields only apply to a from-scratch model (model.pretrained is set)",
    )
    _require(bool(cfg.data.sources), "data.sources", "no data sources given")
    _require(cfg.data.seq_len >= 2, "data.seq_len", f"must be >= 2, got {cfg.data.seq_len}")
    _require(cfg.data.micro_batch_size >= 1, "data.micro_batch_size", "must be >= 1")
    _require(cfg.probe_batches >= 0, "probe_batches", "must be >= 0")
    _require(cfg.logging.log_every >= 1, "logging.log_every", "must be >= 1")
    _require(cfg.checkpoint.every_n_steps >= 0, "checkpoint.every_n_steps", "must be >= 0")
    _require(cfg.checkpoint.keep_last >= 0, "checkpoint.keep_last", "must be >= 0")
    _require(cfg.checkpoint.resume in (True, False, "auto"), "checkpoint.resume",
             f"must be auto, true or false, got {cfg.checkpoint.resume!r}")
    _require(cfg.fault_tolerance.max_consecutive_nonfinite >= 1, "fault_tolerance.max_consecutive_nonfinite",
             "must be >= 1")
    _check_signals(cfg.fault_tolerance.preemption_signals)
    _require(len(cfg.optim.betas) == 2, "optim.betas", "needs two values")
    _require(cfg.optim.grad_clip >= 0, "optim.grad_clip", "must be >= 0 (0 disables)")
    _require(cfg.cluster.max_restarts >= 0, "cluster.max_restarts", "must be >= 0 (0: a crashed rank ends the job)")
    for size_key in ("tensor_parallel", "context_parallel", "expert_parallel"):
        _require(getattr(cfg.parallel, size_key) >= 1, f"parallel.{size_key}", "must be >= 1")
    for name, stage in cfg.stages.items():
        key = f"stages.{name}"
        _require(stage.steps >= 1, f"{key}.steps", "must be >= 1")
        _require(stage.lr > 0, f"{key}.lr", "must be > 0")
        _require(stage.warmup_steps >= 0, f"{key}.warmup_steps", "must be >= 0")
        _require(0.0 <= stage.min_lr_ratio <= 1.0, f"{key}.min_lr_ratio", "must be within [0, 1]")
        _require(stage.lm_loss_coef >= 0 and stage.indexer_loss_coef >= 0,
                 f"{key}.lm_loss_coef", "loss coefficients must be >= 0")
        if stage.trainable == Trainable.indexer:
            _require(stage.indexer_loss_coef > 0, f"{key}.indexer_loss_coef",
                     "an indexer-only stage needs the indexer loss")
            _require(stage.lm_loss_coef == 0, f"{key}.lm_loss_coef",
                     "the LM loss does not reach the indexer (its input is detached); use 0")
            _require(stage.router_bias_update_rate == 0, f"{key}.router_bias_update_rate",
                     "the router is frozen in an indexer-only stage")
        _require(stage.mtp_loss_coef >= 0, f"{key}.mtp_loss_coef", "loss coefficients must be >= 0")
        _require(stage.mtp_loss_coef == 0 or stage.lm_loss_coef > 0, f"{key}.mtp_loss_coef",
                 "the MTP loss needs the LM head and labels: set lm_loss_coef > 0 or mtp_loss_coef: 0")
        _require(stage.lm_loss_coef > 0 or stage.indexer_loss_coef > 0,
                 f"{key}.lm_loss_coef", "lm_loss_coef and indexer_loss_coef are both 0")
        _require(stage.global_batch_size >= 1, f"{key}.global_batch_size", "must be >= 1")
        _require(stage.global_batch_size % cfg.data.micro_batch_size == 0,
                 f"{key}.global_batch_size",
                 f"{stage.global_batch_size} is not a multiple of data.micro_batch_size="
                 f"{cfg.data.micro_batch_size}")
        if stage.attention == Attention.dense:
            _require(stage.topk_recall_queries == 0, f"{key}.topk_recall_queries",
                     "top-k recall is measured in sparse stages only")
        if stage.topk is not None:
            _require(stage.topk >= 1, f"{key}.topk", "must be >= 1")
        _require(stage.topk_recall_queries >= 0, f"{key}.topk_recall_queries", "must be >= 0")


def _check_signals(names: list[str]) -> None:
    import signal

    for name in names:
        key = str(name).upper()
        key = key if key.startswith("SIG") else "SIG" + key
        _require(hasattr(signal, key) and key not in ("SIGKILL", "SIGSTOP"), "fault_tolerance.preemption_signals",
                 f"{name!r} is not a signal a process can handle (e.g. SIGTERM, SIGUSR1)")
