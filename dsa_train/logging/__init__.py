"""Run logging: Weights & Biases, local progress display, throughput / MFU / memory."""

from dsa_train.logging.progress import StageProgress
from dsa_train.logging.wandb_offline import find_run_file, read_config, read_history
from dsa_train.logging.wandb_run import WandbRun, resolve_mode

__all__ = ["StageProgress", "WandbRun", "find_run_file", "read_config", "read_history", "resolve_mode"]
