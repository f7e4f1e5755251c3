"""Hugging Face DeepSeek-V3 / V3.2 directories <-> DSAForCausalLM.

Reading: `config.json` + safetensors (one file, or shards through `model.safetensors.index.json`),
one shard at a time, copied into the model's parameters as they come. FP8 e4m3 weights are
dequantized with their 128x128 `weight_scale_inv` blocks (edge blocks included). transformers-5
fused expert tensors (`mlp.experts.gate_up_proj` / `down_proj`) are split into per-expert keys.

Writing: the DeepSeek-V3.2-Exp layout (`model_type: deepseek_v32`, `DeepseekV32ForCausalLM`),
per-expert keys, size-capped shards with an index.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..model.config import DSAConfig
from ..model.transformer import DSAForCausalLM

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
_FUSED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked; the message names the tensor/file and the fix."""


# --------------------------------------------------------------------------- reading
def shard_files(path: str | os.PathLike) -> dict[str, list[str]]:
    """{shard file: [tensor names]} from the index, or from the safetensors files present."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index ({e}); re-download or re-export it")
        files: dict[str, list[str]] = {}
        for name, fname in weight_map.items():
            files.setdefault(fname, []).append(name)
        for fname in files:
            if not (path / fname).exists():
                raise CheckpointError(f"{index} lists {fname}, which is missing from {path}")
        return files
    found = sorted(p.name for p in path.glob("*.safetensors"))
    if not found:
        raise CheckpointError(f"no *.safetensors files in {path}; expected a Hugging Face model directory")
    return {f: [] for f in found}


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: int = 128) -> torch.Tensor:
    """FP8 weight [out, in] with per-block scales [ceil(out/b), ceil(in/b)] -> fp32 (edges allowed)."""
    out_dim, in_dim = weight.shape
    expect = (math.ceil(out_dim / block), math.ceil(in_dim / block))
    if tuple(scale_inv.shape) != expect:
        raise CheckpointError(
            f"weight_scale_inv has shape {tuple(scale_inv.shape)} but a [{out_dim}, {in_dim}] weight with "
            f"{block}x{block} blocks needs {expect}"
        )
    scale = scale_inv.float().repeat_interleave(block, 0)[:out_dim].repeat_interleave(block, 1)[:, :in_dim]
    return weight.float() * scale


def iter_checkpoint_tensors(path: str | os.PathLike, block: int = 128) -> Iterator[tuple[str, torch.Tensor, str]]:
    """Yields (name, tensor, file) one shard at a time, FP8 dequantized, fused experts split."""
    path = Path(path)
    for fname in shard_files(path):
        fpath = path / fname
        try:
            handle = safe_open(str(fpath), framework="pt")
        except Exception as e:  # safetensors raises its own error types for truncated headers
            raise CheckpointError(f"cannot read {fpath}: {e}. The file is truncated or corrupt; re-download it")
        with handle as f:
            names = list(f.keys())
            name_set = set(names)
            for name in names:
                if name.endswith("_scale_inv"):
                    continue
                try:
                    tensor = f.get_tensor(name)
                except Exception as e:
                    raise CheckpointError(f"cannot read tensor {name} from {fpath}: {e}; the shard is corrupt")
                if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                    scale_name = name + "_scale_inv"
                    if scale_name not in name_set:
                        raise CheckpointError(f"FP8 tensor {name} in {fpath} has no {scale_name}")
                    tensor = dequantize_fp8_blocks(tensor, f.get_tensor(scale_name), block)
                m = _FUSED_EXPERTS.match(name)
                if m:
                    yield from _split_fused_experts(m.group(1), m.group(2), tensor, fname)
                else:
                    yield name, tensor, fname


def _split_fused_experts(prefix: str, kind: str, tensor: torch.Tensor, fname: str):
    for e in range(tensor.shape[0]):
        if kind == "gate_up_proj":
            gate, up = tensor[e].chunk(2, dim=0)
            yield f"{prefix}.{e}.gate_proj.weight", gate, fname
            yield f"{prefix}.{e}.up_proj.weight", up, fname
        else:
            yield f"{prefix}.{e}.down_proj.weight", tensor[e], fname


def load_pretrained(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> DSAForCausalLM:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory; pass a Hugging Face model directory")
    config = DSAConfig.from_pretrained(path)
    block = (config.extra.get("quantization_config") or {}).get("weight_block_size", [128, 128])[0]
    names_by_file = shard_files(path)
    stored = set()
    for fname, names in names_by_file.items():
        if names:
            stored.update(names)
        else:
            with safe_open(str(path / fname), framework="pt") as f:
                stored.update(f.keys())
    mtp_prefix = f"model.layers.{config.num_hidden_layers}."
    if config.num_nextn_predict_layers and not any(n.startswith(mtp_prefix) for n in stored):
        log.warning("%s has no MTP tensors (%s*); loading without the MTP module", path, mtp_prefix)
        config.num_nextn_predict_layers = 0

    model = DSAForCausalLM(config)
    expected = model.state_dict()
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor, fname in iter_checkpoint_tensors(path, block):
        if name not in expected:
            if name.startswith(mtp_prefix) and not config.num_nextn_predict_layers:
                continue
            unexpected.append(f"{name} ({fname})")
            continue
        target = expected[name]
        if tuple(tensor.shape) != tuple(target.shape):
            raise CheckpointError(
                f"tensor {name} in {path / fname} has shape {tuple(tensor.shape)}, but config.json implies "
                f"{tuple(target.shape)}; the config does not match the weights"
            )
        with torch.no_grad():
            target.copy_(tensor.to(target.dtype))
        loaded.add(name)
    if unexpected:
        raise CheckpointError(
            f"{len(unexpected)} tensors in {path} are not part of a {config.model_type} model with this config, "
            f"e.g. {unexpected[:5]}; is this checkpoint of another architecture?"
        )
    missing = sorted(set(expected) - loaded)
    indexer_missing = [n for n in missing if ".indexer." in n]
    other_missing = [n for n in missing if ".indexer." not in n]
    if other_missing:
        raise CheckpointError(
            f"{len(other_missing)} tensors missing from {path}, e.g. {other_missing[:5]}; nothing was trained. "
            "The checkpoint is incomplete or its config.json does not describe it"
        )
    if indexer_missing:
        if config.model_type == "deepseek_v32" and len(indexer_missing) != sum(".indexer." in n for n in expected):
            raise CheckpointError(f"V3.2 checkpoint {path} lacks indexer tensors {indexer_missing[:5]}")
        log.info("%s is a dense checkpoint: initializing the lightning indexers", path)
        model.init_indexers()
        config.has_indexer_weights = False
    else:
        config.has_indexer_weights = True
    return model.cast(dtype)


# --------------------------------------------------------------------------- writing
def save_pretrained(
    model: DSAForCausalLM,
    path: str | os.PathLike,
    max_shard_bytes: int = 5 * 1024**3,
    dtype: torch.dtype | None = None,
) -> None:
    """Write config.json + safetensors shards (+ index) in the V3.2-Exp layout."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, tensor in model.state_dict().items():
        t = tensor.detach()
        if dtype is not None and t.is_floating_point() and not name.endswith(
            ("e_score_correction_bias", "indexer.weights_proj.weight", "indexer.k_norm.weight", "indexer.k_norm.bias")
        ):
            t = t.to(dtype)
        state[name] = t.contiguous().clone() if model.config.tie_word_embeddings else t.contiguous()
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(state, key=_natural_key):
        nbytes = state[name].numel() * state[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = state[name]
        size += nbytes
    for stale in list(path.glob("model*.safetensors")) + [path / INDEX_FILE]:
        stale.unlink(missing_ok=True)
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        total = 0
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(path / fname), metadata={"format": "pt"})
            for name, t in shard.items():
                weight_map[name] = fname
                total += t.numel() * t.element_size()
        (path / INDEX_FILE).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
    cfg = model.config.to_hf_dict()
    param_dtype = dtype or next(model.parameters()).dtype
    cfg["torch_dtype"] = str(param_dtype).replace("torch.", "")
    (path / "config.json").write_text(json.dumps(cfg, indent=2))


def _natural_key(name: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]
