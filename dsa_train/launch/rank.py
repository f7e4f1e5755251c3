"""Distributed training entry point, one process per rank (what the torchrun and Slurm launchers run):

    torchrun --nproc_per_node 2 -m dsa_train.launch.rank --config-name demo parallel.zero_stage=2

The same Hydra recipes and overrides as `dsa-train`; the recipe's `parallel` group is checked
against the world size at start-up. Hydra's output directory is the run directory (the same
path on every rank, never `${now:...}`).
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> int:
    from dsa_train.errors import exit_if_failed_earlier, run_reporting

    # a torchrun restart after an error that a restart cannot fix (bad recipe, full disk, ...):
    # exit 2 before loading anything (dsa_train/errors.py)
    code = run_reporting(exit_if_failed_earlier)
    if code:
        return code
    from dsa_train.cli import run_hydra
    from dsa_train.runtime import limit_heap_fragmentation, quiet_third_party

    limit_heap_fragmentation()  # chunked DSA ops otherwise fragment glibc's heap (dsa_train/runtime.py)
    rank = int(os.environ.get("RANK", "0"))
    quiet_third_party(rank)  # warnings once per job (rank 0), none the user cannot act on

    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not _cuda() else "cuda")
    # A W&B service inherited from the launching process (WANDB_SERVICE, set by any process that
    # called wandb.init) outlives a killed rank and keeps its run open: the restarted rank 0 then
    # fails with "run ID ... is in use". Each rank 0 starts its own service, which ends with it.
    os.environ.pop("WANDB_SERVICE", None)
    argv = sys.argv[1:] if argv is None else list(argv)
    # only rank 0 lets Hydra write its .hydra/ files and log file into the shared run directory;
    # the other ranks log warnings and errors to stdout, filtered in `_train`
    if rank != 0:
        argv = [*argv, "hydra.output_subdir=null", "hydra/job_logging=stdout", "hydra.job_logging.root.level=WARNING"]
    return run_hydra(argv, _train)


def _train(cfg) -> None:
    from dsa_train.runtime import filter_other_rank_logs, log_all_ranks
    from dsa_train.signals import exit_if_preempted_earlier
    from dsa_train.parallel.groups import destroy_parallel
    from dsa_train.trainer.trainer import train

    # Ranks other than 0 show errors and the warnings only they can give (runtime.warn_rank_local);
    # a warning every rank gives is rank 0's. DSA_LOG_ALL_RANKS=1: every warning of every rank.
    if int(os.environ.get("RANK", "0")) != 0 and not log_all_ranks():
        filter_other_rank_logs()  # on Hydra's handlers, configured by now
    exit_if_preempted_earlier(cfg.run_dir)
    try:
        train(cfg, distributed=True)
    finally:
        destroy_parallel()


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
