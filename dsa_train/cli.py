"""`dsa-train`: the console script.

    dsa-train                               train with the demo recipe
    dsa-train [--config-name R | recipe=R] [key=value ...] [Hydra flags]
                                            train with recipe R (`--cfg job` prints it)
    dsa-train prepare-data ...              pre-tokenize a corpus (dsa_train.data.prepare)
    dsa-train export|inspect|make-tiny-checkpoint ...
                                            checkpoint tools (dsa_train.checkpoint.cli)
"""

from __future__ import annotations

import importlib
import logging
import sys

# subcommand -> module with `main(argv: list[str]) -> int | None`
SUBCOMMANDS = {
    "prepare-data": "dsa_train.data.prepare",
    "export": "dsa_train.checkpoint.cli",
    "inspect": "dsa_train.checkpoint.cli",
    "make-tiny-checkpoint": "dsa_train.checkpoint.cli",
    "launch": "dsa_train.parallel.launch",  # torchrun / Slurm (sbatch from the recipe's cluster group)
    "plan": "dsa_train.parallel.plan",  # per-GPU memory and step-time estimate of a recipe
    "kernels": "dsa_kernels.compile_report",  # `kernels report --arch sm_90a`: compile gate without a GPU
    "report": "dsa_train.logging.report",  # per-stage summary and PNG plots of a run
}

log = logging.getLogger("dsa_train")


def run_subcommand(name: str, argv: list[str]) -> int:
    module_name = SUBCOMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name != module_name:
            raise
        print(f"dsa-train {name}: this installation has no {module_name} module", file=sys.stderr)
        return 2
    # checkpoint tools share one module: they get the subcommand name as their first argument
    args = [name, *argv] if module_name == "dsa_train.checkpoint.cli" else argv
    return int(module.main(args) or 0)


def hydra_argv(argv: list[str]) -> list[str]:
    """`recipe=NAME` is shorthand for `--config-name NAME`."""
    out = []
    for arg in argv:
        if arg.startswith("recipe="):
            out += ["--config-name", arg.split("=", 1)[1]]
        else:
            out.append(arg)
    return out


def run_hydra(argv: list[str], train) -> int:
    """Compose the recipe from `argv` as a Hydra app, check it, and call `train(TrainConfig)`.
    A bad recipe or a ConfigError raised by the trainer exits with its message, no traceback.
    (`dsa-train` and the per-rank `python -m dsa_train.parallel.train` both run through here.)"""
    import hydra
    from omegaconf import DictConfig
    from omegaconf.errors import MissingMandatoryValue

    from dsa_train.config import ConfigError, DEFAULT_RECIPE, recipes_dir, register_configs, to_train_config

    register_configs()

    @hydra.main(config_path=str(recipes_dir()), config_name=DEFAULT_RECIPE, version_base=None)
    def train_main(cfg: DictConfig) -> None:
        try:
            train_cfg = to_train_config(cfg, check_environment=True)
        except (ConfigError, MissingMandatoryValue) as err:
            sys.exit(f"dsa-train: invalid recipe: {err}")
        try:
            train(train_cfg)
        except ConfigError as err:
            sys.exit(f"dsa-train: {err}")

    saved_argv = sys.argv
    sys.argv = [saved_argv[0] if saved_argv else "dsa-train", *hydra_argv(argv)]
    try:
        train_main()
    finally:
        sys.argv = saved_argv
    return 0


def train_app(argv: list[str]) -> int:
    from dsa_train.engine import train
    from dsa_train.runtime import limit_heap_fragmentation

    limit_heap_fragmentation()  # chunked DSA ops otherwise fragment glibc's heap (dsa_train/runtime.py)

    return run_hydra(argv, train)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SUBCOMMANDS:
        return run_subcommand(argv[0], argv[1:])
    return train_app(argv)


if __name__ == "__main__":
    sys.exit(main())
