"""The export that never gathers (checkpoint/streamed_export.py): shards planned from a training
checkpoint's metadata, written tensor by tensor by one process or by every rank of a job.

  * the planned shards are the ones the buffering ShardWriter cuts, and the streaming safetensors
    writer's files read back bit for bit with the safetensors library;
  * one process: the end-of-run export (from the checkpoint just committed) is byte for byte the
    file set `save_pretrained` writes from the trained model (today's single-process export);
  * 2 gloo ranks, EP2 x ZeRO-2: the end-of-run export (each rank writing its shards) equals
    `dsa-train export` of the same checkpoint, byte for byte, and holds every expert;
  * peak memory per rank, 2 gloo ranks, a 404 MB model: about one tensor, not the model."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.checkpoint_helpers import raw_tensors
from tests.helpers import free_port

ROOT = Path(__file__).resolve().parents[1]


def test_planned_shards_are_the_shard_writers_and_read_back_bit_for_bit(tmp_path):
    from dsa_train.checkpoint.export import ExportOptions, encode, encoded_specs
    from dsa_train.checkpoint.shard_writer import ShardWriter, plan_shards

    torch.manual_seed(0)
    tensors = {
        "model.embed_tokens.weight": torch.randn(64, 32, dtype=torch.bfloat16),
        "model.layers.0.self_attn.q_a_proj.weight": torch.randn(200, 130),  # FP8 with partial edge blocks
        "model.layers.0.self_attn.indexer.k_norm.bias": torch.randn(16, dtype=torch.bfloat16),  # kept fp32
        "model.layers.0.mlp.gate.e_score_correction_bias": torch.randn(8),
        "model.norm.weight": torch.randn(32),
        "model.layers.0.scalar": torch.tensor(3.0),
    }
    options = ExportOptions(dtype=torch.bfloat16, fp8=True, max_shard_bytes=30_000)
    groups = [encoded_specs(n, tuple(t.shape), t.dtype, options) for n, t in tensors.items()]
    encoded = [encode(n, t, options) for n, t in tensors.items()]
    assert [[(k, v.dtype, tuple(v.shape)) for k, v in e.items()] for e in encoded] == groups
    writer = ShardWriter(tmp_path, options.max_shard_bytes)
    for group in encoded:
        writer.add(group)
    files = writer.finish()
    planned = plan_shards(groups, options.max_shard_bytes)
    assert len(files) == len(planned) > 1
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    for shard, f in zip(planned, files):
        assert {spec[0] for g in shard for spec in groups[g]} == {k for k, v in index.items() if v == f.name}
    back = raw_tensors(tmp_path)
    want = {k: v for group in encoded for k, v in group.items()}
    assert set(back) == set(want)
    for name, t in want.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def _pop_marker(files: dict[str, bytes]) -> dict:
    """The marker (written_by_dsa_train.json), taken out: it names who wrote the directory, so it
    differs between two writers of the same model."""
    return json.loads(files.pop("written_by_dsa_train.json"))


TINY = ["data.seq_len=64", "data.micro_batch_size=1", "logging.wandb_mode=disabled", "logging.progress_bar=false",
        "probe_batches=0", "stages.sparse.topk=16",
        *[f"stages.{s}.{k}={v}" for s in ("pretrain", "warmup", "sparse")
          for k, v in (("steps", 1), ("global_batch_size", 2), ("warmup_steps", 1))]]


@pytest.mark.integration
def test_end_of_run_export_is_save_pretrained_of_the_trained_model(tmp_path):
    from dsa_train.checkpoint import save_pretrained
    from dsa_train.config import load_recipe
    from dsa_train.trainer.trainer import Trainer

    trainer = Trainer(load_recipe("demo", [*TINY, f"run_dir={tmp_path / 'run'}"]))
    result = trainer.run()
    save_pretrained(trainer.model, tmp_path / "today", tokenizer_dir=trainer.tokenizer_dir())
    ours, today = _files(result.export_dir), _files(tmp_path / "today")
    assert set(ours) == set(today) and any(n.endswith(".safetensors") for n in ours)
    marker = _pop_marker(ours)
    assert marker["kind"] == _pop_marker(today)["kind"] == "export"
    assert "end-of-run" in marker["written_by"], marker
    assert Path(marker["made_from"]).parent == (result.run_dir / "checkpoints").resolve(), marker
    assert json.loads(ours.pop("config.json")) == json.loads(today.pop("config.json"))
    assert all(ours[n] == today[n] for n in today), [n for n in today if ours[n] != today[n]]


def _torchrun(run_dir, extra):
    # DeepSpeed JIT-builds its CPU comm op into TORCH_EXTENSIONS_DIR: one per environment, so that
    # checkouts with other torch builds on the same machine do not rebuild it under each other's lock
    env = {"TORCH_EXTENSIONS_DIR": str(Path(sys.prefix) / "torch_extensions"), **os.environ, "DS_ACCELERATOR": "cpu",
           "OMP_NUM_THREADS": "1"}
    env.pop("DSA_FAULT", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "-m", "dsa_train.launch.rank", "--config-name", "demo", *TINY, *extra, f"run_dir={run_dir}"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.integration
def test_two_rank_expert_parallel_export_equals_the_offline_export(tmp_path):
    run = tmp_path / "run"
    out = _torchrun(run, ["parallel=zero2", "parallel.expert_parallel=2"])
    assert out.returncode == 0, out.stderr[-3000:]
    cmd = [sys.executable, "-m", "dsa_train.cli", "export", str(run), str(tmp_path / "offline"), "--dtype", "float32"]
    offline = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert offline.returncode == 0, offline.stderr[-3000:]
    ours, theirs = _files(run / "export"), _files(tmp_path / "offline")
    assert set(ours) == set(theirs)
    assert _pop_marker(ours)["kind"] == _pop_marker(theirs)["kind"] == "export"
    assert json.loads(ours.pop("config.json")) == json.loads(theirs.pop("config.json"))
    assert all(ours[n] == theirs[n] for n in theirs), [n for n in theirs if ours[n] != theirs[n]]
    # every expert of every MoE layer, with the values of the checkpoint the run committed last
    from dsa_train.checkpoint.training import latest_checkpoint, read_tensors

    exported = raw_tensors(run / "export")
    saved = read_tensors(latest_checkpoint(run / "checkpoints"))
    assert set(exported) == set(saved)
    assert all(torch.equal(exported[n], saved[n]) for n in saved)
    cfg = json.loads((run / "export" / "config.json").read_text())
    assert all(f"model.layers.{i}.mlp.experts.{e}.down_proj.weight" in exported for e in range(cfg["n_routed_experts"])
               for i in range(cfg["first_k_dense_replace"], cfg["num_hidden_layers"]))


@pytest.mark.slow
@pytest.mark.integration
def test_export_peak_memory_per_rank_is_about_one_tensor(tmp_path):
    """2 gloo ranks export a 404 MB fp32 checkpoint in 40 MB shards (benchmarks/export_memory.py).
    Measured (2-core box, loaded): rank 0 +52.9 MB, rank 1 +36.0 MB for a 16.8 MB largest tensor;
    DCP's read holds a tensor up to three times (the bytes read, the chunk loaded from them, the
    destination). Bound: 3 x largest + 16 MB, far below the model; reading the full state into one
    process (what a gather holds) grows by at least the model."""
    script = ROOT / "benchmarks" / "export_memory.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    make = subprocess.run([sys.executable, str(script), "make", str(tmp_path / "ck")], capture_output=True, text=True,
                          timeout=600, env=env)
    assert make.returncode == 0, make.stderr[-3000:]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           str(script), "export", str(tmp_path / "ck"), str(tmp_path / "out")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    ranks = [json.loads(f.read_text()) for f in sorted(tmp_path.glob("out.rank*.json"))]
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    for r in ranks:
        assert r["shards"] == 11 and r["shards_written"] >= 5  # both ranks write
        assert r["peak_growth_bytes"] <= 3 * r["largest_tensor_bytes"] + 16 * 2**20, r
        assert r["peak_growth_bytes"] < r["model_bytes"] / 6, r
    full = subprocess.run([sys.executable, str(script), "full", str(tmp_path / "ck")], capture_output=True, text=True,
                          timeout=600, env=env)
    assert full.returncode == 0, full.stderr[-3000:]
    whole = json.loads(full.stdout.splitlines()[-1])
    assert whole["peak_growth_bytes"] >= 0.95 * whole["model_bytes"], whole
