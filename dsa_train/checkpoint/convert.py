"""`dsa-train export`: a training checkpoint or a Hugging Face directory -> the V3.2-Exp layout.

Both sources are streamed. A training checkpoint is exported by `streamed_export` (shards
planned from its metadata, each written tensor by tensor: one tensor held at a time); a Hugging
Face source is read tensor by tensor into the shard writer, which holds about one output shard. A dense (V3 / V3.1) Hugging Face source gets
freshly initialized indexers, one layer at a time.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from ..model.config import DSAConfig
from ..model.indexer import LightningIndexer
from .errors import CheckpointError
from .export import ExportOptions, ExportResult, v32_config_json, write_hf_dir
from .hf_layout import is_hf_dir
from .loader import fresh_indexer_tensor, open_checkpoint
from .streamed_export import export_training_checkpoint

log = logging.getLogger(__name__)


def fresh_indexer_tensors(config: DSAConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Initialized indexer parameters of every layer (MTP included), one layer at a time."""
    n_layers = config.num_hidden_layers + (config.num_nextn_predict_layers or 0)
    shapes = {name: p.shape for name, p in LightningIndexer(config).named_parameters()}
    for i in range(n_layers):
        for name, shape in shapes.items():
            full = f"model.layers.{i}.self_attn.indexer.{name}"
            yield full, fresh_indexer_tensor(full, shape, config.initializer_range, torch.float32)


def export_checkpoint(
    src: str | os.PathLike,
    out: str | os.PathLike,
    options: ExportOptions,
    tokenizer_dir: str | os.PathLike | None = None,
    config: str | os.PathLike | None = None,
) -> ExportResult:
    src, out = Path(src), Path(out)
    if out.resolve() == src.resolve():
        raise CheckpointError(f"export would overwrite its source {src}; choose another output directory")
    if is_hf_dir(src):
        plan = open_checkpoint(src)
        tensors: Iterator = plan.tensors(torch.float32)
        if plan.match.dense:
            log.warning("%s is a dense checkpoint: the export gets freshly initialized indexers", src)
            tensors = _chain(tensors, fresh_indexer_tensors(plan.config))
        model_config = plan.config
        if tokenizer_dir is None and (src / "tokenizer.json").is_file():
            tokenizer_dir = src
    else:  # planned from the checkpoint's metadata, one tensor at a time (streamed_export.py)
        return export_training_checkpoint(src, out, options, tokenizer_dir, config)
    return write_hf_dir(out, v32_config_json(model_config, options), tensors, options, tokenizer_dir,
                        written_by="dsa-train export", made_from=str(src.resolve()))


def _chain(*iterators):
    for it in iterators:
        yield from it
