"""Weights & Biases: online when configured, offline by default without an API key, or off.

- mode auto: online if WANDB_API_KEY is set (or `wandb login` stored a key), else offline.
- A resumed training run passes the W&B run id saved in its checkpoint, so it continues the
  same W&B run (`resume="allow"`).
- If an online run cannot start (no network, bad key), it falls back to offline and training
  goes on; `wandb sync <run dir>` uploads it later. If offline cannot start either (e.g. a shared
  W&B service holding a stale run of the same id), it retries with a service of its own, and
  failing that trains on without W&B, saying so at error level. W&B never stops a run.

Beside W&B, every logged value also goes to `<run_dir>/metrics.jsonl` (one JSON object per
line: `{"step": N, "metrics": {...}}`; a first `{"run": {...}}` line per start or resume with the
run's stages and the W&B run's directory), whatever the W&B mode: `dsa-train report RUN_DIR`
reads it, and it needs no W&B account.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from dsa_train.config import LoggingConfig, WandbMode

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


class MetricsLog:
    """Appends logged values to a JSONL file (flushed per line, so a crash keeps what was logged)."""

    def __init__(self, path: str | os.PathLike, header: dict[str, Any]):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "a", encoding="utf-8")
        self._write({"run": {**header, "time": time.time()}})

    def _write(self, record: dict) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record, default=_json_value) + "\n")
            self.file.flush()

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._write({"step": step, "metrics": {k: _json_value(v) for k, v in metrics.items()}})

    def summary(self, values: dict[str, float]) -> None:
        self._write({"summary": {k: _json_value(v) for k, v in values.items()}})

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def _json_value(value):
    value = float(value) if hasattr(value, "__float__") and not isinstance(value, (int, bool)) else value
    return None if isinstance(value, float) and not math.isfinite(value) else value


def resolve_mode(mode: WandbMode) -> str:
    if mode != WandbMode.auto:
        return mode.value
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    if os.environ.get("WANDB_MODE") in ("online", "offline", "disabled"):
        return os.environ["WANDB_MODE"]
    return "offline"


class WandbRun:
    """A W&B run, or nothing when disabled. `id` is None when disabled."""

    def __init__(self, cfg: LoggingConfig, config: dict[str, Any], run_id: str | None = None,
                 metrics_path: str | os.PathLike | None = None):
        self.mode = resolve_mode(cfg.wandb_mode)
        self.run = None
        self.metrics = None
        try:
            self._init_wandb(cfg, config, run_id)
        finally:
            if metrics_path is not None:
                self.metrics = MetricsLog(metrics_path, {
                    "run_name": config.get("run_name"), "stages": config.get("stages", {}),
                    "wandb_mode": self.mode, "wandb_run_dir": str(Path(self.dir).parent) if self.dir else None,
                    "wandb_run_id": self.id,
                })

    def _init_wandb(self, cfg: LoggingConfig, config: dict[str, Any], run_id: str | None) -> None:
        if self.mode == "disabled":
            return
        import wandb

        os.makedirs(cfg.wandb_dir, exist_ok=True)
        init_kwargs = dict(
            project=cfg.project,
            entity=cfg.entity,
            name=cfg.run_name,
            tags=list(cfg.tags) or None,
            dir=cfg.wandb_dir,
            config=config,
            id=run_id,
            resume="allow" if run_id else None,
        )
        # wandb_init_timeout_s bounds the wait for the W&B *server*; an offline init only starts the
        # local W&B service and keeps W&B's own timeout (a short one fails it on a loaded machine)
        online_settings = wandb.Settings(init_timeout=cfg.wandb_init_timeout_s)
        try:
            self.run = wandb.init(mode=self.mode, settings=online_settings if self.mode == "online" else None,
                                  **init_kwargs)
            return
        except Exception as err:  # network, auth, server: never stop training for W&B
            if self.mode == "online":
                log.warning("W&B online init failed (%s); logging offline instead", err)
                self.mode = "offline"
                try:
                    self.run = wandb.init(mode="offline", **init_kwargs)
                    return
                except Exception as offline_err:
                    err = offline_err
            log.warning("W&B %s init failed (%s); retrying with a W&B service of this process", self.mode, err)
        # a W&B service shared through WANDB_SERVICE may hold a stale run (e.g. of a killed
        # process with the same run id); start one of our own
        if os.environ.pop("WANDB_SERVICE", None) is not None:
            wandb.teardown()  # drop the connection to the shared service; the next init starts ours
        try:
            self.run = wandb.init(mode=self.mode, settings=online_settings if self.mode == "online" else None,
                                  **init_kwargs)
        except Exception as err:
            log.error("W&B %s init failed again (%s); training goes on WITHOUT W&B logging (metrics are "
                      "still in the log and the checkpoints' trainer_state.json)", self.mode, err)
            self.mode = "disabled"
            self.run = None

    @property
    def id(self) -> str | None:
        return self.run.id if self.run is not None else None

    @property
    def dir(self) -> str | None:
        return self.run.dir if self.run is not None else None

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.metrics is not None:
            self.metrics.log(metrics, step)
        if self.run is not None:
            self.run.log(metrics, step=step)

    def set_summary(self, values: dict[str, float]) -> None:
        if self.metrics is not None:
            self.metrics.summary(values)
        if self.run is not None:
            for key, value in values.items():
                self.run.summary[key] = value

    def finish(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self.run is not None:
            self.run.finish()
            self.run = None
