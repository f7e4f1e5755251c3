"""`dsa-train`: the console script.

    dsa-train                               train with the demo recipe
    dsa-train [--config-name R | recipe=R] [key=value ...] [Hydra flags]
                                            train with recipe R (`--cfg job` prints it)
    dsa-train prepare-data ...              pre-tokenize a corpus (dsa_train.data.prepare)
    dsa-train export|inspect|make-tiny-checkpoint ...
                                            checkpoint tools (dsa_train.checkpoint.cli)
    dsa-train launch|plan|report|kernels|gpu-check ...
    dsa-train eval MODEL [--compare MODEL2] ...
                                            dense vs sparse vs oracle evaluation (dsa_train.eval)
    dsa-train --help                        subcommands, shipped recipes and profiles, one line each
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
    "launch": "dsa_train.launch.launcher",  # torchrun / Slurm (sbatch from the recipe's cluster group)
    "plan": "dsa_train.plan.estimate",  # per-GPU memory and step-time estimate of a recipe
    "kernels": "dsa_kernels.compile_report",  # `kernels report --arch sm_90a`: compile gate without a GPU
    "report": "dsa_train.logging.report",  # per-stage summary and PNG plots of a run
    "gpu-check": "dsa_train.gpucheck.runner",  # one GPU: kernels vs references, speed, end to end, NCCL
    "eval": "dsa_train.eval.cli",  # dense vs sparse vs oracle top-k, LM loss by position, passkey
}

# one line each for `dsa-train --help`
SUBCOMMAND_HELP = {
    "launch": "start a recipe on several processes: `launch torchrun ...` or `launch slurm [--dry-run] ...`",
    "plan": "per-GPU memory and step time of a recipe's layout, before submitting it",
    "report": "per-stage summary and PNG plots of a run directory (no W&B needed)",
    "export": "training checkpoint or run directory -> DeepSeek-V3.2-Exp Hugging Face layout (--fp8 --ue8m0)",
    "inspect": "architecture, parameter count, dtypes and key check of a Hugging Face checkpoint",
    "make-tiny-checkpoint": "a tiny random checkpoint in the V3.1-Terminus layout (FP8), for rehearsals",
    "prepare-data": "pre-tokenize and pack a corpus into fixed-length sequences",
    "kernels": "`kernels report`: compile the Triton kernels for a GPU architecture without a GPU",
    "gpu-check": "prove and measure the CUDA path on one GPU in 10 minutes: report.json + report.md (--dry-run)",
    "eval": "held-out loss by position, dense vs sparse vs oracle top-k; per-layer recall; passkey (eval.json + PNGs)",
}

log = logging.getLogger("dsa_train")


def _first_sentence(path) -> str:
    """The first sentence of a YAML file's leading comment block."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    text = " ".join(lines)
    end = text.find(". ")
    text = text if end < 0 else text[: end + 1]
    return text if len(text) <= 110 else text[:107].rsplit(" ", 1)[0] + " ..."


def usage() -> str:
    from dsa_train.config import recipes_dir

    recipes = recipes_dir()
    shipped = sorted(p for p in recipes.glob("*.yaml") if p.stem != "base")
    profiles = sorted((recipes / "profile").glob("*.yaml"))
    width = max(len(p.stem) for p in shipped + profiles) + 2
    sub_width = max(map(len, SUBCOMMANDS)) + 2
    out = [
        "usage: dsa-train [--config-name RECIPE] [profile=PROFILE] [key=value ...]   train with a recipe",
        "       dsa-train SUBCOMMAND [--help] ...",
        "",
        "Continued pretraining of DeepSeek-V3-architecture checkpoints into DeepSeek Sparse Attention models",
        "(the two stages of the DeepSeek-V3.2 report: dense warm-up of the indexer, then sparse training).",
        "",
        f"recipes (--config-name NAME or recipe=NAME; in {recipes}):",
        *[f"  {p.stem:<{width}}{_first_sentence(p)}" for p in shipped],
        "",
        "profiles (profile=NAME, with any recipe):",
        *[f"  {p.stem:<{width}}{_first_sentence(p)}" for p in profiles],
        "",
        "subcommands:",
        *[f"  {name:<{sub_width}}{SUBCOMMAND_HELP.get(name, '')}" for name in SUBCOMMANDS],
        "",
        "examples:",
        "  dsa-train                                       the demo (tiny model, bundled corpus, CPU, minutes)",
        "  dsa-train --config-name v3.2_warmup --cfg job   print the composed recipe, run nothing",
        "  dsa-train make-tiny-checkpoint /tmp/tiny-v3.1",
        "  dsa-train --config-name v3.2_warmup profile=smoke model.pretrained=/tmp/tiny-v3.1",
        "  dsa-train launch torchrun --nproc-per-node 8 --config-name v3.2_warmup model.pretrained=/ckpt/V3.1 "
        "data.sources=[...]",
        "",
        "Any recipe key can be overridden (stages.sparse.steps=100); unknown keys are refused with suggestions.",
        "Hydra's own options: dsa-train --hydra-help. Docs: README.md, docs/recipes.md, docs/training.md.",
    ]
    return "\n".join(out)


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


# Hydra writes nothing itself: `.hydra/` and `train.log` are written by the trainer once it holds
# the run directory (dsa_train/config/run_files.py), so a refused run changes nothing there.
HYDRA_QUIET = {"hydra.output_subdir": "null", "hydra/job_logging": "dsa_train", "hydra.run.dir": "."}


def _override_key(arg: str) -> str:
    return arg.split("=", 1)[0].lstrip("+~")


def quiet_hydra(argv: list[str]) -> list[str]:
    """`argv` plus the overrides that keep Hydra from writing into the run directory (those the
    command line sets itself are kept as given), placed with the command line's own overrides
    (Hydra's parser takes them as one block of positional arguments)."""
    from dsa_train.config.hydra_errors import VALUE_FLAGS

    last, i = None, 0
    while i < len(argv):
        arg = argv[i]
        if arg in VALUE_FLAGS:
            i += 2
            continue
        if not arg.startswith("-"):
            last = i
        i += 1
    given = {_override_key(argv[j]) for j in range(len(argv)) if "=" in argv[j] and not argv[j].startswith("-")}
    ours = [f"{k}={v}" for k, v in HYDRA_QUIET.items() if k not in given]
    at = len(argv) if last is None else last + 1
    return [*argv[:at], *ours, *argv[at:]]


def run_hydra(argv: list[str], train) -> int:
    """Compose the recipe from `argv` as a Hydra app, check it, and call `train(TrainConfig)`.
    A bad recipe or any project error (`dsa_train.errors.DSATrainError`) raised by the trainer
    exits with its one line and code 2, no traceback (Preempted, a SystemExit, exits 75).
    (`dsa-train` and the per-rank `python -m dsa_train.launch.rank` both run through here.)"""
    import hydra
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import MissingMandatoryValue

    from dsa_train.config import ConfigError, DEFAULT_RECIPE, recipes_dir, register_configs, to_train_config
    from dsa_train.config import run_files
    from dsa_train.errors import report, run_reporting

    register_configs()

    @hydra.main(config_path=str(recipes_dir()), config_name=DEFAULT_RECIPE, version_base=None)
    def train_main(cfg: DictConfig) -> None:
        try:
            train_cfg = to_train_config(cfg, check_environment=True)
        except (ConfigError, MissingMandatoryValue) as err:
            raise SystemExit(report(ConfigError(f"invalid recipe: {err}")))
        from hydra.core.hydra_config import HydraConfig

        hydra_cfg = HydraConfig.get()
        user_overrides = [o for o in hydra_cfg.overrides.task if _override_key(o) not in HYDRA_QUIET]
        run_files.remember(OmegaConf.to_yaml(cfg), user_overrides)

        # Hydra prints any exception with a traceback: project errors leave as their one line here
        def run_training() -> None:
            from dsa_train.logging.wandb_run import resolve_mode
            from dsa_train.runtime import require_train_extra

            from dsa_train.data.sources import needs_hf_datasets

            # `datasets` where a source is read through it (hub, streaming, .zst); W&B unless the run's
            # mode (auto: WANDB_MODE included) resolves to disabled
            wandb = () if resolve_mode(train_cfg.logging.wandb_mode) == "disabled" else ("wandb",)
            data = train_cfg.data
            require_train_extra(*(("datasets",) if needs_hf_datasets(data.sources, data.streaming) else ()), *wandb)
            train(train_cfg)

        try:
            code = run_reporting(run_training)
        finally:
            run_files.forget()
            run_files.close_run_log()
        if code:
            raise SystemExit(code)

    from dsa_train.config.hydra_errors import precompose
    from dsa_train.config.overrides import check_overrides
    from dsa_train.signals import startup_signals

    argv = hydra_argv(argv)
    try:  # unknown keys with suggestions, before Hydra's bare "not in StageConfig"; then Hydra's own
        check_overrides(argv, recipes_dir())  # errors (no such recipe, a list without brackets, YAML) as one line
        precompose(argv, recipes_dir(), DEFAULT_RECIPE)
    except ConfigError as err:
        raise SystemExit(report(err))
    saved_argv = sys.argv
    sys.argv = [saved_argv[0] if saved_argv else "dsa-train", *quiet_hydra(argv)]
    try:
        with startup_signals():  # SIGTERM / SIGUSR1 before the training loop: one line, temporary files removed
            train_main()
    finally:
        sys.argv = saved_argv
    return 0


def _train(cfg):
    # imported once run_hydra has checked the `train` extra: the trainer's data loader imports
    # `datasets`, which a core install (docs/install.md) lacks -- that gets one line, not a traceback
    from dsa_train.trainer.trainer import train

    return train(cfg)


def train_app(argv: list[str]) -> int:
    from dsa_train.runtime import limit_heap_fragmentation, quiet_third_party

    limit_heap_fragmentation()  # chunked DSA ops otherwise fragment glibc's heap (dsa_train/runtime.py)
    quiet_third_party()

    return run_hydra(argv, _train)


def main(argv: list[str] | None = None) -> int:
    from dsa_train.errors import run_reporting

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["help"] or (any(a in ("-h", "--help") for a in argv) and not (argv and argv[0] in SUBCOMMANDS)):
        print(usage())
        return 0
    if argv and argv[0] in SUBCOMMANDS:
        from dsa_train.runtime import quiet_third_party

        quiet_third_party()  # megatron-core's import-time "Transformer Engine and Apex" lines (plan, launch, ...)
        # every subcommand's project errors end here as one line (dsa_train/errors.py)
        return run_reporting(lambda: run_subcommand(argv[0], argv[1:]))
    return train_app(argv)


if __name__ == "__main__":
    sys.exit(main())
