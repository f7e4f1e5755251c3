"""Locating, composing and checking recipes outside the command line (tests, notebooks)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from dsa_train.config.schema import TrainConfig
from dsa_train.config.store import register_configs
from dsa_train.config.validate import ConfigError, validate

DEFAULT_RECIPE = "demo"


def recipes_dir() -> Path:
    """The `recipes/` directory: the repository's (source or editable install), else the
    copy installed inside the package."""
    repo_recipes = Path(__file__).resolve().parents[2] / "recipes"
    if repo_recipes.is_dir():
        return repo_recipes
    packaged = Path(str(resources.files("dsa_train"))) / "recipes"
    if packaged.is_dir():
        return packaged
    raise FileNotFoundError(
        f"no recipes directory: looked for {repo_recipes} and {packaged}; "
        "pass one with --config-dir"
    )


def compose_recipe(recipe: str = DEFAULT_RECIPE, overrides: list[str] | None = None) -> DictConfig:
    """The recipe as Hydra composes it for `dsa-train --config-name <recipe> <overrides>`."""
    register_configs()
    with initialize_config_dir(config_dir=str(recipes_dir()), version_base=None):
        return compose(config_name=recipe, overrides=list(overrides or []))


def to_train_config(cfg: DictConfig) -> TrainConfig:
    """Resolve interpolations, convert to dataclasses and run the semantic checks."""
    try:
        train_cfg = OmegaConf.to_object(cfg)
    except MissingMandatoryValue as err:
        key = getattr(err, "full_key", None) or "a field"
        raise ConfigError(
            f"{key} has no value (??? in the recipe): set it on the command line, e.g. {key}=..."
            + (" (a Hugging Face checkpoint directory)" if key == "model.pretrained" else "")
        ) from None
    assert isinstance(train_cfg, TrainConfig), type(train_cfg)
    validate(train_cfg)
    return train_cfg


def load_recipe(recipe: str = DEFAULT_RECIPE, overrides: list[str] | None = None) -> TrainConfig:
    return to_train_config(compose_recipe(recipe, overrides))
