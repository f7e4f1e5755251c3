"""End-to-end runs on the tiny model: stage chaining, checkpoints and exact resume."""

import dataclasses
import json
import shutil

import pytest
import torch

import dsa_train
from dsa_train.config import load_recipe
from dsa_train.data import DataConfig, build_dataloader
from dsa_train.trainer.trainer import Trainer, train
from dsa_train.checkpoint.training import list_checkpoints, load_checkpoint, read_tensors
from dsa_train.stage import STAGE_KINDS

pytestmark = pytest.mark.integration

is_indexer_parameter = STAGE_KINDS["indexer"].trains


def tiny_run(run_dir, *extra):
    """The demo recipe cut to a few steps of short sequences: warmup 3 steps, sparse 3 steps."""
    return load_recipe("demo", [
        f"run_dir={run_dir}", "~stages.pretrain", "logging.wandb_mode=disabled", "logging.progress_bar=false",
        "data.seq_len=96", "data.micro_batch_size=2", "probe_batches=1", "deterministic=true",
        "stages.warmup.steps=3", "stages.warmup.global_batch_size=4",
        "stages.sparse.steps=3", "stages.sparse.global_batch_size=4", "stages.sparse.warmup_steps=1",
        "stages.sparse.topk=16", "stages.sparse.topk_recall_queries=4",
        "checkpoint.every_n_steps=2", "checkpoint.keep_last=0", *extra,
    ])


def test_chained_warmup_then_sparse(tmp_path, capsys):
    cfg = tiny_run(tmp_path / "run")
    trainer = Trainer(cfg)
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    result = trainer.run()

    assert [m["progress/stage"] for m in result.history] == [0, 0, 0, 1, 1, 1]
    assert "train/lm_loss" not in result.history[0] and "train/indexer_kl_captured" in result.history[0]
    assert "train/lm_loss" in result.history[-1] and "train/topk_recall" in result.history[-1]
    for key in ("perf/mfu", "perf/tokens_per_s", "optim/grad_norm", "optim/lr", "moe/expert_load_cv"):
        assert key in result.history[-1]

    # warm-up end: only the indexer moved
    names = [p.name for p in list_checkpoints(cfg.checkpoint.dir)]
    assert names == ["step_00000002", "step_00000003", "step_00000005", "step_00000006"]
    warmup_end = load_checkpoint(tmp_path / "run/checkpoints/step_00000003")
    assert warmup_end.optimizer is None and warmup_end.state.stage_index == 1
    warmup_model = read_tensors(warmup_end.path)
    moved = {n for n, v in initial.items() if not torch.equal(warmup_model[n], v)}
    assert moved and all(is_indexer_parameter(n) for n in moved)
    # sparse stage: the main model trains too, starting from the warm-up weights
    final = dict(trainer.model.named_parameters())
    assert not torch.equal(final["model.embed_tokens.weight"], warmup_model["model.embed_tokens.weight"])

    # the data position carries on: the sparse stage starts where the warm-up stopped
    fresh = build_dataloader(DataConfig(**dataclasses.asdict(cfg.data)), held_out=cfg.eval.num_sequences)
    for _ in range(3 * 2):
        next(fresh)
    assert warmup_end.data == fresh.state_dict()

    # export loads back as the same model
    reloaded = dsa_train.from_pretrained(result.export_dir)
    for name, value in reloaded.state_dict().items():
        torch.testing.assert_close(value, trainer.model.state_dict()[name], msg=name)
    assert json.loads((result.export_dir / "config.json").read_text())["model_type"] == "deepseek_v32"
    assert (result.export_dir / "tokenizer.json").is_file()
    assert json.loads((warmup_end.path / "config.json").read_text())["vocab_size"] == trainer.model.config.vocab_size

    summary = result.summary
    # start / end probes, and the demo's eval group at the stage end (docs/eval.md)
    assert set(summary) == {"warmup", "sparse"} and set(summary["sparse"]) == {"start", "end", "eval"}
    assert summary["warmup"]["start"]["lm_loss"] == summary["warmup"]["end"]["lm_loss"]  # frozen
    out = capsys.readouterr().out
    assert "indexer KL captured" in out and "export" in out


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    first = train(tiny_run(tmp_path / "run", "checkpoint.export=false"))
    losses = [m["train/loss"] for m in first.history]

    # keep only the checkpoint after warm-up step 2 (mid-stage: optimizer state, RNG, data)
    ckpt_dir = tmp_path / "run/checkpoints"
    for path in list_checkpoints(ckpt_dir):
        if path.name != "step_00000002":
            shutil.rmtree(path)
    resumed = train(tiny_run(tmp_path / "run", "checkpoint.export=false", "checkpoint.resume=true"))
    assert [m["progress/global_step"] for m in resumed.history] == [3, 4, 5, 6]
    assert [m["train/loss"] for m in resumed.history] == losses[2:]
    assert resumed.summary["sparse"] == first.summary["sparse"]


def test_resume_without_a_checkpoint_starts_fresh(tmp_path):
    result = train(tiny_run(tmp_path / "run", "checkpoint.resume=true", "checkpoint.export=false",
                            "stages.sparse.steps=1"))
    assert len(result.history) == 4


def test_checkpoints_are_pruned_to_keep_last(tmp_path):
    cfg = tiny_run(tmp_path / "run", "checkpoint.keep_last=2", "checkpoint.every_n_steps=1", "checkpoint.export=false")
    train(cfg)
    assert [p.name for p in list_checkpoints(cfg.checkpoint.dir)] == ["step_00000005", "step_00000006"]
    assert not [p for p in (tmp_path / "run/checkpoints").iterdir() if p.name.startswith(".tmp")]


def test_dense_fp8_checkpoint_to_dsa(tmp_path):
    """From a (tiny) DeepSeek-V3.1-Terminus-layout checkpoint, FP8 and without indexer tensors,
    through both stages to a V3.2 export that has them."""
    from dsa_train.checkpoint.cli import main as checkpoint_cli

    assert checkpoint_cli(["make-tiny-checkpoint", str(tmp_path / "terminus")]) == 0
    cfg = tiny_run(tmp_path / "run", f"model.pretrained={tmp_path / 'terminus'}",
                   f"data.tokenizer={tmp_path / 'terminus'}", "stages.warmup.steps=2", "stages.sparse.steps=1")
    result = train(cfg)
    from safetensors import safe_open

    exported = set()
    for shard in result.export_dir.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            exported.update(f.keys())
    assert "model.layers.0.self_attn.indexer.wq_b.weight" in exported
    assert "model.layers.0.self_attn.indexer.k_norm.bias" in exported
    assert json.loads((result.export_dir / "config.json").read_text())["model_type"] == "deepseek_v32"
    assert result.summary["warmup"]["end"]["indexer_kl"] < result.summary["warmup"]["start"]["indexer_kl"]
