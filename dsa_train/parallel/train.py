"""Distributed training entry point, one process per rank (what the torchrun and Slurm launchers run):

    torchrun --nproc_per_node 2 -m dsa_train.parallel.train --config-name demo parallel.zero_stage=2

The same Hydra recipes and overrides as `dsa-train`; the recipe's `parallel` group is checked
against the world size at start-up. Hydra's output directory is the run directory (the same
path on every rank, never `${now:...}`).
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> int:
    import hydra
    from omegaconf import DictConfig
    from omegaconf.errors import MissingMandatoryValue

    from dsa_train.cli import hydra_argv
    from dsa_train.config import ConfigError, DEFAULT_RECIPE, recipes_dir, register_configs, to_train_config

    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not _cuda() else "cuda")
    register_configs()
    argv = sys.argv[1:] if argv is None else list(argv)
    # only rank 0 lets Hydra write its .hydra/ files and log file into the shared run directory
    if int(os.environ.get("RANK", "0")) != 0:
        argv = [*argv, "hydra.output_subdir=null", "hydra/job_logging=stdout"]

    @hydra.main(config_path=str(recipes_dir()), config_name=DEFAULT_RECIPE, version_base=None)
    def train_main(cfg: DictConfig) -> None:
        from dsa_train.parallel.trainer import train

        try:
            train_cfg = to_train_config(cfg)
        except (ConfigError, MissingMandatoryValue) as err:
            sys.exit(f"dsa-train: invalid recipe: {err}")
        try:
            train(train_cfg)
        except ConfigError as err:
            sys.exit(f"dsa-train: {err}")
        finally:
            from dsa_train.parallel.groups import destroy_parallel

            destroy_parallel()

    saved = sys.argv
    sys.argv = [saved[0] if saved else "dsa-train", *hydra_argv(argv)]
    try:
        train_main()
    finally:
        sys.argv = saved
    return 0


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
