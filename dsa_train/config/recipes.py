"""Locating, composing and checking recipes outside the command line (tests, notebooks)."""

from __future__ import annotations

import copy
from importlib import resources
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException, ValidationError

from dsa_train.config.schema import TrainConfig
from dsa_train.config.store import register_configs
from dsa_train.config.profile import apply_profile
from dsa_train.config.validate import ConfigError, collect_problems, environment_problems, problem, validate

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


def to_train_config(cfg: DictConfig, check_environment: bool = False, world_size: int | None = None) -> TrainConfig:
    """Resolve interpolations, convert to dataclasses, apply the profile and run the semantic
    checks (with `check_environment`, also those against this machine and launch). One
    ConfigError lists every problem found, missing values included."""
    with collect_problems():
        missing = _missing_keys(OmegaConf.to_container(cfg, resolve=False))
        for key in missing:
            problem(f"{key} has no value (??? in the recipe): set it on the command line, e.g. {key}=..."
                     + (" (a Hugging Face checkpoint directory)" if key == "model.pretrained" else ""))
        if missing:  # check the rest as if they were null
            cfg = copy.deepcopy(cfg)
            for key in missing:
                OmegaConf.update(cfg, key, None, force_add=True)
        try:
            train_cfg = OmegaConf.to_object(cfg)
        except (MissingMandatoryValue, ValidationError):
            return None  # a missing field that cannot be null: reported above
        except OmegaConfBaseException as err:  # an interpolation that does not resolve: run_name='${nope}'
            message = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
            problem(f"{getattr(err, 'full_key', None) or 'the recipe'}: {message} — an interpolation ${{...}} "
                    "names a key of the composed recipe (`dsa-train --cfg job` prints it)")
            return None
        assert isinstance(train_cfg, TrainConfig), type(train_cfg)
        apply_profile(train_cfg)
        validate(train_cfg)
        if check_environment:
            environment_problems(train_cfg, model_known="model.pretrained" not in missing, world_size=world_size)
    return train_cfg


def _missing_keys(node, prefix: str = "") -> list[str]:
    """Dotted keys whose value is ??? (not resolving interpolations, which may point at them)."""
    if isinstance(node, dict):
        return [k for key, value in node.items() for k in _missing_keys(value, f"{prefix}{key}.")]
    if isinstance(node, list):
        return [k for i, value in enumerate(node) for k in _missing_keys(value, f"{prefix}{i}.")]
    return [prefix[:-1]] if node == "???" else []


def load_recipe(recipe: str = DEFAULT_RECIPE, overrides: list[str] | None = None) -> TrainConfig:
    return to_train_config(compose_recipe(recipe, overrides))
