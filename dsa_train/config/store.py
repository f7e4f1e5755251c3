"""Registers the structured configs in Hydra's ConfigStore.

`dsa_train_schema` is the root every recipe starts its defaults list with; each group also
gets a `base` option holding the dataclass defaults (e.g. `dsa-train optim=base`).
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from dsa_train.config.schema import (
    CheckpointConfig,
    ClusterConfig,
    DataConfig,
    EvalConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    ProfileConfig,
    StageConfig,
    TrainConfig,
)

ROOT_SCHEMA = "dsa_train_schema"

GROUP_SCHEMAS = {
    "model": ModelConfig,
    "stage": StageConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "parallel": ParallelConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
    "cluster": ClusterConfig,
    "profile": ProfileConfig,
    "eval": EvalConfig,
}


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name=ROOT_SCHEMA, node=TrainConfig)
    for group, schema in GROUP_SCHEMAS.items():
        cs.store(group=group, name="base", node=schema)
    # Hydra's console logging without its train.log (dsa_train/config/run_files.py writes that, and
    # .hydra/, once the run holds its run directory)
    from dsa_train.config.run_files import JOB_LOGGING

    cs.store(group="hydra/job_logging", name="dsa_train", node=JOB_LOGGING, provider="dsa_train")
