"""Writing the DeepSeek-V3.2-Exp Hugging Face layout (`model_type: deepseek_v32`).

    config.json     DeepseekV32ForCausalLM, index_n_heads / index_head_dim / index_topk, and
                    quantization_config when FP8 (fp8, e4m3, dynamic, [128, 128], + ue8m0)
    *.safetensors   size-capped shards + model.safetensors.index.json, per-expert keys
    tokenizer files copied from a tokenizer directory

Dtypes follow the reference checkpoint: with `fp8` the big Linear weights (fp8.py) are
re-quantized to e4m3 with 128x128 block scales (powers of two with `ue8m0`); the indexer's
`k_norm` and the router's `e_score_correction_bias` stay fp32; everything else, `weights_proj`
included, is written in `dtype` (bf16 by default) and never quantized.

The directory is assembled beside OUT and moved into place when complete, with
`written_by_dsa_train.json` (WRITTEN_BY_FILE: the tool, its version, the command and what the
model was made from): the one sign that lets a later export replace it (`check_out`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..model.config import DSAConfig
from ..model.dtypes import STORED_FP32
from .errors import CheckpointError
from .fp8 import SCALE_SUFFIX, is_quantized_in_reference, quantize_fp8_blocks, scale_shape
from .hf_layout import CONFIG_FILE, INDEX_FILE
from .shard_writer import ShardWriter, Spec
from ..tempdirs import remove_dead_temporaries
from ..version import __version__

# the marker of a directory dsa_train wrote; `kind` says which command may replace it
WRITTEN_BY_FILE = "written_by_dsa_train.json"
EXPORT_KIND = "export"  # the V3.2 layout: `dsa-train export`, a run's end-of-run export, save_pretrained
TINY_KIND = "tiny-checkpoint"  # `dsa-train make-tiny-checkpoint`
KEEP_FP32 = STORED_FP32  # the dtype policy (dsa_train/model/dtypes.py): as V3.2-Exp stores them
# the demo tokenizer (dsa_train.data.tokenizer uses the same files; importing it would pull `datasets`)
BUNDLED_TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "assets" / "tokenizer"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
)


@dataclass
class ExportOptions:
    dtype: torch.dtype | None = torch.bfloat16  # None: every tensor keeps its dtype
    fp8: bool = False  # re-quantize the reference's FP8 weights with 128x128 block scales
    ue8m0: bool = False  # power-of-two scales (implies fp8)
    max_shard_bytes: int = 5 * 10**9
    block: int = 128

    def __post_init__(self):
        self.fp8 = self.fp8 or self.ue8m0


@dataclass
class ExportResult:
    path: Path
    files: list[Path] = field(default_factory=list)
    total_bytes: int = 0
    tensors: int = 0
    fp8_tensors: int = 0
    tokenizer_files: list[str] = field(default_factory=list)


def quantization_config(options: ExportOptions) -> dict:
    qc = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [options.block, options.block],
    }
    if options.ue8m0:
        qc["scale_fmt"] = "ue8m0"
    return qc


def v32_config_json(config: DSAConfig, options: ExportOptions, fallback_dtype: torch.dtype = torch.bfloat16) -> dict:
    cfg = config.to_hf_dict()
    cfg["torch_dtype"] = str(options.dtype or fallback_dtype).replace("torch.", "")
    if options.fp8:
        cfg["quantization_config"] = quantization_config(options)
    return cfg


def _stored_as(name: str, ndim: int, dtype: torch.dtype, options: ExportOptions) -> torch.dtype | None:
    """The dtype a parameter is stored in; None: FP8 with block scales. The one rule behind
    `encode` (values) and `encoded_specs` (shapes and dtypes before any value is read)."""
    if options.fp8 and ndim == 2 and is_quantized_in_reference(name):
        return None
    if not dtype.is_floating_point:
        return dtype
    if name.endswith(KEEP_FP32):
        return torch.float32
    return options.dtype if options.dtype is not None else dtype


def _scale_name(name: str) -> str:
    return name[: -len(".weight")] + ".weight" + SCALE_SUFFIX


def encoded_specs(name: str, shape: tuple[int, ...], dtype: torch.dtype, options: ExportOptions) -> list[Spec]:
    """[(stored name, dtype, shape)] of what `encode` makes of a tensor of this shape and dtype."""
    target = _stored_as(name, len(shape), dtype, options)
    if target is None:
        return [(name, torch.float8_e4m3fn, tuple(shape)), (_scale_name(name), torch.float32,
                                                            tuple(scale_shape(tuple(shape), options.block)))]
    return [(name, target, tuple(shape))]


def encode(name: str, tensor: torch.Tensor, options: ExportOptions) -> dict[str, torch.Tensor]:
    """One parameter as it is stored: {name: tensor} or {name: fp8, name_scale_inv: scales}."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_meta:
        raise CheckpointError(f"tensor {name} is on the meta device (not loaded on this rank); export needs the full model")
    target = _stored_as(name, t.dim(), t.dtype, options)
    if target is None:
        q, scale = quantize_fp8_blocks(t, options.block, options.ue8m0)
        return {name: q, _scale_name(name): scale}
    return {name: t.to(target)}


def copy_tokenizer(src: str | os.PathLike, dst: Path) -> list[str]:
    src = Path(src)
    if src.is_file():
        src_files = [src]
    elif src.is_dir():
        src_files = [src / f for f in TOKENIZER_FILES if (src / f).is_file()]
    else:
        raise CheckpointError(f"tokenizer {src} does not exist; pass a directory with tokenizer.json")
    if not any(p.name == "tokenizer.json" or p.name == "tokenizer.model" for p in src_files):
        raise CheckpointError(f"{src} has no tokenizer.json (or tokenizer.model); pass the tokenizer's directory")
    for p in src_files:
        shutil.copy2(p, dst / p.name)
    return [p.name for p in src_files]


def write_written_by(directory: Path, written_by: str, made_from: str, kind: str = EXPORT_KIND) -> None:
    """The marker of a directory dsa_train wrote (WRITTEN_BY_FILE), read back by `written_kind`."""
    marker = {"tool": "dsa_train", "version": __version__, "kind": kind, "written_by": written_by, "made_from": made_from}
    (directory / WRITTEN_BY_FILE).write_text(json.dumps(marker, indent=2) + "\n")


def written_kind(directory: Path) -> str | None:
    """The `kind` of the dsa_train output `directory` holds; None when it has no readable marker."""
    try:
        marker = json.loads((directory / WRITTEN_BY_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("tool") != "dsa_train":
        return None
    return marker.get("kind") if isinstance(marker.get("kind"), str) else None


def write_hf_dir(
    out: str | os.PathLike,
    config_json: dict,
    tensors: Iterable[tuple[str, torch.Tensor]],
    options: ExportOptions,
    tokenizer_dir: str | os.PathLike | None = None,
    *,
    written_by: str = "dsa_train.checkpoint.write_hf_dir",
    made_from: str = "tensors in memory",
    kind: str = EXPORT_KIND,
) -> ExportResult:
    """Write config.json, the shards (+ index), the tokenizer and the marker (WRITTEN_BY_FILE:
    `written_by`, `made_from`, `kind`) into OUT, atomically."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        result = ExportResult(path=out)
        writer = ShardWriter(tmp, options.max_shard_bytes)
        for name, tensor in tensors:
            group = encode(name, tensor, options)
            result.tensors += len(group)
            result.fp8_tensors += sum(t.dtype == torch.float8_e4m3fn for t in group.values())
            writer.add(group)
        files = writer.finish()
        result.total_bytes = writer.total_bytes
        (tmp / CONFIG_FILE).write_text(json.dumps(config_json, indent=2) + "\n")
        if tokenizer_dir is not None:
            result.tokenizer_files = copy_tokenizer(tokenizer_dir, tmp)
        write_written_by(tmp, written_by, made_from, kind)
        result.files = [out / f.name for f in files]
        place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result


def _looks_like_model_dir(out: Path) -> bool:
    """A Hugging Face model directory: config.json and safetensors shards."""
    return (out / CONFIG_FILE).is_file() and ((out / INDEX_FILE).is_file() or any(out.glob("*.safetensors")))


def _model_summary(out: Path) -> str:
    try:
        config = json.loads((out / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        config = {}
    config = config if isinstance(config, dict) else {}
    return (f"{config.get('model_type', 'no model_type')}, hidden {config.get('hidden_size', '?')}, "
            f"{config.get('num_hidden_layers', '?')} layers")


def check_out(out: str | os.PathLike, src: str | os.PathLike | None = None, kind: str = EXPORT_KIND) -> None:
    """`dsa-train export SRC OUT` / `make-tiny-checkpoint OUT`, before any work: OUT is new, empty,
    or an earlier output of the same command (its marker WRITTEN_BY_FILE has this `kind`; its
    shards are replaced); never a file, the source itself, a folder of the user's, or a model
    directory without the marker: a downloaded checkpoint given as OUT, whatever its config says
    (an output of a dsa_train from before the marker is refused too: it cannot be told apart)."""
    out_p, shown = Path(out).expanduser().resolve(), Path(out)
    if src is not None:
        src_p = Path(src).expanduser().resolve()
        if out_p == src_p or out_p in src_p.parents:
            raise CheckpointError(f"OUT {shown} {'is' if out_p == src_p else 'holds'} the source {src}; nothing "
                                  "was written", fix=f"export into a new folder, e.g. {src_p / 'export'}")
    new_folder = out_p.parent / (out_p.name + ("-export" if kind == EXPORT_KIND else "-tiny"))
    if out_p.exists() and not out_p.is_dir():
        raise CheckpointError(f"OUT {shown} is a file; nothing was written", fix=f"pass a new folder, e.g. {new_folder}")
    if out_p.is_dir() and any(out_p.iterdir()):
        found = written_kind(out_p)
        if found is not None and found != kind:
            raise CheckpointError(
                f"OUT {shown} holds a model this command did not write (a dsa_train {found}, says its {WRITTEN_BY_FILE}); "
                "it is never replaced; nothing was written", fix=f"pass a new folder, e.g. {new_folder}")
        if found is None and _looks_like_model_dir(out_p):
            raise CheckpointError(
                f"OUT {shown} holds a model this command did not write ({_model_summary(out_p)}; no {WRITTEN_BY_FILE}); "
                "it is never replaced; nothing was written",
                fix=f"pass a new folder, e.g. {new_folder} (an output of an older dsa_train has no {WRITTEN_BY_FILE} "
                    f"either: to replace it, delete it yourself first, `rm -r {shown}`)")
        if found is None:
            entries = sorted(p.name for p in out_p.iterdir())
            raise CheckpointError(
                f"OUT {shown} is a folder that is not a model directory ({len(entries)} entries: "
                f"{', '.join(entries[:3])}{', ...' if len(entries) > 3 else ''}); it is never written into; "
                "nothing was written", fix=f"pass a new or empty folder, e.g. {new_folder}")
    remove_dead_temporaries(out_p.parent, f".{out_p.name}.partial-")  # of an export that was killed


def place(tmp: Path, out: Path) -> None:
    """Move the assembled directory `tmp` to `out`, replacing an earlier export's shards, and, when
    `out` is an earlier output of dsa_train (its WRITTEN_BY_FILE), its tokenizer files too: a new
    export without a tokenizer must not leave the old model's tokenizer beside the new weights."""
    if not out.exists():
        os.replace(tmp, out)
        return
    stale = list(out.glob("model*.safetensors")) + [out / INDEX_FILE]
    if written_kind(out) is not None:
        stale += [out / name for name in TOKENIZER_FILES]
    for old in stale:
        old.unlink(missing_ok=True)
    for f in tmp.iterdir():
        os.replace(f, out / f.name)
    tmp.rmdir()


def save_pretrained(
    model,
    path: str | os.PathLike,
    max_shard_bytes: int = 5 * 10**9,
    dtype: torch.dtype | None = None,
    fp8: bool = False,
    ue8m0: bool = False,
    tokenizer_dir: str | os.PathLike | None = None,
) -> ExportResult:
    """DSAForCausalLM -> V3.2-Exp directory. dtype None keeps every tensor's dtype."""
    options = ExportOptions(dtype=dtype, fp8=fp8, ue8m0=ue8m0, max_shard_bytes=max_shard_bytes)
    state = model.state_dict()
    param_dtype = next(model.parameters()).dtype
    names = sorted(state, key=natural_key)
    return write_hf_dir(
        path, v32_config_json(model.config, options, param_dtype), ((n, state[n]) for n in names), options, tokenizer_dir,
        written_by="dsa_train.save_pretrained", made_from=f"a {type(model).__name__} in memory",
    )


def natural_key(name: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]
