"""`dsa-train make-tiny-checkpoint | inspect | export` through the console entry point."""

import json
import subprocess
import sys
import time

import pytest

from dsa_train.cli import main as dsa_train_main


@pytest.mark.integration
def test_make_tiny_checkpoint_is_fast_and_inspect_reports_it(tmp_path, capsys):
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "dsa_train.cli", "make-tiny-checkpoint", str(tmp_path / "tiny"),
                          "--seed", "3"], capture_output=True, text=True, timeout=60)
    elapsed = time.perf_counter() - start
    assert out.returncode == 0, out.stderr
    # ~3 s on an idle 2-core machine, mostly interpreter and torch start-up; the bound leaves room
    # for a loaded CI machine (wall-clock bounds tighter than that were flaky here).
    assert elapsed < 20.0, f"make-tiny-checkpoint took {elapsed:.1f} s"
    assert dsa_train_main(["inspect", str(tmp_path / "tiny")]) == 0
    report = capsys.readouterr().out
    for expected in ("DeepseekV3ForCausalLM (model_type deepseek_v3)", "dense: indexers are initialized on load",
                     "2 + 1 MTP", "active per token", "F8_E4M3 72 tensors", "scale_fmt ue8m0",
                     "unexpected:     none", "status:         loads"):
        assert expected in report, expected


def test_dense_flag_gives_dense_mlps(tmp_path):
    assert dsa_train_main(["make-tiny-checkpoint", str(tmp_path / "d"), "--dense"]) == 0
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["first_k_dense_replace"] == cfg["num_hidden_layers"]
    assert dsa_train_main(["inspect", str(tmp_path / "d")]) == 0


def test_inspect_exits_nonzero_when_the_checkpoint_cannot_load(tmp_path, capsys):
    assert dsa_train_main(["make-tiny-checkpoint", str(tmp_path / "t")]) == 0
    cfg_file = tmp_path / "t" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["num_hidden_layers"] = 1
    cfg_file.write_text(json.dumps(cfg))
    capsys.readouterr()
    assert dsa_train_main(["inspect", str(tmp_path / "t")]) == 1
    out = capsys.readouterr().out
    assert "unexpected:     " in out and "model.layers.2." in out and "CANNOT LOAD" in out

    shard = sorted((tmp_path / "t").glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    assert dsa_train_main(["inspect", str(tmp_path / "t")]) == 2  # unreadable: one line (dsa_train/errors.py)
    assert "truncated" in capsys.readouterr().err


def test_export_reports_a_bad_source_and_bad_sizes(tmp_path, capsys):
    assert dsa_train_main(["export", str(tmp_path), str(tmp_path / "out")]) == 2  # one line (dsa_train/errors.py)
    err = capsys.readouterr().err
    assert "neither a Hugging Face model directory" in err and "pass a run directory (e.g. runs/demo)" in err
    assert "model*.pt" not in err  # the earlier format's file name (a checkpoint now has state/)
    assert dsa_train_main(["export", str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    assert f"{tmp_path / 'nope'} does not exist — pass a run directory" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        dsa_train_main(["export", str(tmp_path), str(tmp_path / "out"), "--max-shard-size", "lots"])
    assert e.value.code == 2


def test_inspect_a_training_checkpoint(tmp_path, capsys):
    import dsa_train
    from dsa_train.checkpoint.training import TrainerState, save_checkpoint
    from dsa_train.checkpoint.sharded_state import model_pieces

    model = dsa_train.DSAForCausalLM(dsa_train.tiny_config(num_hidden_layers=1))
    save_checkpoint(tmp_path / "ckpts", TrainerState(global_step=5), model_pieces(model), {}, {}, keep_last=1,
                    config_json=model.config.to_hf_dict())
    assert dsa_train_main(["inspect", str(tmp_path / "ckpts")]) == 0
    out = capsys.readouterr().out
    assert "training checkpoint (state)" in out and "step_00000005" in out and "status:         loads" in out
