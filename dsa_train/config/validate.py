"""Checks that a structured config cannot express by types alone. Every problem names its key.

`validate` reports every problem of a recipe at once: each `_require` that fails inside
`collect_problems()` adds one line, and the block raises one ConfigError listing them all (a
user fixes them in one attempt, not one per run). Outside such a block `_require` raises at once.
`environment_problems` adds what depends on the machine the run starts on (CUDA present, one
process or a launcher, the model's context length); the command line checks both together.
`resolve_sizes` checks the `parallel` group against a world size and gives the layout's sizes
(`ParallelSizes`), which `dsa_train.parallel.groups` builds its process groups from.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass

from dsa_train.config.schema import Attention, Device, ParallelConfig, TrainConfig
from dsa_train.errors import DSATrainError
from dsa_train.stage import stage_kind


class ConfigError(DSATrainError, ValueError):
    """A recipe problem; `problems` holds one `key: message` line per problem (dsa_train/errors.py:
    printed as one line per problem, exit 2)."""

    def __init__(self, message: str, problems: list[str] | None = None, fix: str | None = None):
        self.problems = list(problems) if problems else [f"{message} — {fix}" if fix else message]
        super().__init__(message, fix=fix)

    @classmethod
    def of(cls, problems: list[str]) -> "ConfigError":
        if len(problems) == 1:
            return cls(problems[0], problems)
        lines = "\n".join(f"  - {p}" for p in problems)
        return cls(f"{len(problems)} problems in the recipe (fix them all, then run again):\n{lines}", problems)


_collected: list[str] | None = None  # problems of the open collect_problems() block


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        problem(f"{key}: {message}")


def problem(text: str) -> None:
    """One problem (a line naming its key): raised at once, or collected inside collect_problems()."""
    if _collected is None:
        raise ConfigError(text)
    _collected.append(text)


@contextlib.contextmanager
def collect_problems():
    """Collect the failed `_require`s (and ConfigErrors raised) inside the block; at its end raise
    one ConfigError naming them all. Nested blocks add to the outer one."""
    global _collected
    if _collected is not None:  # nested: the outer block reports
        yield _collected
        return
    _collected = problems = []
    try:
        try:
            yield problems
        except ConfigError as err:
            problems.extend(err.problems)
    finally:
        _collected = None
    if problems:
        raise ConfigError.of(list(dict.fromkeys(problems)))


@dataclass(frozen=True)
class ParallelSizes:
    world: int
    tensor: int = 1
    context: int = 1
    expert: int = 1
    data: int = 1

    @property
    def dense_dp(self) -> int:
        """Ranks holding replicas of a dense parameter (gradients averaged over them)."""
        return self.context * self.data

    @property
    def expert_dp(self) -> int:
        return self.dense_dp // self.expert


def resolve_sizes(parallel: ParallelConfig, world_size: int, launch: str = "launch {} ranks") -> ParallelSizes:
    """Check the recipe's `parallel` group against the world size; infer data_parallel=-1.
    Raises ConfigError naming the sizes and the fix; `launch`: how the caller's user gets another
    world size ({} the ranks; `dsa-train plan`: --world N)."""
    tp, cp, ep, dp = parallel.tensor_parallel, parallel.context_parallel, parallel.expert_parallel, parallel.data_parallel
    for key, v in (("tensor_parallel", tp), ("context_parallel", cp), ("expert_parallel", ep)):
        if v < 1:
            raise ConfigError(f"parallel.{key}={v}: must be >= 1")
    if world_size < 1:
        raise ConfigError(f"world size {world_size}: a layout needs at least one rank",
                          fix="launch one or more ranks (cluster.nodes and cluster.procs_per_node / gpus_per_node >= 1)")
    if parallel.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"parallel.zero_stage={parallel.zero_stage}: must be 0, 1, 2 or 3")
    if world_size % (tp * cp) != 0:
        raise ConfigError(
            f"world size {world_size} is not divisible by parallel.tensor_parallel * parallel.context_parallel = "
            f"{tp} * {cp} = {tp * cp}; {launch.format(f'a multiple of {tp * cp}')} or lower tensor/context parallel"
        )
    inferred = world_size // (tp * cp)
    if dp == -1:
        dp = inferred
    elif dp != inferred:
        raise ConfigError(
            f"parallel.data_parallel={dp} but world size {world_size} / (tensor_parallel {tp} * context_parallel "
            f"{cp}) = {inferred}; set parallel.data_parallel={inferred} (or -1 to infer it), or "
            f"{launch.format(tp * cp * dp)}"
        )
    if (cp * dp) % ep != 0:
        raise ConfigError(
            f"parallel.expert_parallel={ep} must divide context_parallel * data_parallel = {cp} * {dp} = {cp * dp} "
            f"(world {world_size}, tensor_parallel {tp}); pick expert_parallel among the divisors of {cp * dp}"
        )
    return ParallelSizes(world=world_size, tensor=tp, context=cp, expert=ep, data=dp)


def validate(cfg: TrainConfig) -> None:
    with collect_problems():
        _validate(cfg)


def environment_problems(cfg: TrainConfig, model_known: bool = True, world_size: int | None = None) -> None:
    """Checks against this machine and launch: CUDA availability, the parallel layout against the
    world size (`world_size`, else $WORLD_SIZE: one process needs every size 1), sequences longer than the model's positions (read from model.pretrained's
    config.json, or the from-scratch arch; not checked when `model_known` is false). Inside collect_problems() they add to the list."""
    if cfg.device == Device.cuda:
        import torch

        _require(torch.cuda.is_available(), "device",
                 "cuda requested but no CUDA device is available; use device=cpu (or profile=smoke)")
    world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        try:
            sizes = resolve_sizes(cfg.parallel, world)
        except ConfigError as err:
            problem(str(err))
        else:
            check_global_batches(cfg, sizes.data)
    else:
        p = cfg.parallel
        for key in ("tensor_parallel", "context_parallel", "expert_parallel"):
            size = getattr(p, key)
            _require(size == 1, f"parallel.{key}",
                     f"{size}: one process runs one rank; set it to 1 (parallel=single or profile=smoke), "
                     "or start the recipe with `dsa-train launch`")
        _require(p.data_parallel in (-1, 1), "parallel.data_parallel",
                 f"{p.data_parallel}: one process runs one rank; set it to 1 or -1, or use `dsa-train launch`")
    max_pos = _max_positions(cfg) if model_known else None
    if max_pos is not None:
        check_sequence_fits(cfg, max_pos)
    if model_known:
        check_tokenizer_identity(cfg)
    check_output_paths(cfg)


def check_output_paths(cfg: TrainConfig) -> None:
    """Every folder the run will write (run_dir, checkpoint.dir, logging.wandb_dir, data.cache_dir)
    can be a folder: none of them, nor a folder above one, is a regular file. Checked before any
    work (a W&B folder under a file was a traceback after the data and the model were loaded)."""
    from pathlib import Path

    said = set()  # one line per file in the way (checkpoint.dir and the W&B folder lie under run_dir)
    for key, value in (("run_dir", cfg.run_dir), ("checkpoint.dir", cfg.checkpoint.dir),
                       ("logging.wandb_dir", cfg.logging.wandb_dir), ("data.cache_dir", cfg.data.cache_dir)):
        if not value:
            continue
        path = Path(str(value)).expanduser()
        blocker = next((p for p in [path, *path.parents] if p.exists() and not p.is_dir()), None)
        if blocker is not None and blocker not in said:
            said.add(blocker)
            problem(f"{key}: {value} cannot be a folder: {blocker} is a file — set {key} to a folder path that does not "
                    "pass through a file")


def _tokenizer_json(spec) -> "Path | None":
    """The tokenizer.json `data.tokenizer` names (None / "bundled": the bundled one), if it exists.
    (dsa_train.data.tokenizer resolves it the same way; not imported here: config must not import data.)"""
    from pathlib import Path

    if spec in (None, "bundled"):
        return Path(__file__).resolve().parents[1] / "assets" / "tokenizer" / "tokenizer.json"
    path = Path(str(spec)).expanduser()
    path = path / "tokenizer.json" if path.is_dir() else path
    return path if path.is_file() and path.suffix == ".json" else None


def _token_ids(tokenizer_json) -> tuple[str, int] | None:
    """(canonical JSON of what decides the ids: model incl. vocabulary and merges, added tokens,
    normalizer, pre-tokenizer; vocabulary size) of a tokenizer.json, None if unreadable."""
    import json

    try:
        data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    model = data.get("model") or {}
    vocab = model.get("vocab") or {}
    ids = set(vocab.values()) if isinstance(vocab, dict) else set(range(len(vocab)))
    ids |= {t.get("id") for t in data.get("added_tokens") or [] if isinstance(t, dict)}
    key = {k: data.get(k) for k in ("model", "added_tokens", "normalizer", "pre_tokenizer")}
    return json.dumps(key, sort_keys=True, ensure_ascii=False), len(ids)


def check_tokenizer_identity(cfg: TrainConfig) -> None:
    """data.tokenizer against model.pretrained's own tokenizer.json, by content (not by size: a
    tokenizer with the same vocabulary size and other ids trains without an error, on data the model
    reads as other tokens, and the export then ships the data's tokenizer). Refused unless
    data.allow_tokenizer_mismatch=true, which the run's recipe records."""
    from pathlib import Path

    if cfg.model.pretrained is None or cfg.data.allow_tokenizer_mismatch:
        return
    own = Path(cfg.model.pretrained).expanduser() / "tokenizer.json"
    data_json = _tokenizer_json(cfg.data.tokenizer)
    if not own.is_file() or data_json is None:  # a missing data.tokenizer is reported where it is loaded
        return
    if data_json.resolve() == own.resolve() or data_json.read_bytes() == own.read_bytes():
        return
    mine, theirs = _token_ids(data_json), _token_ids(own)
    if mine is None or theirs is None or mine[0] == theirs[0]:
        return
    size = (f"the same vocabulary size ({mine[1]}) but other ids" if mine[1] == theirs[1]
            else f"vocabulary {mine[1]} vs {theirs[1]}")
    which = "data.tokenizer" if cfg.data.tokenizer not in (None, "bundled") else "data.tokenizer (null: the bundled one)"
    problem(f"{which}: {data_json} is not the tokenizer of model.pretrained ({own}): {size}, so the model would read "
            f"the data as other tokens — set data.tokenizer={cfg.model.pretrained} (the checkpoint's own), or "
            "data.allow_tokenizer_mismatch=true to train with this one anyway (the run's recipe records it)")


def check_global_batches(cfg: TrainConfig, data_parallel: int) -> None:
    """Every stage's global batch splits into whole micro-batches over `data_parallel` ranks (the
    launcher's check before starting workers and the layout's at start-up)."""
    for name, stage in cfg.stages.items():
        per_step = cfg.data.micro_batch_size * data_parallel
        if per_step < 1:  # checked (and said) elsewhere: never divide by it
            continue
        _require(stage.global_batch_size % per_step == 0, f"stages.{name}.global_batch_size",
                 f"{stage.global_batch_size} is not a multiple of data.micro_batch_size * data-parallel size "
                 f"= {cfg.data.micro_batch_size} * {data_parallel}")


def check_sequence_fits(cfg: TrainConfig, max_positions: int) -> None:
    """data.seq_len within the model's max_position_embeddings (from its config.json before the
    run, from the loaded model at start-up)."""
    _require(cfg.data.seq_len <= max_positions, "data.seq_len",
             f"{cfg.data.seq_len}-token sequences are longer than the model's max_position_embeddings="
             f"{max_positions}; lower data.seq_len or use a model with longer context (YaRN)")


def missing_pretrained(path) -> str:
    """Why `path` is not a model yet, and what makes it one: the export of a run that has not
    finished (the sparse stage started before the warm-up) says to run that recipe first."""
    from pathlib import Path

    path = Path(path)
    run_dir = path.parent
    is_run = (run_dir / "checkpoints").is_dir() or (run_dir / ".hydra").is_dir()
    if path.name == "export" and (is_run or not run_dir.exists()):
        name = run_dir.name
        recipe = name.split("-")[0] if name.startswith("v3.2_") else name
        if is_run and any((run_dir / "checkpoints").glob("step_*")):
            return (f"{path} does not exist yet: the run {run_dir} has not finished (or did not export) — finish it "
                    f"(run its command again: it resumes), or export its newest checkpoint: `dsa-train export {run_dir} {path}`")
        return (f"{path} does not exist yet: it is the export of the run {run_dir}, which has not run — run that recipe "
                f"first (e.g. `dsa-train --config-name {recipe} ...`; the sparse stage starts from the warm-up's export), "
                "or set model.pretrained to a Hugging Face checkpoint directory")
    if not path.exists():
        return (f"{path} does not exist — pass a Hugging Face checkpoint directory (DeepSeek-V3 / V3.1 / V3.2 layout), "
                "or `dsa-train make-tiny-checkpoint DIR` for a rehearsal")
    return (f"{path} has no config.json — pass a Hugging Face checkpoint directory (DeepSeek-V3 / V3.1 / V3.2 layout)")


def _max_positions(cfg: TrainConfig) -> int | None:
    import json
    from pathlib import Path

    if cfg.model.pretrained is not None:
        config_json = Path(cfg.model.pretrained) / "config.json"
        if not config_json.is_file():
            problem(f"model.pretrained: {missing_pretrained(Path(cfg.model.pretrained))}")
            return None
        try:
            return int(json.loads(config_json.read_text())["max_position_embeddings"])
        except (ValueError, KeyError, TypeError):
            return None
    if "max_position_embeddings" in cfg.model.arch:
        return int(cfg.model.arch["max_position_embeddings"])
    from dsa_train.model.config import tiny_config

    return tiny_config().max_position_embeddings


def _validate(cfg: TrainConfig) -> None:
    _require(bool(cfg.stages), "stages", "a recipe needs at least one stage")
    _require(
        cfg.model.pretrained is None or not cfg.model.arch,
        "model.arch",
        "architecture fields only apply to a from-scratch model (model.pretrained is set)",
    )
    _require(bool(cfg.data.sources), "data.sources",
             "no data sources given: set data.sources=[/data/*.jsonl] (files, globs or hub names; "
             "[bundled] for the bundled corpus)")
    _require(cfg.data.seq_len >= 2, "data.seq_len", f"must be >= 2, got {cfg.data.seq_len}")
    _require(cfg.data.micro_batch_size >= 1, "data.micro_batch_size", "must be >= 1")
    _require(cfg.probe_batches >= 0, "probe_batches", "must be >= 0")
    _require(cfg.logging.log_every >= 1, "logging.log_every", "must be >= 1")
    _require(cfg.checkpoint.every_n_steps >= 0, "checkpoint.every_n_steps", "must be >= 0")
    _require(cfg.checkpoint.keep_last >= 0, "checkpoint.keep_last", "must be >= 0")
    _require(cfg.checkpoint.resume in (True, False, "auto"), "checkpoint.resume",
             f"must be auto, true or false, got {cfg.checkpoint.resume!r}")
    _require(cfg.fault_tolerance.max_consecutive_nonfinite >= 1, "fault_tolerance.max_consecutive_nonfinite",
             "must be >= 1")
    _check_signals(cfg.fault_tolerance.preemption_signals)
    _require(len(cfg.optim.betas) == 2, "optim.betas", "needs two values")
    _require(cfg.optim.grad_clip >= 0, "optim.grad_clip", "must be >= 0 (0 disables)")
    _require(cfg.cluster.nodes >= 1, "cluster.nodes", f"must be >= 1, got {cfg.cluster.nodes}")
    _require(cfg.cluster.gpus_per_node >= 0, "cluster.gpus_per_node",
             f"must be >= 0 (0: CPU nodes, with procs_per_node), got {cfg.cluster.gpus_per_node}")
    _require(cfg.cluster.procs_per_node is None or cfg.cluster.procs_per_node >= 1, "cluster.procs_per_node",
             f"must be >= 1 or null (one per GPU), got {cfg.cluster.procs_per_node}")
    _require(cfg.cluster.max_restarts >= 0, "cluster.max_restarts", "must be >= 0 (0: a crashed rank ends the job)")
    _require(cfg.cluster.open_files is None or cfg.cluster.open_files >= 1024, "cluster.open_files",
             f"must be >= 1024 or null (the node's hard limit), got {cfg.cluster.open_files}")
    for key in ("nccl_socket_ifname", "gloo_socket_ifname"):
        value = getattr(cfg.cluster, key)
        _require(value is None or re.fullmatch(r"[\^=]?[A-Za-z0-9_.:,^-]+", str(value)) is not None, f"cluster.{key}",
                 f"{value!r} is not an interface list: give names such as ib0 or ^docker,lo (no spaces or quotes)")
    for size_key in ("tensor_parallel", "context_parallel", "expert_parallel"):
        _require(getattr(cfg.parallel, size_key) >= 1, f"parallel.{size_key}", "must be >= 1")
    _check_eval(cfg)
    for name, stage in cfg.stages.items():
        key = f"stages.{name}"
        _require(stage.steps >= 1, f"{key}.steps", "must be >= 1")
        _require(stage.lr > 0, f"{key}.lr", "must be > 0")
        _require(stage.warmup_steps >= 0, f"{key}.warmup_steps", "must be >= 0")
        _check_stage_together(key, stage)
        _require(0.0 <= stage.min_lr_ratio <= 1.0, f"{key}.min_lr_ratio", "must be within [0, 1]")
        _require(stage.lm_loss_coef >= 0 and stage.indexer_loss_coef >= 0,
                 f"{key}.lm_loss_coef", "loss coefficients must be >= 0")
        for field_name, message in stage_kind(stage.trainable).config_errors(stage):  # the kind's own rules
            _require(False, f"{key}.{field_name}", message)
        _require(stage.mtp_loss_coef >= 0, f"{key}.mtp_loss_coef", "loss coefficients must be >= 0")
        _require(stage.mtp_loss_coef == 0 or stage.lm_loss_coef > 0, f"{key}.mtp_loss_coef",
                 "the MTP loss needs the LM head and labels: set lm_loss_coef > 0 or mtp_loss_coef: 0")
        _require(stage.lm_loss_coef > 0 or stage.indexer_loss_coef > 0,
                 f"{key}.lm_loss_coef", "lm_loss_coef and indexer_loss_coef are both 0")
        _require(stage.global_batch_size >= 1, f"{key}.global_batch_size", "must be >= 1")
        _require(cfg.data.micro_batch_size < 1 or stage.global_batch_size % cfg.data.micro_batch_size == 0,
                 f"{key}.global_batch_size",
                 f"{stage.global_batch_size} is not a multiple of data.micro_batch_size="
                 f"{cfg.data.micro_batch_size}")
        if stage.attention == Attention.dense:
            _require(stage.topk_recall_queries == 0, f"{key}.topk_recall_queries",
                     "top-k recall is measured in sparse stages only")
        if stage.topk is not None:
            _require(stage.topk >= 1, f"{key}.topk", "must be >= 1")
        _require(stage.topk_recall_queries >= 0, f"{key}.topk_recall_queries", "must be >= 0")


def _check_eval(cfg: TrainConfig) -> None:
    """The eval group (dsa_train/eval/in_training.py): checked when it is on."""
    ev = cfg.eval
    if not ev.enabled:
        return
    _require(ev.every_n_steps >= 0, "eval.every_n_steps", f"{ev.every_n_steps}: must be >= 0 (0: at stage ends only)")
    _require(ev.num_sequences >= 1, "eval.num_sequences", f"{ev.num_sequences}: must be >= 1 held-out sequence")
    _require(bool(ev.modes), "eval.modes", "needs at least one of dense, sparse, oracle")
    _require(not cfg.data.streaming, "eval.enabled",
             "a streaming loader (data.streaming=true) cannot hold rows out; set data.streaming=false, or "
             "eval.enabled=false and run `dsa-train eval` on the export")
    if ev.topk is not None:
        _require(1 <= ev.topk < cfg.data.seq_len, "eval.topk",
                 f"{ev.topk}: must be in [1, data.seq_len={cfg.data.seq_len}) (at k >= T sparse selects every key)")
    if ev.buckets is not None:
        edges = list(ev.buckets)
        _require(len(edges) >= 2 and edges[0] == 0 and all(b > a for a, b in zip(edges, edges[1:])), "eval.buckets",
                 f"{edges}: must be increasing edges starting at 0, e.g. [0, 512, 1024, 2048]")


def _check_stage_together(key: str, stage) -> None:
    """Values of one stage that are valid alone but make no sense together (issue 13, class 9)."""
    from dsa_train.config.schema import Decay

    _require(stage.decay != Decay.constant or stage.min_lr_ratio == 0.0, f"{key}.min_lr_ratio",
             f"{stage.min_lr_ratio:g} has no effect with {key}.decay=constant; set decay=cosine or linear, "
             "or remove min_lr_ratio")
    _require(stage.attention != Attention.dense or stage.topk is None, f"{key}.topk",
             f"top-{stage.topk} selection has no effect in a dense stage; set {key}.attention=sparse or remove topk")
    scoring = getattr(stage.index_scores, "value", stage.index_scores)
    _require(stage.attention != Attention.dense or scoring == "bf16", f"{key}.index_scores",
             f"{scoring} scoring selects keys, which a dense stage does not; "
             f"set {key}.attention=sparse or remove index_scores")


def doubtful_values(cfg: TrainConfig) -> list[str]:
    """Values that are allowed but rarely meant together: warnings the trainer logs at start-up
    (errors would refuse the short smoke runs people make from a shipped recipe)."""
    out = []
    for name, stage in cfg.stages.items():
        key = f"stages.{name}"
        if stage.warmup_steps > stage.steps >= 1:
            out.append(f"{key}.warmup_steps: {stage.warmup_steps} warm-up steps are longer than the stage "
                       f"({key}.steps={stage.steps}): the lr never reaches {key}.lr={stage.lr:g} (at most "
                       f"{stage.lr * stage.steps / stage.warmup_steps:g}); lower warmup_steps or raise steps")
        if cfg.logging.log_every > stage.steps:
            out.append(f"logging.log_every: {cfg.logging.log_every} is more than {key}.steps={stage.steps}: "
                       f"no step of stage {name} is logged to W&B; lower logging.log_every")
    every = cfg.checkpoint.every_n_steps
    if every and all(every >= stage.steps for stage in cfg.stages.values()):
        out.append(f"checkpoint.every_n_steps: {every} is not below any stage's steps: checkpoints are written only "
                   "at stage ends, so a crash loses up to a whole stage; lower checkpoint.every_n_steps")
    return out


def _check_signals(names: list[str]) -> None:
    import signal

    for name in names:
        key = str(name).upper()
        key = key if key.startswith("SIG") else "SIG" + key
        _require(hasattr(signal, key) and key not in ("SIGKILL", "SIGSTOP"), "fault_tolerance.preemption_signals",
                 f"{name!r} is not a signal a process can handle (e.g. SIGTERM, SIGUSR1)")
