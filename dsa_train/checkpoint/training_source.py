"""The model inside a training checkpoint written by `dsa_train.trainer` (the export source).

A training checkpoint is `<run_dir>/checkpoints/step_XXXXXXXX/` (checkpoint/training.py). Its
tensors are a torch.distributed.checkpoint directory `state/` of global tensors
(checkpoint/sharded_state.py); the model is `model/<name>`, written in pieces by however many ranks
and layouts. It is read here offline, in this one process (DCP's `no_dist` reader, no process
group), one full tensor at a time as the export asks for it (`ShardedModelState`), each byte
range checked against the manifest's sha256 as it is read.

Checkpoints of earlier versions (one `model*.pt` per rank, tensor-parallel slices described by
`layout*.json`) are still exported: their files are merged, opened memory-mapped.

The state dict does not carry the model config; it is found, in this order, in
  1. `config.json` inside the step directory (Hugging Face form),
  2. the `config` argument (a Hugging Face directory or a config.json),
  3. the recipe the checkpoint was trained under: `recipe` in its `trainer_state.json` (resolved,
     profile applied; written with every checkpoint), else, for checkpoints older than that, the
     run's Hydra config (`<run_dir>/.hydra/config.yaml`): `model.pretrained` (its config.json) or
     `model.arch` (tiny_config(**arch), vocab_size from the embedding). `.hydra/` describes the
     last command run in the directory, not necessarily what this checkpoint trained, so it is
     never read when the checkpoint records its recipe.
Relative paths in the run's config are tried here and from the directory the run started in.
The tokenizer is the run's `data.tokenizer` (the bundled one when unset; else the run's own
export's copy). `index_topk` becomes the top-k of the last sparse stage the checkpoint trained.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ..model.config import DSAConfig, tiny_config
from .errors import CheckpointError
from .export import BUNDLED_TOKENIZER_DIR
from .hf_layout import CONFIG_FILE, is_hf_dir, read_config_json
from .skeleton import empty_model

MODEL_FILE_GLOB = "model*.pt"
STEP_PREFIX = "step_"
SHARDED_METADATA = "state/.metadata"


class ShardedModelState(Mapping):
    """name -> full model tensor of a sharded checkpoint, read on access (offline DCP). `meta`:
    name -> a meta-device tensor of the saved shape and dtype (read from the metadata only)."""

    def __init__(self, step_dir: Path, regions: dict | None):
        from dsa_train.checkpoint import sharded_state

        self.directory = step_dir / "state"
        self.regions = regions
        self.metadata = sharded_state.read_metadata(self.directory)  # read once, not once per tensor
        prefix = sharded_state.MODEL
        self.meta = {k[len(prefix):]: torch.empty(tuple(v.size), dtype=v.properties.dtype, device="meta")
                     for k, v in self.metadata.state_dict_metadata.items() if k.startswith(prefix) and hasattr(v, "size")}

    def __getitem__(self, name: str) -> torch.Tensor:
        from dsa_train.checkpoint import sharded_state

        if name not in self.meta:
            raise KeyError(name)
        ((_, t),) = sharded_state.read_full_tensors(
            self.directory, [name], regions=self.regions, metadata=self.metadata,
            corrupt=lambda m: CheckpointError(f"{self.directory.parent}: {m}",
                                              fix="export an earlier step_* directory of the run"))
        return t

    def __iter__(self):
        return iter(self.meta)

    def __len__(self) -> int:
        return len(self.meta)


def is_sharded(step_dir: Path) -> bool:
    return (step_dir / SHARDED_METADATA).is_file()


def _has_model(step_dir: Path) -> bool:
    return is_sharded(step_dir) or any(step_dir.glob(MODEL_FILE_GLOB))


@dataclass
class TrainingCheckpoint:
    step_dir: Path
    config: DSAConfig
    state: dict[str, torch.Tensor]  # memory-mapped
    files: dict[str, Path]  # tensor name -> file it came from
    run: RunConfig | None = None  # the recipe it was trained under (None: not recorded)

    @property
    def tokenizer_dir(self) -> Path:
        """The run's tokenizer, looked up when asked for: a caller given another one (`--tokenizer`)
        or needing none (inspect) reads a run whose tokenizer has moved."""
        return _run_tokenizer(self.run, self.step_dir)


def find_step_dir(path: str | os.PathLike) -> Path | None:
    """The step directory for PATH: itself, or the newest step_* under PATH or PATH/checkpoints."""
    path = Path(path)
    if _has_model(path):
        return path
    for base in (path, path / "checkpoints"):
        steps = [p for p in base.glob(STEP_PREFIX + "*") if p.is_dir() and _has_model(p)]
        if steps:
            return max(steps, key=lambda p: int(p.name[len(STEP_PREFIX):]) if p.name[len(STEP_PREFIX):].isdigit() else -1)
    return None


def _layout_file(model_file: Path) -> Path:
    """layout.json for model.pt, layout.rank<r>.json for model.rank<r>.pt (checkpoint/training.py)."""
    rank_part = model_file.name[len("model"):-len(".pt")]  # "" or ".rank00003"
    return model_file.with_name(f"layout{rank_part}.json")


VERIFY_CHECKSUMS = True  # `dsa-train export --no-verify-checksums` turns the sha256 check off


def verify_model_files(step_dir: Path, checksums: bool | None = None) -> None:
    """Check the model files, layouts and config.json of a training checkpoint against its
    manifest (checkpoint/training.py) before exporting them: a corrupt checkpoint is never exported."""
    from dsa_train.checkpoint.training import CorruptCheckpoint, UnverifiedCheckpoint, verify_checkpoint

    checksums = VERIFY_CHECKSUMS if checksums is None else checksums
    if is_sharded(step_dir):  # every tensor file (its size), the metadata (sha256); byte ranges: as read
        manifest_path = step_dir / "manifest.json"
        try:
            listed = json.loads(manifest_path.read_text()).get("files", {}) if manifest_path.is_file() else {}
        except (ValueError, AttributeError):
            listed = {}  # unreadable: verify_checkpoint says so below
        names = [n for n in ("config.json", "trainer_state.json") if (step_dir / n).is_file()]
        names += [n for n in listed if n.startswith("state/")] or [SHARDED_METADATA]
    else:
        names = [f.name for f in step_dir.iterdir() if f.name.startswith(("model", "layout", "config.json"))]
    try:  # an earlier version's per-rank checkpoint is exported all the same (only resuming refuses it)
        verify_checkpoint(step_dir, checksums=checksums, files=names, old_format_ok=True)
    except CorruptCheckpoint as e:
        raise CheckpointError(str(e), fix="export an earlier step_* directory of the run") from e
    except UnverifiedCheckpoint as e:
        raise CheckpointError(e.problem, fix=e.fix) from e


def _sharded_regions(step_dir: Path, checksums: bool) -> dict | None:
    if not checksums or not (step_dir / "manifest.json").is_file():
        return None
    files = json.loads((step_dir / "manifest.json").read_text())["files"]
    return {n[len("state/"):]: e.get("regions", {}) for n, e in files.items()
            if n.startswith("state/") and n != SHARDED_METADATA}


def _read_state(step_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    """The full model state of a checkpoint written by one or several ranks. Several ranks write
    a `layout*.json` beside their model file: tensors listed there are tensor-parallel slices
    ([dim, start, stop]) and are concatenated; other tensors found in several files are replicas
    (same shape; the first is taken); expert-parallel ranks hold disjoint experts."""
    state: dict[str, torch.Tensor] = {}
    files: dict[str, Path] = {}
    slices: dict[str, list[tuple[int, int, int, torch.Tensor, Path]]] = {}
    for f in sorted(step_dir.glob(MODEL_FILE_GLOB)):
        try:
            part = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # torch raises RuntimeError / pickle errors / EOFError for damaged files
            raise CheckpointError(f"cannot read {f}: {e}. The file is truncated or corrupt; use an earlier checkpoint") from e
        if not isinstance(part, dict):
            raise CheckpointError(f"{f} holds a {type(part).__name__}, not a model state dict")
        layout_path = _layout_file(f)
        layout = None
        if layout_path.is_file():
            try:
                layout = json.loads(layout_path.read_text())
            except ValueError as e:
                raise CheckpointError(f"cannot read {layout_path}: {e}. The file is corrupt; use an earlier checkpoint") from e
        shards = (layout or {}).get("shards", {})
        for name, t in part.items():
            if t is None:  # an optional buffer that is unset
                continue
            if name in shards:
                dim, start, stop = shards[name]
                slices.setdefault(name, []).append((dim, start, stop, t, f))
                continue
            if name in state:
                if layout is None:
                    raise CheckpointError(
                        f"tensor {name} is in both {files[name]} and {f} and {f.parent} has no {layout_path.name} "
                        "saying how they relate; rank files without a layout must hold disjoint keys"
                    )
                if state[name].shape != t.shape:
                    raise CheckpointError(
                        f"tensor {name}: replica in {f} has shape {tuple(t.shape)}, in {files[name]} "
                        f"{tuple(state[name].shape)}; the checkpoint's rank files disagree"
                    )
                continue
            state[name], files[name] = t, f
    for name, parts in slices.items():
        state[name], files[name] = _concat_slices(name, parts)
    return state, files


def _concat_slices(name: str, parts: list[tuple[int, int, int, torch.Tensor, Path]]) -> tuple[torch.Tensor, Path]:
    """One tensor from its tensor-parallel slices (replicas over data parallel dropped); the
    slices must tile [0, full) along their dim without gaps."""
    by_start: dict[int, tuple[int, int, int, torch.Tensor, Path]] = {}
    for item in parts:
        by_start.setdefault(item[1], item)
    ordered = [by_start[k] for k in sorted(by_start)]
    dims = {item[0] for item in ordered}
    if len(dims) != 1:
        raise CheckpointError(f"tensor {name}: slices along different dims {sorted(dims)} in {[str(i[4]) for i in ordered]}")
    end = 0
    for dim, start, stop, t, f in ordered:
        if start != end or t.shape[dim] != stop - start:
            raise CheckpointError(
                f"tensor {name}: slice [{start}:{stop}] in {f} does not continue [0:{end}] "
                "(a tensor-parallel rank's model file is missing from the checkpoint?)"
            )
        end = stop
    dim = ordered[0][0]
    return torch.cat([item[3] for item in ordered], dim=dim), ordered[0][4]


@dataclass
class RunConfig:
    """The run's saved Hydra config (`<run_dir>/.hydra/config.yaml`), interpolations resolved
    (`data.tokenizer: ${model.pretrained}`), and where relative paths in it start from: the
    directory the run was started in, found by taking the saved run_dir off the config's directory."""

    values: dict
    run_dir: Path  # the run directory (holding .hydra/, checkpoints/, export/)
    started_in: Path | None
    source: str = ".hydra/config.yaml"  # where the values were read (for messages)

    def path(self, value: str | None) -> Path | None:
        """An existing path the run's `value` names (relative: from where the run started, or here)."""
        if not value:
            return None
        p = Path(value)
        candidates = [p] if p.is_absolute() else [p, *([self.started_in / p] if self.started_in else [])]
        return next((c for c in candidates if c.exists()), None)


def _run_config(step_dir: Path) -> RunConfig | None:
    """The recipe `step_dir` was trained under: its trainer_state.json's, else (older checkpoints) the run's .hydra/."""
    return _checkpoint_recipe(step_dir) or _hydra_config(step_dir)


def _checkpoint_recipe(step_dir: Path) -> RunConfig | None:
    state_file = step_dir / "trainer_state.json"
    try:
        recipe = json.loads(state_file.read_text()).get("recipe") if state_file.is_file() else None
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(recipe, dict):
        return None
    ckpt_dir = step_dir.resolve().parent
    saved_ckpt = Path(str((recipe.get("checkpoint") or {}).get("dir") or ""))
    saved_run = Path(str(recipe.get("run_dir") or ""))
    started_in = None
    if str(saved_ckpt) not in ("", ".") and not saved_ckpt.is_absolute() \
            and ckpt_dir.parts[-len(saved_ckpt.parts):] == saved_ckpt.parts:
        started_in = Path(*ckpt_dir.parts[: -len(saved_ckpt.parts)])
    if saved_ckpt.parent == saved_run or saved_ckpt.is_absolute() and saved_run.is_absolute() \
            and saved_ckpt.resolve().parent == saved_run.resolve():
        run_dir = ckpt_dir.parent  # checkpoint.dir = <run_dir>/checkpoints: wherever the run now lies
    elif saved_run.is_absolute() or started_in is None:
        run_dir = saved_run
    else:
        run_dir = started_in / saved_run
    return RunConfig(recipe, run_dir, started_in, source=f"the recipe in {state_file}")


def _hydra_config(step_dir: Path) -> RunConfig | None:
    from omegaconf import OmegaConf

    for parent in [step_dir, *step_dir.parents][:5]:
        f = parent / ".hydra" / "config.yaml"
        if f.is_file():
            conf = OmegaConf.load(f)
            try:
                values = _as_trained(conf)
            except Exception:  # an interpolation that does not resolve here: resolve key by key
                values = _resolve_leniently(conf)
            saved_run_dir = Path(str(values.get("run_dir") or ""))
            started_in = None
            if str(saved_run_dir) not in ("", ".") and not saved_run_dir.is_absolute():
                run_dir = parent.resolve()
                if run_dir.parts[-len(saved_run_dir.parts):] == saved_run_dir.parts:
                    started_in = Path(*run_dir.parts[: -len(saved_run_dir.parts)])
            return RunConfig(values, parent, started_in, source=str(f))
    return None


def _as_trained(conf) -> dict:
    """The saved recipe as the run trained it: checked against the schema and with its profile
    applied (Hydra saves the composition; `profile=smoke` changes it at start-up)."""
    from omegaconf import OmegaConf

    from ..config.profile import apply_profile
    from ..config.schema import TrainConfig

    train_cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), conf))
    apply_profile(train_cfg, announce=False)
    return OmegaConf.to_container(OmegaConf.structured(train_cfg), resolve=True, enum_to_str=True)


def _resolve_leniently(conf) -> dict:
    from omegaconf import DictConfig, OmegaConf

    def walk(node):
        if isinstance(node, DictConfig):
            out = {}
            for key in node.keys():
                try:
                    out[key] = walk(node[key])
                except Exception:
                    out[key] = OmegaConf.to_container(node, resolve=False).get(key)
            return out
        return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node

    return walk(conf)


def _run_tokenizer(run: RunConfig | None, step_dir: Path) -> Path:
    """The tokenizer the run trained with: its `data.tokenizer` (null: the bundled one), found
    where the run started; else the tokenizer files the run's own export copied."""
    if run is None:
        return BUNDLED_TOKENIZER_DIR
    tokenizer = (run.values.get("data") or {}).get("tokenizer")
    if tokenizer in (None, "bundled"):
        return BUNDLED_TOKENIZER_DIR
    found = run.path(str(tokenizer))
    if found is not None:
        return found
    export = run.run_dir / "export"
    if (export / "tokenizer.json").is_file():
        return export
    raise CheckpointError(
        f"the run's tokenizer {tokenizer} (data.tokenizer in {run.source}) does not exist "
        f"here{f' (nor under {run.started_in})' if run.started_in else ''}, and the run has no export with a "
        "tokenizer; pass --tokenizer DIR (the checkpoint the run started from)"
    )


def _trained_topk(run: RunConfig | None, step_dir: Path, default: int) -> int:
    """index_topk for the export: the top-k of the last sparse stage this checkpoint trained."""
    from ..stage import trained_index_topk

    stages = list(((run.values if run else {}).get("stages") or {}).values())
    state_file = step_dir / "trainer_state.json"
    if not stages or not state_file.is_file():
        return default
    state = json.loads(state_file.read_text())
    ran = state.get("stage_index", 0) + (1 if state.get("stage_step", 0) > 0 else 0)
    return trained_index_topk(((s.get("attention"), s.get("topk")) for s in stages[:ran]), default)


def _config_from_path(path: Path) -> DSAConfig:
    cfg_json = read_config_json(path)
    try:
        return DSAConfig.from_hf_dict(cfg_json)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: {e}") from e


def _resolve_config(step_dir: Path, state: dict, config: str | os.PathLike | None, hydra: RunConfig | None) -> DSAConfig:
    if (step_dir / CONFIG_FILE).is_file():
        return _config_from_path(step_dir)
    if config is not None:
        return _config_from_path(Path(config))
    model = (hydra.values if hydra else {}).get("model") or {}
    if model.get("pretrained"):
        found = hydra.path(model["pretrained"])
        if found is None:
            raise CheckpointError(
                f"the run's model.pretrained {model['pretrained']} does not exist here and {step_dir} has no "
                "config.json; pass --config with the model's Hugging Face directory (or config.json)"
            )
        return _config_from_path(found)
    if hydra is not None and "model.embed_tokens.weight" in state:
        arch = dict(model.get("arch") or {})
        arch.setdefault("vocab_size", int(state["model.embed_tokens.weight"].shape[0]))
        return tiny_config(**arch)
    raise CheckpointError(
        f"cannot tell the model config of the training checkpoint {step_dir}: it has no config.json and no "
        ".hydra/config.yaml above it; pass --config with the Hugging Face directory (or config.json) of the model"
    )


def check_state_dict(state: dict, files: dict[str, Path], config: DSAConfig, step_dir: Path) -> None:
    """CheckpointError unless the state dict is exactly the model's (names and shapes)."""
    expected = {n: tuple(t.shape) for n, t in empty_model(config).state_dict().items()}
    for name, t in getattr(state, "meta", state).items():
        if name not in expected:
            raise CheckpointError(
                f"tensor {name} in {files[name]} is not part of the model the config describes; "
                "pass the right --config (or the checkpoint is of another model)"
            )
        if tuple(t.shape) != expected[name]:
            raise CheckpointError(
                f"tensor {name} in {files[name]} has shape {list(t.shape)}, but the config implies "
                f"{list(expected[name])}; the config does not match the weights, pass the right --config"
            )
    missing = [n for n in expected if n not in state]
    if missing:
        raise CheckpointError(
            f"{len(missing)} tensors are missing from the training checkpoint {step_dir}, e.g. {missing[:4]}; "
            "the checkpoint is incomplete (a rank's model file is missing?)"
        )


def open_training_checkpoint(path: str | os.PathLike, config: str | os.PathLike | None = None,
                             checksums: bool | None = None) -> TrainingCheckpoint:
    """The model of a training checkpoint, its files verified (`checksums` None: VERIFY_CHECKSUMS),
    its tensors read on access."""
    step_dir = find_step_dir(path)
    if step_dir is None:
        problem = ("does not exist" if not Path(path).exists() else
                   "is neither a Hugging Face model directory (config.json + *.safetensors) nor a training checkpoint "
                   "(no step_* directory with a state/ in it or in its checkpoints/)")
        raise CheckpointError(f"{path} {problem}", "pass a run directory (e.g. runs/demo), its checkpoints/ or one "
                              "of its step_* directories, or a Hugging Face model directory")
    checksums = VERIFY_CHECKSUMS if checksums is None else checksums
    verify_model_files(step_dir, checksums)
    if is_sharded(step_dir):
        state = ShardedModelState(step_dir, _sharded_regions(step_dir, checksums))
        files = {name: step_dir / "state" for name in state}
    else:
        state, files = _read_state(step_dir)
    hydra = _run_config(step_dir)
    cfg = _resolve_config(step_dir, state, config, hydra)
    mtp_prefix = f"model.layers.{cfg.num_hidden_layers}."
    if cfg.num_nextn_predict_layers and not any(n.startswith(mtp_prefix) for n in state):
        cfg.num_nextn_predict_layers = 0  # trained without the MTP module (as loaded)
    check_state_dict(state, files, cfg, step_dir)
    cfg.index_topk = _trained_topk(hydra, step_dir, cfg.index_topk)
    return TrainingCheckpoint(step_dir, cfg, state, files, hydra)


def is_training_checkpoint(path: str | os.PathLike) -> bool:
    return not is_hf_dir(path) and find_step_dir(path) is not None
