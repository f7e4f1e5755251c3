"""Structured configs for `dsa-train` recipes (Hydra ConfigStore + `recipes/`).

The names below are re-exported lazily (PEP 562): `from dsa_train.config import DataConfig` loads
the schema and the validator (omegaconf), not Hydra or the recipe loader; each module is imported
on the first use of one of its names. The validator's names are bound at import: `validate` is
also a submodule's name, which Python sets on the package when any module imports
`dsa_train.config.validate`, and the function must win."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dsa_train.config.validate import ConfigError, ParallelSizes, resolve_sizes, validate
from dsa_train.lazy import lazy_exports

# module -> the names it defines that this package re-exports
_MODULES = {
    "dsa_train.config.recipes": ("DEFAULT_RECIPE", "compose_recipe", "load_recipe", "recipes_dir", "to_train_config"),
    "dsa_train.config.schema": (
        "Attention", "CheckpointConfig", "ClusterConfig", "DataConfig", "Decay", "Device", "DType", "LoggingConfig",
        "ModelConfig", "OptimConfig", "ParallelConfig", "StageConfig", "Trainable", "TrainConfig", "WandbMode",
    ),
    "dsa_train.config.store": ("register_configs",),
}
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}

__all__ = sorted([*_EXPORTS, "ConfigError", "ParallelSizes", "resolve_sizes", "validate"])

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ imports on first use
    from dsa_train.config.recipes import DEFAULT_RECIPE, compose_recipe, load_recipe, recipes_dir, to_train_config
    from dsa_train.config.schema import (Attention, CheckpointConfig, ClusterConfig, DataConfig, Decay, Device, DType,
                                         LoggingConfig, ModelConfig, OptimConfig, ParallelConfig, StageConfig,
                                         Trainable, TrainConfig, WandbMode)
    from dsa_train.config.store import register_configs


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
