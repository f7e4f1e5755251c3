"""Data layer: sources -> tokenizer -> packed sequences -> resumable, DP-sharded batches.

The trainer's entry point::

    loader = build_dataloader(cfg.data, dp_rank, dp_size)
    batch = next(loader)          # {"input_ids", "labels", "position_ids"}: [B, T] int64
    check_vocab(loader.tokenizer.vocab_size, model_cfg.vocab_size)
    sd = loader.state_dict()      # save with the checkpoint (per rank)
    loader.load_state_dict(sd)    # on resume: continues with the next batch

Document boundaries are carried by ``position_ids`` (restart at 0 at each document and row
start); ``labels`` are -100 at document ends. See ``packing.py`` and ``docs/data.md``.
"""

from __future__ import annotations

from dsa_train.config.schema import DataConfig
from dsa_train.data.dataset import PackedDataset, collate_sequences, default_cache_dir
from dsa_train.data.loader import DataLoaderState, PackedDataLoader, ShardedEpochSampler
from dsa_train.data.packing import (IGNORE_INDEX, PackingConfig, cu_seqlens_from_position_ids,
                                    doc_starts_from_position_ids, pack_documents,
                                    position_ids_from_cu_seqlens)
from dsa_train.data.prepare import prepare_data
from dsa_train.data.sources import (BUNDLED_CORPUS, BUNDLED_SOURCE, DataSourceError, DocumentStats,
                                    load_documents)
from dsa_train.data.streaming import StreamingPackedLoader
from dsa_train.data.tokenizer import BUNDLED_TOKENIZER_DIR, Tokenizer, check_vocab, load_tokenizer


DataLoaderLike = PackedDataLoader | StreamingPackedLoader


def build_dataloader(cfg: DataConfig, dp_rank: int = 0, dp_size: int = 1, held_out: int = 0) -> DataLoaderLike:
    """Build the infinite, resumable batch iterator for one data-parallel rank. `held_out`: the last
    rows of the packed stream that training never visits (the recipe's evaluation; map-style only).

    Returns an object with ``__next__`` -> ``{"input_ids", "labels", "position_ids"}`` each
    ``[micro_batch_size, seq_len]`` int64, ``state_dict()``, ``load_state_dict(sd)`` and
    ``.tokenizer`` (``vocab_size``, ``bos_id``, ``eos_id``, ``encode``).
    """
    tokenizer = load_tokenizer(cfg.tokenizer)
    sources = [cfg.sources] if isinstance(cfg.sources, str) else [str(s) for s in cfg.sources]
    if cfg.streaming and held_out:
        raise DataSourceError("eval.enabled=true needs held-out rows, which a streaming loader cannot set aside: "
                              "set data.streaming=false, or eval.enabled=false and run `dsa-train eval` afterwards")
    if cfg.streaming:
        hf_cache = str(default_cache_dir() / "hf_datasets") if cfg.cache_dir is None else \
            f"{cfg.cache_dir}/hf_datasets"
        return StreamingPackedLoader(
            sources, tokenizer, cfg.seq_len, cfg.micro_batch_size, cfg.seed, dp_rank, dp_size,
            text_field=cfg.text_field, txt_sample_by=cfg.txt_sample_by, add_bos=cfg.add_bos,
            add_eos=cfg.add_eos, shuffle_buffer=cfg.shuffle_buffer, split=cfg.split,
            hf_cache_dir=hf_cache)
    dataset = PackedDataset.from_sources(
        sources, tokenizer, cfg.seq_len, cache_dir=cfg.cache_dir, text_field=cfg.text_field,
        txt_sample_by=cfg.txt_sample_by, add_bos=cfg.add_bos, add_eos=cfg.add_eos,
        split=cfg.split)
    return PackedDataLoader(dataset, cfg.micro_batch_size, cfg.seed, dp_rank, dp_size,
                            num_workers=cfg.num_workers, tokenizer=tokenizer, held_out=held_out)


__all__ = [
    "BUNDLED_CORPUS", "BUNDLED_SOURCE", "BUNDLED_TOKENIZER_DIR", "DataConfig", "DataLoaderState",
    "DataSourceError", "DocumentStats", "IGNORE_INDEX", "PackedDataLoader", "PackedDataset",
    "PackingConfig", "ShardedEpochSampler", "StreamingPackedLoader", "Tokenizer",
    "build_dataloader", "check_vocab", "collate_sequences", "cu_seqlens_from_position_ids",
    "doc_starts_from_position_ids", "load_documents", "load_tokenizer", "pack_documents",
    "position_ids_from_cu_seqlens", "prepare_data",
]
