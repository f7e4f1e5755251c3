"""Streaming loader: a Hugging Face DeepSeek-V3 / V3.1 / V3.2 directory -> DSAForCausalLM.

    plan = open_checkpoint(path)            # config.json + every shard header, all checked
    model = from_pretrained(path, dtype)    # = plan + a meta-device model filled tensor by tensor

Memory: the model is built with its parameters on the meta device; each tensor is read from its
shard into a buffer of its own, dequantized (FP8), converted to its final dtype and put in place
of its meta parameter before the next is read. Peak memory is the loaded model plus one tensor
in flight (well under one shard); the state dict is never held twice (docs/checkpoints.md has
the measurement).

Ranks that own part of the model pass `param_filter(name) -> bool` (decided before any byte of
that tensor is read: a rank never reads experts it does not own) and/or
`shard_fn(name, full_tensor) -> its slice or None` (tensor-parallel slicing, applied as each
tensor arrives, so only the slice stays). Parameters a rank does not keep stay on the meta device.

Everything that can be checked without reading weights is checked first (see match.py); a load
that fails raises CheckpointError and never returns a partly loaded model.
"""

from __future__ import annotations

import logging
import math
import os
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..model.config import DSAConfig
from ..model.dtypes import apply as apply_dtype_policy
from ..model.transformer import DSAForCausalLM
from .errors import CheckpointError
from .hf_layout import HFDir, open_hf_dir
from .match import WeightMatch, match_weights, mtp_layers_stored, raise_if_unloadable
from .skeleton import assign, empty_model, meta_tensor_names, target_dtype
from .stored import StoredTensor, TensorReader, stored_tensors

if TYPE_CHECKING:
    from .training_source import TrainingCheckpoint

log = logging.getLogger(__name__)

ParamFilter = Callable[[str], bool]
ShardFn = Callable[[str, torch.Tensor], "torch.Tensor | None"]


def config_from_hf(hf: HFDir) -> DSAConfig:
    """DSAConfig of a directory; CheckpointError for other architectures or invalid configs."""
    try:
        return DSAConfig.from_hf_dict(hf.config)
    except (ValueError, TypeError) as e:
        arch = hf.config.get("architectures")
        raise CheckpointError(f"{hf.path / 'config.json'} (architectures {arch}): {e}") from e


def quant_block_size(config_json: dict) -> int:
    qc = config_json.get("quantization_config") or {}
    block = qc.get("weight_block_size") or [128, 128]
    if len(block) != 2 or block[0] != block[1]:
        raise CheckpointError(f"quantization_config.weight_block_size {block} is not supported; only square blocks ([128, 128])")
    return int(block[0])


@dataclass
class CheckpointPlan:
    """A checked directory: its config, what it stores and how that matches the model."""

    hf: HFDir
    config: DSAConfig
    block: int
    stored: dict[str, StoredTensor]
    match: WeightMatch

    @property
    def path(self) -> Path:
        return self.hf.path

    def tensors(
        self,
        dtype: torch.dtype = torch.float32,
        param_filter: ParamFilter | None = None,
        shard_fn: ShardFn | None = None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) for every stored parameter the caller keeps, one at a time, in file
        order, converted to its dtype (fp32 for the indexer's weights_proj / k_norm and router
        biases). A consumer that sees CheckpointError must discard what it received."""
        with TensorReader(self.block) as reader:
            for name in self.match.matched:
                if param_filter is not None and not param_filter(name):
                    continue
                st = self.stored[name]
                t = reader.read(st).to(target_dtype(name, dtype))
                if t.is_floating_point() and t.numel() and not math.isfinite(float(t.sum(dtype=torch.float32))):
                    raise CheckpointError(
                        f"tensor {st.where()} contains NaN or Inf values: the shard is corrupt; re-download it"
                    )
                if shard_fn is not None:
                    t = shard_fn(name, t)
                    if t is None:
                        continue
                yield name, t


def open_checkpoint(path: str | os.PathLike) -> CheckpointPlan:
    """Read config.json and every header, match them with the model; raise if it cannot load."""
    plan = examine_checkpoint(path)
    raise_if_unloadable(plan.match, plan.path, plan.config)
    return plan


def examine_checkpoint(path: str | os.PathLike) -> CheckpointPlan:
    """Like open_checkpoint, but a mismatch between weights and config is left in `plan.match`
    instead of raised (for `dsa-train inspect`). Unreadable files and configs still raise."""
    hf = open_hf_dir(path)
    config = config_from_hf(hf)
    block = quant_block_size(hf.config)
    stored = stored_tensors(hf.entries)
    if config.num_nextn_predict_layers and not mtp_layers_stored(config, stored):
        log.warning(
            "%s has no MTP tensors (model.layers.%d.*); loading without the MTP module",
            hf.path, config.num_hidden_layers,
        )
        config.num_nextn_predict_layers = 0
    skeleton = empty_model(config)
    expected = {n: tuple(t.shape) for n, t in skeleton.state_dict().items()}
    match = match_weights(expected, stored, config, block)
    config.has_indexer_weights = not match.dense
    return CheckpointPlan(hf=hf, config=config, block=block, stored=stored, match=match)


def from_pretrained(
    path: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    param_filter: ParamFilter | None = None,
    shard_fn: ShardFn | None = None,
) -> DSAForCausalLM:
    """The model of a Hugging Face directory; a dense (V3 / V3.1) checkpoint gets fresh indexers.

    With `param_filter` / `shard_fn`, parameters the caller does not keep stay on the meta device
    and kept ones hold what `shard_fn` returned (e.g. a tensor-parallel slice)."""
    plan = open_checkpoint(path)
    model = empty_model(plan.config)
    for name, tensor in plan.tensors(dtype, param_filter, shard_fn):
        assign(model, name, tensor)
    if plan.match.dense:
        log.info("%s is a dense checkpoint: initializing the lightning indexers", plan.path)
        _init_indexers(model, plan.match.missing_indexer, dtype, param_filter, shard_fn)
    if plan.match.tied_lm_head or plan.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    apply_dtype_policy(model, dtype)  # runtime buffers (RoPE, Hadamard) fp32: model/dtypes.py
    if param_filter is None and shard_fn is None:
        left = meta_tensor_names(model)
        if left:
            raise CheckpointError(f"{plan.path}: {left[:4]} were not loaded (internal error: please report)")
    return model


def from_training_checkpoint(
    path: str | os.PathLike, dtype: torch.dtype = torch.float32, config: str | os.PathLike | None = None
) -> tuple[DSAForCausalLM, "TrainingCheckpoint"]:
    """The model of a training checkpoint (`<run_dir>/checkpoints/step_N`; a run or checkpoints
    directory: its newest step), read in this one process whatever layout wrote it, each file
    checked against its manifest (`open_training_checkpoint`), one tensor at a time, each converted
    to its dtype as `from_pretrained` does. Returns the model and the opened checkpoint (its config
    with the top-k it trained, its tokenizer directory)."""
    from .training_source import open_training_checkpoint

    ckpt = open_training_checkpoint(path, config)
    model = empty_model(ckpt.config)
    for name in ckpt.state:
        assign(model, name, ckpt.state[name].to(target_dtype(name, dtype)))
    if ckpt.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    apply_dtype_policy(model, dtype)  # runtime buffers (RoPE, Hadamard) fp32: model/dtypes.py
    left = meta_tensor_names(model)
    if left:  # check_state_dict found every parameter: a buffer or a tie the checkpoint does not hold
        raise CheckpointError(f"{ckpt.step_dir}: {left[:4]} were not loaded (internal error: please report)")
    return model, ckpt


def fresh_indexer_tensor(name: str, shape, std: float, dtype: torch.dtype) -> torch.Tensor:
    """The initial value of one fresh indexer tensor (a dense checkpoint has none): k_norm weight 1
    and bias 0, the projections normal(0, std) (LightningIndexer's initialization) drawn from a
    generator seeded by the tensor's name. It depends on nothing else -- not on the RNG state,
    the load order or the parallel layout -- so every rank that holds an indexer, under any
    layout, starts from the same values as the single-process load."""
    if name.endswith("k_norm.weight"):
        return torch.ones(shape, dtype=dtype)
    if name.endswith("k_norm.bias"):
        return torch.zeros(shape, dtype=dtype)
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=g).to(dtype)


def _init_indexers(model, names, dtype, param_filter, shard_fn) -> None:
    kept = [n for n in names if param_filter is None or param_filter(n)]
    shapes = dict((n, p.shape) for n, p in model.named_parameters())
    std = model.config.initializer_range
    for name in kept:
        t = fresh_indexer_tensor(name, shapes[name], std, target_dtype(name, dtype))
        if shard_fn is not None:
            t = shard_fn(name, t)
            if t is None:
                continue
        assign(model, name, t)
