"""The embedded demo meets the issue's bar (minutes on 2 CPU cores, hence slow)."""

import pytest

from dsa_train.config import load_recipe
from dsa_train.engine.trainer import train


@pytest.mark.slow
def test_demo_warmup_captures_attention_and_sparse_keeps_lm_loss(tmp_path):
    result = train(load_recipe("demo", [f"run_dir={tmp_path}/demo", "logging.wandb_mode=disabled",
                                        "logging.progress_bar=false"]))
    warmup, sparse = result.summary["warmup"], result.summary["sparse"]
    assert abs(warmup["start"]["indexer_kl_captured"]) < 0.1
    assert warmup["end"]["indexer_kl_captured"] >= 0.5
    assert sparse["end"]["lm_loss"] <= 1.05 * sparse["start"]["lm_loss"]
    assert (result.export_dir / "config.json").is_file()
