"""`dsa-train eval` of a training checkpoint (`<run>/checkpoints/step_N`, or a run that has no export
yet): the model read in one process by `dsa_train.checkpoint.from_training_checkpoint`, equal to the
model that was saved."""

from __future__ import annotations

import json

import pytest
import torch

from dsa_train import DSAForCausalLM, tiny_config
from dsa_train.checkpoint import from_training_checkpoint
from dsa_train.checkpoint.sharded_state import model_pieces
from dsa_train.checkpoint.training import TrainerState, save_checkpoint
from dsa_train.cli import main
from dsa_train.eval.run import EvalOptions, load_model, model_source


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run directory with two training checkpoints and no export; the model of the newest."""
    root = tmp_path_factory.mktemp("eval_ckpt") / "run"
    torch.manual_seed(0)
    model = DSAForCausalLM(tiny_config(num_hidden_layers=2, index_topk=8))
    for step in (1, 2):
        with torch.no_grad():
            model.model.embed_tokens.weight.add_(0.01 * step)  # the steps hold different weights
        save_checkpoint(root / "checkpoints", TrainerState(global_step=step), model_pieces(model), {}, {},
                        keep_last=2, config_json=model.config.to_hf_dict())
    return root, model


def test_the_loaded_model_is_the_saved_one(run, recwarn):
    root, model = run
    loaded, ckpt = from_training_checkpoint(root, dtype=torch.float32)  # the run: its newest step
    # one process is what is meant: DCP's "assuming the intent is to load in a single process" is not shown
    assert not [w for w in recwarn if "torch.distributed is disabled" in str(w.message)]
    assert ckpt.step_dir.name.endswith("2")
    saved = model.state_dict()
    assert loaded.state_dict().keys() == saved.keys()
    assert all(torch.equal(loaded.state_dict()[n], t) for n, t in saved.items())
    ids = torch.randint(2, 4096, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, attention="sparse", topk=8).logits,
                                   model(ids, attention="sparse", topk=8).logits, rtol=0, atol=0)
    bf16, _ = from_training_checkpoint(root, dtype=torch.bfloat16)  # the load's dtype policy, as from_pretrained's
    dtypes = {n: t.dtype for n, t in bf16.named_parameters()}
    assert dtypes["model.embed_tokens.weight"] == torch.bfloat16
    assert all(d == torch.float32 for n, d in dtypes.items() if n.endswith("weights_proj.weight"))


def test_eval_takes_a_step_directory_or_a_run_without_export(run, tmp_path, capsys):
    root, _ = run
    older = root / "checkpoints" / sorted(p.name for p in (root / "checkpoints").glob("step_*"))[0]
    assert model_source(root) == ("training", root / "checkpoints" / older.name.replace("1", "2"))
    assert model_source(older) == ("training", older)
    m = load_model(older, EvalOptions())
    assert m.path == older and m.topk == 8 and m.training is None  # no recipe recorded: nothing to compare
    out = tmp_path / "eval"
    argv = ["eval", str(older), "--seq-len", "32", "--num-sequences", "1", "--modes", "dense,sparse", "--out", str(out),
            "--no-progress"]
    assert main(argv) == 0, capsys.readouterr().err
    doc = json.loads((out / "eval.json").read_text())
    assert str(older) in json.dumps(doc)


def test_a_damaged_checkpoint_is_one_line(run, tmp_path, capsys):
    import shutil

    root, _ = run
    copy = tmp_path / "run"
    shutil.copytree(root, copy)
    for step in (copy / "checkpoints").glob("step_*"):  # every model file truncated
        for f in step.rglob("*"):
            if f.is_file() and f.suffix in (".distcp", ".pt"):
                f.write_bytes(f.read_bytes()[:16])
    assert main(["eval", str(copy), "--seq-len", "32", "--out", str(tmp_path / "e")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dsa-train: ") and "\n" not in err and "Traceback" not in err
    # eval's fix only (not export's "export an earlier step_* directory"), the step named once
    assert err.count(" — ") == 1 and err.endswith("pass another step (checkpoints/step_N) or the run's export/"), err
    assert "export an earlier" not in err and err.count("step_00000002") == 1, err


def test_a_run_whose_tokenizer_moved_is_read_with_the_tokenizer_given(tmp_path):
    """A run trained with a tokenizer directory that is gone (moved, another machine): the error says
    "pass --tokenizer DIR", so `eval --tokenizer` and `export --tokenizer` must then work (before: the
    run's tokenizer was looked up when the checkpoint was opened, so the error came whatever was
    passed; `inspect`, which needs no tokenizer, failed the same way)."""
    from dsa_train.checkpoint import CheckpointError
    from dsa_train.checkpoint.training_source import open_training_checkpoint
    from dsa_train.data import BUNDLED_TOKENIZER_DIR

    torch.manual_seed(0)
    model = DSAForCausalLM(tiny_config(num_hidden_layers=1, index_topk=8))
    recipe = {"run_dir": str(tmp_path / "run"), "checkpoint": {"dir": str(tmp_path / "run" / "checkpoints")},
              "data": {"tokenizer": str(tmp_path / "gone")}}
    save_checkpoint(tmp_path / "run" / "checkpoints", TrainerState(global_step=1, recipe=recipe), model_pieces(model),
                    {}, {}, keep_last=1, config_json=model.config.to_hf_dict())
    ckpt = open_training_checkpoint(tmp_path / "run")  # opened: its tokenizer is not needed to read it
    with pytest.raises(CheckpointError, match="pass --tokenizer DIR"):
        ckpt.tokenizer_dir
    m = load_model(tmp_path / "run", EvalOptions(tokenizer=str(BUNDLED_TOKENIZER_DIR)))
    assert m.tokenizer.path.parent == BUNDLED_TOKENIZER_DIR and m.model.config.vocab_size == model.config.vocab_size
