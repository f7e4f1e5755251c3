"""The embedded demo meets the issue's bar (minutes on 2 CPU cores, hence slow)."""

import pytest

from dsa_train.config import load_recipe
from dsa_train.trainer.trainer import train

pytestmark = pytest.mark.integration


@pytest.mark.slow
def test_demo_warmup_captures_attention_and_sparse_keeps_lm_loss(tmp_path, capsys):
    result = train(load_recipe("demo", [f"run_dir={tmp_path}/demo", "logging.wandb_mode=disabled",
                                        "logging.progress_bar=false"]))
    warmup, sparse = result.summary["warmup"], result.summary["sparse"]
    assert abs(warmup["start"]["indexer_kl_captured"]) < 0.1
    assert warmup["end"]["indexer_kl_captured"] >= 0.5
    assert sparse["end"]["lm_loss"] <= 1.05 * sparse["start"]["lm_loss"]
    assert (result.export_dir / "config.json").is_file()
    # the eval group: every stage's end evaluated on held-out rows; the summary ends with the sparse stage's
    assert all("eval" in result.summary[name] for name in ("pretrain", "warmup", "sparse"))
    final = result.summary["sparse"]["eval"]
    assert final["topk"] == 64 and {"dense/loss", "sparse/loss", "oracle/loss"} <= set(final)
    out = capsys.readouterr().out
    section = out[out.rindex("sparse vs dense LM loss by position"):]
    assert "end of stage sparse" in section and "[0,64)" in section and "[128,256)" in section
    assert "sparse - dense" in section
