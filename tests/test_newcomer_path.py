"""The newcomer's path through the shipped 671B recipes, shrunk by `profile=smoke`:

    dsa-train make-tiny-checkpoint DIR                       (V3.1-Terminus layout, FP8)
    dsa-train --config-name v3.2_warmup profile=smoke model.pretrained=DIR
    dsa-train --config-name v3.2_sparse profile=smoke        (from the warm-up's smoke export)
    dsa-train export runs/v3.2_sparse-smoke OUT --fp8 --ue8m0 -> transformers DeepseekV32ForCausalLM
    dsa-train report runs/v3.2_sparse-smoke                  (summary + PNG plots)

All through the console script's `main` (in this process, to save start-up time), on the CPU.
"""

import json

import pytest
import torch

from dsa_train.checkpoint.tiny import make_tiny_checkpoint
from dsa_train.cli import main
from tests.checkpoint_helpers import BLOCK_ALIGNED

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL_TOPK = 128  # the tiny checkpoint's index_topk; the smoke profile trains with top-64


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import os

    root = tmp_path_factory.mktemp("newcomer")
    # dims multiples of 128: transformers' FP8 loader needs whole 128x128 scale blocks
    make_tiny_checkpoint(root / "tiny-v3.1", seed=3, index_topk=MODEL_TOPK, **BLOCK_ALIGNED)
    cwd = os.getcwd()
    os.chdir(root)
    try:
        assert main(["--config-name", "v3.2_warmup", "profile=smoke", f"model.pretrained={root / 'tiny-v3.1'}",
                     "logging.wandb_mode=disabled"]) == 0
        assert main(["--config-name", "v3.2_sparse", "profile=smoke", "logging.wandb_mode=offline"]) == 0
    finally:
        os.chdir(cwd)
    return root


def stage_steps(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["metrics"] for r in rows if "step" in r and "progress/stage" in r["metrics"]]


def test_smoke_profile_runs_the_warmup_recipe_stage_for_real(runs):
    run = runs / "runs" / "v3.2_warmup-smoke"
    steps = stage_steps(run)
    assert len(steps) == 3  # profile smoke: 3 steps of the recipe's one stage
    assert all(s["train/indexer_kl"] > 0 and "train/lm_loss" not in s for s in steps)  # eq. 3 only, no LM head
    saved = (run / ".hydra" / "config.yaml").read_text()
    assert "lr: 0.001" in saved and "context_parallel: 16" in saved  # the recipe as written, before the profile
    export = json.loads((run / "export" / "config.json").read_text())
    assert export["model_type"] == "deepseek_v32" and export["index_topk"] == MODEL_TOPK  # no sparse stage ran


def test_smoke_profile_runs_the_sparse_recipe_from_the_warmup_export(runs):
    run = runs / "runs" / "v3.2_sparse-smoke"
    steps = stage_steps(run)
    assert len(steps) == 3
    assert all(0 < s["train/topk_recall"] <= 1 and s["train/lm_loss"] > 0 for s in steps)
    header = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["run"]
    assert header["stages"]["sparse"]["topk"] == 64 and header["stages"]["sparse"]["lr"] == 7.3e-6
    assert list(run.glob("wandb/offline-run-*/run-*.wandb"))


def test_export_of_the_sparse_run_loads_in_transformers_with_the_trained_topk(runs, tmp_path, monkeypatch):
    import transformers
    from transformers import DeepseekV32ForCausalLM

    import dsa_train

    monkeypatch.chdir(runs)
    out = tmp_path / "v32"
    assert main(["export", "runs/v3.2_sparse-smoke", str(out), "--fp8", "--ue8m0"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["index_topk"] == 64  # the sparse stage's top-k, not the model's 128
    assert cfg["quantization_config"]["scale_fmt"] == "ue8m0"
    assert (out / "tokenizer.json").is_file()  # found from the run (data.tokenizer: ${model.pretrained})
    transformers.logging.set_verbosity_error()
    hf = DeepseekV32ForCausalLM.from_pretrained(out, dtype=torch.float32).eval().float()  # weights_proj stays bf16 otherwise
    ids = torch.randint(0, cfg["vocab_size"], (1, 160), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf(ids).logits
        ours = dsa_train.from_pretrained(out, dtype=torch.float32)(ids, attention="sparse").logits
    assert (ours - theirs).abs().max() <= 1e-4 * theirs.abs().max()


def test_report_prints_the_stages_and_writes_its_plots(runs, capsys):
    from PIL import Image

    run = runs / "runs" / "v3.2_sparse-smoke"
    assert main(["report", str(run)]) == 0
    text = capsys.readouterr().out
    assert "sparse" in text and "probe batches" in text and "KL-captured" in text
    for name in ("loss", "indexer", "topk_recall", "lr", "throughput"):
        png = run / "report" / f"{name}.png"
        with Image.open(png) as image:
            assert image.size[0] > 500 and image.getextrema() != ((255, 255), (255, 255), (255, 255), (255, 255))
