"""Structured configs for `dsa-train` recipes (Hydra ConfigStore + `recipes/`)."""

from dsa_train.config.recipes import (
    DEFAULT_RECIPE,
    compose_recipe,
    load_recipe,
    recipes_dir,
    to_train_config,
)
from dsa_train.config.schema import (
    Attention,
    CheckpointConfig,
    ClusterConfig,
    DataConfig,
    Decay,
    Device,
    DType,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    StageConfig,
    Trainable,
    TrainConfig,
    WandbMode,
)
from dsa_train.config.store import register_configs
from dsa_train.config.validate import ConfigError, ParallelSizes, resolve_sizes, validate

__all__ = [
    "Attention", "CheckpointConfig", "ClusterConfig", "ConfigError", "DEFAULT_RECIPE", "DType",
    "DataConfig", "Decay", "Device", "LoggingConfig", "ModelConfig", "OptimConfig",
    "ParallelConfig", "ParallelSizes", "StageConfig", "TrainConfig", "Trainable", "WandbMode", "compose_recipe",
    "load_recipe", "recipes_dir", "register_configs", "resolve_sizes", "to_train_config", "validate",
]
