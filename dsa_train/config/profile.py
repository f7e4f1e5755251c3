"""Profiles (`profile=<name>`, recipes/profile/*.yaml): one way to run any recipe.

A profile is applied to the composed recipe before it is checked, so that one option changes all
stages of whatever recipe it is given (their names differ from recipe to recipe). `smoke` runs a
671B recipe's stages for real on the CPU: `dsa-train --config-name v3.2_warmup profile=smoke
model.pretrained=/tmp/tiny-v3.1`.
"""

from __future__ import annotations

import logging

from dsa_train.config.schema import ProfileConfig, TrainConfig
from dsa_train.stage import Stage

log = logging.getLogger(__name__)


def _at_most(value, limit):
    return value if limit is None else min(value, limit)


def apply_profile(cfg: TrainConfig, announce: bool = True) -> list[str]:
    """Change `cfg` in place as its profile says; returns the changes as `key: old -> new`."""
    p: ProfileConfig = cfg.profile
    changes: list[str] = []

    def put(obj, attr: str, key: str, value) -> None:
        old = getattr(obj, attr)
        if value is not None and old != value:
            setattr(obj, attr, value)
            changes.append(f"{key}: {_show(old)} -> {_show(value)}")

    if p.name == "none":
        return changes
    put(cfg, "device", "device", p.device)
    put(cfg, "probe_batches", "probe_batches", p.probe_batches)
    put(cfg.model, "dtype", "model.dtype", p.dtype)
    if cfg.model.pretrained is not None:
        put(cfg.model, "arch", "model.arch", {} if cfg.model.arch else None)
    elif p.arch:
        put(cfg.model, "arch", "model.arch", {**cfg.model.arch, **p.arch})
    if not cfg.data.sources:
        put(cfg.data, "sources", "data.sources", list(p.data_sources) if p.data_sources else None)
    put(cfg.data, "seq_len", "data.seq_len", p.seq_len)
    put(cfg.data, "micro_batch_size", "data.micro_batch_size", p.micro_batch_size)
    put(cfg.data, "num_workers", "data.num_workers", p.num_workers)
    if p.one_process:
        for attr in ("tensor_parallel", "context_parallel", "expert_parallel", "data_parallel"):
            put(cfg.parallel, attr, f"parallel.{attr}", 1)
        put(cfg.parallel, "zero_stage", "parallel.zero_stage", 0)
        put(cfg.parallel, "recompute", "parallel.recompute", "none")
    if p.checkpoint_every_n_steps is not None:
        put(cfg.checkpoint, "every_n_steps", "checkpoint.every_n_steps", p.checkpoint_every_n_steps)
    for name, stage in cfg.stages.items():
        key = f"stages.{name}"
        put(stage, "steps", f"{key}.steps", _at_most(stage.steps, p.steps))
        put(stage, "warmup_steps", f"{key}.warmup_steps", _at_most(stage.warmup_steps, p.warmup_steps))
        put(stage, "global_batch_size", f"{key}.global_batch_size", p.global_batch_size)
        if Stage.of(name, stage).sparse:
            if p.topk is not None:
                put(stage, "topk", f"{key}.topk", p.topk if stage.topk is None else min(stage.topk, p.topk))
            put(stage, "topk_recall_queries", f"{key}.topk_recall_queries",
                _at_most(stage.topk_recall_queries, p.topk_recall_queries))
    if changes and announce:
        log.info("profile %s changes %d fields of the recipe: %s", p.name, len(changes), "; ".join(changes))
    return changes


def _show(value) -> str:
    return getattr(value, "value", None) or repr(value) if not isinstance(value, (int, float)) else str(value)
