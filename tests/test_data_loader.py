"""Batches: determinism, exact resume, data-parallel sharding, streaming, build_dataloader."""

import json
import re

import numpy as np
import pytest
import torch

from dsa_train.data import (DataConfig, PackedDataLoader, PackedDataset, ShardedEpochSampler,
                            StreamingPackedLoader, build_dataloader, load_tokenizer)
from dsa_train.data.packing import IGNORE_INDEX

SEQ_LEN = 64


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """~130 short documents of distinct text (plus two empty ones)."""
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    rng = np.random.default_rng(0)
    words = "the of and to in that he shall unto for his lord they be is him not them with".split()
    lines = []
    for i in range(130):
        body = " ".join(rng.choice(words, size=int(rng.integers(5, 60))))
        lines.append(json.dumps({"text": f"Document {i}. {body}"}))
    lines.insert(7, json.dumps({"text": ""}))
    lines.insert(50, json.dumps({"text": "   "}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def dataset(corpus, tokenizer, tmp_path_factory):
    return PackedDataset.from_sources([str(corpus)], tokenizer, SEQ_LEN,
                                      cache_dir=tmp_path_factory.mktemp("cache"))


def take(loader, n):
    return [next(loader) for _ in range(n)]


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            assert torch.equal(x[key], y[key]), key


def test_batches_have_shapes_and_boundaries(dataset, tokenizer):
    loader = PackedDataLoader(dataset, batch_size=3, seed=0)
    batch = next(loader)
    for key in ("input_ids", "labels", "position_ids"):
        assert batch[key].shape == (3, SEQ_LEN) and batch[key].dtype == torch.int64
    assert torch.equal(batch["input_ids"][:, 1:], torch.where(
        batch["labels"][:, :-1] == IGNORE_INDEX, batch["input_ids"][:, 1:], batch["labels"][:, :-1]))
    # Every BOS inside a row starts a new document at position 0, after an ignored EOS label.
    bos = batch["input_ids"] == tokenizer.bos_id
    assert (batch["position_ids"][bos] == 0).all()
    assert dataset.index["n_empty_documents_skipped"] == 2
    assert dataset.index["n_documents"] == 130


def test_same_seed_same_order_different_seed_different_order(dataset):
    a = take(PackedDataLoader(dataset, batch_size=2, seed=7), 5)
    b = take(PackedDataLoader(dataset, batch_size=2, seed=7), 5)
    c = take(PackedDataLoader(dataset, batch_size=2, seed=8), 5)
    assert_same_batches(a, b)
    assert not all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, c))


def test_epochs_differ_and_cover_all_sequences(dataset):
    sampler = ShardedEpochSampler(len(dataset), batch_size=1, seed=3)
    e0, e1 = sampler.epoch_batches(0).ravel(), sampler.epoch_batches(1).ravel()
    assert sorted(e0.tolist()) == sorted(e1.tolist()) == list(range(len(dataset)))
    assert not np.array_equal(e0, e1)


@pytest.mark.parametrize("num_workers", [0, pytest.param(1, marks=pytest.mark.integration)])  # 1: a worker process
def test_resume_yields_exactly_the_uninterrupted_batches(dataset, num_workers):
    batch_size = 4
    uninterrupted = PackedDataLoader(dataset, batch_size, seed=11)
    per_epoch = uninterrupted.batches_per_epoch
    consumed = per_epoch - 2  # resume shortly before an epoch boundary, then cross it
    reference = take(uninterrupted, consumed + 5)

    first = PackedDataLoader(dataset, batch_size, seed=11, num_workers=num_workers)
    take(first, consumed)
    state = json.loads(json.dumps(first.state_dict()))  # survives serialization
    assert state["epoch"] == 0 and state["batch_in_epoch"] == consumed

    resumed = PackedDataLoader(dataset, batch_size, seed=11, num_workers=num_workers)
    resumed.load_state_dict(state)
    assert_same_batches(take(resumed, 5), reference[consumed:])
    assert resumed.state_dict()["epoch"] == 1


def test_resume_with_different_settings_is_refused(dataset):
    loader = PackedDataLoader(dataset, batch_size=2, seed=1)
    next(loader)
    other = PackedDataLoader(dataset, batch_size=4, seed=1)
    with pytest.raises(ValueError, match="micro_batch_size: saved 2 vs now 4"):
        other.load_state_dict(loader.state_dict())


def test_dp_shards_are_disjoint_and_cover_the_epoch(dataset):
    dp_size, batch_size = 3, 2
    samplers = [ShardedEpochSampler(len(dataset), batch_size, 5, r, dp_size) for r in range(dp_size)]
    shards = [set(s.epoch_batches(0).ravel().tolist()) for s in samplers]
    assert all(len(s) == samplers[0].batches_per_epoch * batch_size for s in shards)
    assert not (shards[0] & shards[1] or shards[0] & shards[2] or shards[1] & shards[2])
    union = set().union(*shards)
    usable = len(dataset) // (dp_size * batch_size) * dp_size * batch_size
    assert union == set(samplers[0].epoch_permutation(0)[:usable].tolist())
    assert len(dataset) - len(union) < dp_size * batch_size
    # The loaders yield exactly those rows.
    loaders = [PackedDataLoader(dataset, batch_size, 5, r, dp_size) for r in range(dp_size)]
    for rank, loader in enumerate(loaders):
        batch = next(loader)
        rows = samplers[rank].epoch_batches(0)[0]
        assert torch.equal(batch["input_ids"], dataset.get_batch(rows)["input_ids"])


def test_streaming_resume_and_dp_disjoint(corpus, tokenizer):
    def make(rank=0, dp_size=1):
        return StreamingPackedLoader([str(corpus)], tokenizer, SEQ_LEN, 2, seed=4, dp_rank=rank,
                                     dp_size=dp_size, shuffle_buffer=50)

    uninterrupted = make()
    reference = take(uninterrupted, 70)
    assert uninterrupted.state_dict()["epoch"] == 1  # the reference crosses an epoch boundary
    first = make()
    take(first, 30)
    state = json.loads(json.dumps(first.state_dict()))
    assert state["epoch"] == 0 and state["doc_index"] > 0
    resumed = make()
    resumed.load_state_dict(state)
    assert_same_batches(take(resumed, 40), reference[30:])

    # Two ranks read disjoint documents of the epoch's stream.
    documents_seen = []
    for rank in range(2):
        loader = make(rank, 2)
        seen = set()
        while True:
            batch = next(loader)
            if loader.epoch > 0:
                break
            for row in batch["input_ids"]:
                seen |= {int(m) for m in re.findall(r"Document (\d+)\.", tokenizer.decode(row.tolist()))}
        documents_seen.append(seen)
    assert len(documents_seen[0]) > 40 and len(documents_seen[1]) > 40
    assert not documents_seen[0] & documents_seen[1]


def test_build_dataloader_bundled_end_to_end(tmp_path):
    cfg = DataConfig(seq_len=128, micro_batch_size=2, cache_dir=str(tmp_path), seed=1)
    loader = build_dataloader(cfg, dp_rank=1, dp_size=2)
    assert loader.tokenizer.vocab_size == 4096
    batch = next(loader)
    assert batch["input_ids"].shape == (2, 128)
    assert int(batch["input_ids"].max()) < loader.tokenizer.vocab_size
    # Second build hits the cache (same directory) and continues from the saved state.
    again = build_dataloader(cfg, dp_rank=1, dp_size=2)
    assert again.dataset.path == loader.dataset.path
    again.load_state_dict(loader.state_dict())
    assert_same_batches([next(again)], [next(loader)])
    assert len(list((tmp_path / "packed").glob("*/index.json"))) == 1


def test_build_dataloader_streaming(tmp_path):
    cfg = DataConfig(seq_len=128, micro_batch_size=2, streaming=True, cache_dir=str(tmp_path))
    loader = build_dataloader(cfg)
    batch = next(loader)
    assert batch["labels"].shape == (2, 128)
    assert loader.state_dict()["kind"] == "streaming"


def test_a_prepared_directory_streamed_is_refused_with_a_fix_that_works(tmp_path):
    """A prepare-data output is opened only by the map-style loader: as the only source of a
    streaming run it was refused with the fix "train on it as the only source", which it was."""
    from dsa_train.data.sources import DataSourceError

    prepared = tmp_path / "prepared"
    prepared.mkdir()
    (prepared / "index.json").write_text('{"format": "dsa_train.pretokenized"}')
    cfg = DataConfig(sources=[str(prepared)], seq_len=16, micro_batch_size=1, streaming=True,
                     cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataSourceError, match="is a prepare-data output") as err:
        next(build_dataloader(cfg))
    assert "data.streaming=false" in str(err.value)
