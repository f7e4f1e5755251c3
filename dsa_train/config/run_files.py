"""What `dsa-train` writes into the run directory about the run itself: `.hydra/` (the composed
recipe and the command-line overrides, as Hydra would save them) and `train.log`.

Hydra writes both before the task starts, so a run that is then refused (the run directory is
locked by another run, the recipe differs from the checkpoint's, the directory is read-only)
would already have rewritten `.hydra/config.yaml` and appended to `train.log` of the run it was
refused for. `dsa-train` therefore turns Hydra's output off (`hydra.output_subdir=null`, a
console-only `hydra/job_logging`, `hydra.run.dir=.`; dsa_train/cli.py) and the trainer calls
`record_run_start(run_dir)` on rank 0 once it holds the run lock and the resume checks passed.
Nothing reads `.hydra/` back to learn what was trained: readers take the recipe from the
checkpoint's `trainer_state.json` (checkpoint/training.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"
LOG_FILE = "train.log"
HYDRA_DIR = ".hydra"

# set by dsa_train/cli.py inside the Hydra app: (composed recipe as YAML, overrides, Hydra config as YAML)
_pending: dict | None = None


def remember(config_yaml: str, overrides: list[str], hydra_yaml: str | None = None) -> None:
    global _pending
    _pending = {"config.yaml": config_yaml, "overrides.yaml": overrides, "hydra.yaml": hydra_yaml}


def forget() -> None:
    global _pending
    _pending = None


def record_run_start(run_dir: str | Path) -> None:
    """Write `.hydra/` and start `train.log` in `run_dir` (the command line's run only; a run
    started from Python, without Hydra, writes neither). Called once the run goes ahead."""
    global _pending
    if _pending is None:
        return
    import yaml

    pending, _pending = _pending, None
    run_dir = Path(run_dir)
    hydra_dir = run_dir / HYDRA_DIR
    hydra_dir.mkdir(parents=True, exist_ok=True)
    (hydra_dir / "config.yaml").write_text(pending["config.yaml"])
    (hydra_dir / "overrides.yaml").write_text(yaml.safe_dump(list(pending["overrides.yaml"]), sort_keys=False))
    if pending.get("hydra.yaml"):
        (hydra_dir / "hydra.yaml").write_text(pending["hydra.yaml"])
    handler = logging.FileHandler(run_dir / LOG_FILE, mode="a")
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    handler.set_name("dsa_train_run_log")
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == "dsa_train_run_log"]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)


def close_run_log() -> None:
    root = logging.getLogger()
    for h in [h for h in root.handlers if h.get_name() == "dsa_train_run_log"]:
        root.removeHandler(h)
        h.close()


# `hydra/job_logging=dsa_train`: Hydra's default console format, no file (train.log: above)
JOB_LOGGING = {
    "version": 1,
    "formatters": {"simple": {"format": LOG_FORMAT}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "simple", "stream": "ext://sys.stdout"}},
    "root": {"level": "INFO", "handlers": ["console"]},
    "disable_existing_loggers": False,
}
