"""`dsa-train eval` (dsa_train/eval): sparse vs dense vs oracle on tiny models built here, the per-layer
measurements, position buckets, the bf16-vs-FP8 overlap, passkey retrieval and bad input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from dsa_train import DSAForCausalLM, tiny_config
from dsa_train.checkpoint.tiny import make_tiny_checkpoint
from dsa_train.cli import main
from dsa_train.data import load_tokenizer
from dsa_train.eval.attention import LayerTensors, fp8_topk_overlap, layer_hooks, measure_layer
from dsa_train.eval.passkey import passkey_examples, score_example, summarize
from dsa_train.eval.positions import LossByPosition, token_losses
from dsa_train.eval.errors import EvalError
from dsa_train.eval.run import LoadedModel, check_same_tokenizer, mode_logits, model_source
from dsa_kernels.masking import chunk_valid_mask

T = 48


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return DSAForCausalLM(tiny_config(num_hidden_layers=2, index_topk=8)).eval()


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 4096, (1, T), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    return ids, labels, torch.arange(T)[None]


def losses_by_position(model, mode, k, batch, edges):
    ids, labels, pos = batch
    result = LossByPosition(edges)
    result.add(token_losses(mode_logits(model, mode, k, ids, pos), labels), labels, pos)
    return result


@pytest.mark.parametrize("mode", ["sparse", "oracle"])
def test_sparse_and_oracle_equal_dense_when_k_covers_every_key(model, batch, mode):
    edges = [0, 8, 16, 32, T]
    dense = losses_by_position(model, "dense", T, batch, edges)
    sparse = losses_by_position(model, mode, T, batch, edges)
    assert sparse.tokens == dense.tokens
    assert sparse.loss == pytest.approx(dense.loss, rel=1e-5)
    for a, b in zip(sparse.loss_sum, dense.loss_sum):
        assert a == pytest.approx(b, rel=1e-5)
    # at k below T they differ, and only past the first bucket [0, k): the comparison can fail
    small = losses_by_position(model, mode, 8, batch, edges)
    assert small.loss_sum[0] == pytest.approx(dense.loss_sum[0], rel=1e-5)
    assert small.loss != pytest.approx(dense.loss, rel=1e-6)


def test_buckets_combine_to_the_models_lm_loss(model):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(2, 4096, (2, T), generator=g)
    pos = torch.cat([torch.arange(20), torch.arange(T - 20)])[None].expand(2, T).contiguous()  # two packed documents
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    labels[:, 19] = -100  # the first document's end
    result = LossByPosition([0, 4, 8, 16, 32])
    with torch.no_grad():
        out = model(ids, labels=labels, position_ids=pos)
    result.add(token_losses(out.logits, labels), labels, pos)
    assert sum(result.tokens) == int((labels != -100).sum())
    assert result.loss == pytest.approx(float(out.lm_loss), rel=1e-5)
    assert result.tokens[-1] > 0  # positions past the last edge land in the last bucket


def captured_layers(model, ids) -> list[LayerTensors]:
    captured = []
    with layer_hooks(model, lambda i, attn, lt: captured.append(lt)):
        mode_logits(model, "dense", T, ids)
    return captured


def test_recall_and_overlap_reach_one_at_full_k_and_grow_with_k(model, batch):
    layers = captured_layers(model, batch[0])
    assert len(layers) == model.config.num_hidden_layers
    for lt in layers:
        ks = [1, 2, 4, 8, 16, T]
        values = [measure_layer(lt, k, fp8=False).values() for k in ks]
        full = values[-1]
        assert full["oracle_recall"] == pytest.approx(1.0, abs=1e-5)
        assert full["topk_recall"] == pytest.approx(1.0, abs=1e-5)
        assert full["oracle_overlap"] == pytest.approx(1.0)
        for key in ("oracle_recall", "topk_recall", "oracle_intersection"):
            series = [v[key] for v in values]
            assert all(b >= a - 1e-6 for a, b in zip(series, series[1:])), (key, series)
        for v in values:  # the oracle's set holds the most mass of any k keys
            assert v["oracle_recall"] >= v["topk_recall"] - 1e-6
            assert v["indexer_kl_captured"] <= 1.0
        assert values[0]["oracle_recall"] < 1.0


def _visible(T_: int) -> torch.Tensor:
    return chunk_valid_mask(torch.zeros(1, T_, dtype=torch.long), 0, T_, 0, T_)


@pytest.mark.parametrize("ue8m0", [False, True])
def test_fp8_overlap_is_one_when_scores_are_exactly_representable(ue8m0):
    g = torch.Generator().manual_seed(3)
    T_, H, D = 24, 2, 32
    values = torch.tensor([0.0, 0.5, 1.0, -1.0, 2.0])  # e4m3 and bf16 exact at a group max of 2
    q = values[torch.randint(0, 5, (1, T_, H, D), generator=g)]
    k = values[torch.randint(0, 5, (1, T_, D), generator=g)]
    q[..., 0], k[..., 0] = 2.0, 2.0  # every group's max is 2: power-of-two scales
    w = torch.rand(1, T_, H, generator=g)
    overlap = fp8_topk_overlap(q, k, w, _visible(T_), topk=4, ue8m0=ue8m0)
    assert torch.equal(overlap, torch.ones_like(overlap))


def test_fp8_overlap_drops_below_one_on_near_ties():
    # query 1 sees keys 0 and 1; key 1 wins by 2^-7 in bf16, and e4m3 rounds both to the same value
    # (the tie then goes to key 0)
    D = 32
    q = torch.zeros(1, 2, 1, D)
    q[..., 0] = 1.0
    k = torch.zeros(1, 2, D)
    k[:, :, 1] = 2.0  # the group max: scale 2 / 448
    k[0, 0, 0], k[0, 1, 0] = 1.0, 1.0 + 2 ** -7
    w = torch.ones(1, 2, 1)
    overlap = fp8_topk_overlap(q, k, w, _visible(2), topk=1)
    assert overlap.tolist() == [[1.0, 0.0]]


def copying_model(n: int = 3):
    """A constructed model that copies: at each position it finds the latest earlier occurrence of
    its last n tokens and predicts the token that followed it."""

    def logits_fn(ids: torch.Tensor) -> torch.Tensor:
        seq = ids[0]
        T_ = seq.numel()
        windows = seq.unfold(0, n, 1)  # [T - n + 1, n], window w ends at position w + n - 1
        same = (windows[:, None] == windows[None, :]).all(-1)
        earlier = torch.ones_like(same).tril(-1)
        match = same & earlier
        last = torch.where(match, torch.arange(len(windows))[None], -1).amax(-1)  # [W]
        logits = torch.zeros(1, T_, 4096)
        for w_end, j in enumerate(last.tolist()):
            if j >= 0:
                logits[0, w_end + n - 1, seq[j + n]] = 10.0
        return logits

    return logits_fn


def test_passkey_copy_model_retrieves_every_key_and_random_model_is_at_chance():
    tokenizer = load_tokenizer(None)
    examples = passkey_examples(tokenizer, 160, per_depth=2, seed=5)
    assert all(ex.input_ids.numel() == 160 for ex in examples)
    assert len({ex.key for ex in examples}) > 1
    copy = summarize([score_example(copying_model(), ex) for ex in examples])
    assert copy["accuracy"] == 1.0 and copy["token_accuracy"] == 1.0
    assert set(copy["by_depth"]) == {"0", "0.25", "0.5", "0.75", "1"}
    g = torch.Generator().manual_seed(6)
    random = summarize([score_example(lambda ids: torch.randn(1, ids.shape[1], 4096, generator=g), ex)
                        for ex in examples])
    assert random["accuracy"] == 0.0 and random["token_accuracy"] < 0.05  # chance: 1 / 4096 per token


# ---------------------------------------------------------------------------- the command
@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_v31")
    make_tiny_checkpoint(out)
    return out


@pytest.mark.slow
def test_eval_command_on_a_tiny_fp8_checkpoint(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "eval"
    code = main(["eval", str(tiny_checkpoint), "--seq-len", "128", "--topk", "32", "--num-sequences", "1",
                 "--passkey", "--passkey-per-depth", "1", "--out", str(out), "--no-progress"])
    assert code == 0
    doc = json.loads((out / "eval.json").read_text())
    length = doc["models"][0]["lengths"][0]
    assert set(length["modes"]) == {"dense", "sparse", "oracle"}
    for r in length["modes"].values():
        assert [b["bucket"] for b in r["buckets"]] == ["[0,32)", "[32,64)", "[64,128)"]
        assert r["tokens"] == sum(b["tokens"] for b in r["buckets"]) > 0
        assert r["passkey"]["examples"] == 5
    assert [row["layer"] for row in length["layers"]] == [0, 1]
    assert all(0.0 <= row["fp8_overlap"] <= 1.0 for row in length["layers"])
    assert any(out.glob("loss_by_position_*_T128.png"))
    assert any(out.glob("recall_by_layer_*_T128.png"))
    assert "dense" in capsys.readouterr().out


def bad_input(argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dsa-train: ") and "\n" not in err and "Traceback" not in err
    return err


def test_bad_input_gets_one_line(tiny_checkpoint, tmp_path, capsys):
    assert "does not exist" in bad_input(["eval", str(tmp_path / "nowhere")], capsys)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert "checkpoints/step_N" in bad_input(["eval", str(run_dir)], capsys)  # a run directory without export/ or checkpoint
    (run_dir / "export").mkdir()
    (run_dir / "export" / "config.json").write_text("{}")
    assert model_source(run_dir) == ("hf", run_dir / "export")
    err = bad_input(["eval", str(tiny_checkpoint), "--modes", "dense,bogus"], capsys)
    assert "bogus" in err and "dense,sparse,oracle" in err
    err = bad_input(["eval", str(tiny_checkpoint), "--seq-len", "32", "--topk", "64"], capsys)
    assert "not longer than top-k 64" in err
    small_vocab = tmp_path / "small_vocab"
    make_tiny_checkpoint(small_vocab, vocab_size=1024)
    err = bad_input(["eval", str(small_vocab), "--seq-len", "64", "--topk", "8"], capsys)
    assert "vocab" in err.lower() and "1024" in err


def test_data_errors_name_the_eval_flags_and_text_field_reads_another_field(tiny_checkpoint, tmp_path, capsys):
    """`dsa-train eval --data` errors named the recipe keys (data.sources, data.text_field), which eval
    has no place for, and a corpus whose text is under another field could not be evaluated at all:
    `--text-field` reads it."""
    from dsa_train.eval.data import heldout_sequences

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"content": f"document {i} " + "word " * 60}) + "\n" for i in range(8)))
    err = bad_input(["eval", str(tiny_checkpoint), "--data", str(tmp_path / "nope.jsonl"), "--seq-len", "64",
                     "--topk", "8", "--out", str(tmp_path / "e")], capsys)
    assert "Fix the path in --data" in err and "data.sources" not in err
    err = bad_input(["eval", str(tiny_checkpoint), "--data", str(docs), "--seq-len", "64", "--topk", "8",
                     "--out", str(tmp_path / "e")], capsys)
    assert "['content']" in err and "set --text-field to the field" in err and "data.text_field" not in err
    held = heldout_sequences([str(docs)], load_tokenizer(None), 64, 2, text_field="content")
    assert len(held.batches) == 2 and held.available >= 2


def test_eval_of_local_data_needs_no_datasets_package(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    """A core install (no `datasets`, docs/install.md) evaluates the bundled corpus and local files, which
    the data layer reads itself (as training does); before, `dsa-train eval` refused to start without
    `datasets` whatever its --data. A hub source still needs it, in one line naming the extra."""
    import sys

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"document {i} " + "word " * 60}) + "\n" for i in range(4)))
    for package in ("datasets", "matplotlib"):  # a core install has neither (the plots are skipped, one line)
        monkeypatch.setitem(sys.modules, package, None)  # not importable, find_spec gives None
    assert main(["eval", str(tiny_checkpoint), "--data", str(docs), "--seq-len", "64", "--topk", "8",
                 "--num-sequences", "1", "--modes", "dense", "--no-layer-metrics", "--out", str(tmp_path / "e"),
                 "--no-progress"]) == 0
    assert json.loads((tmp_path / "e" / "eval.json").read_text())["models"][0]["lengths"][0]["modes"]["dense"]["loss"] > 0
    assert "plots" in capsys.readouterr().out and not any((tmp_path / "e").glob("*.png"))
    err = bad_input(["eval", str(tiny_checkpoint), "--data", "some-owner/some-corpus", "--out", str(tmp_path / "f")], capsys)
    assert "datasets" in err and "dsa-train[data]" in err


def test_models_with_different_tokenizers_are_refused(tmp_path):
    other = tmp_path / "other_tokenizer"
    shutil.copytree(load_tokenizer(None).path.parent, other)
    spec = json.loads((other / "tokenizer.json").read_text())
    spec["model"]["dropout"] = 0.5  # another tokenizer (content hash), same vocabulary size
    (other / "tokenizer.json").write_text(json.dumps(spec))
    models = [LoadedModel("a", tmp_path, None, load_tokenizer(None), 8),
              LoadedModel("b", tmp_path, None, load_tokenizer(other), 8)]
    with pytest.raises(EvalError, match="different tokenizers"):
        check_same_tokenizer(models)
    check_same_tokenizer(models[:1] * 2)


def test_evaluate_batches_checks_positions_once_not_per_forward(model, batch, monkeypatch):
    # the rows' length is checked against max_position_embeddings once; no forward reads its
    # position_ids back (a device synchronization on a GPU); a length beyond the model is refused
    from dsa_train.eval.run import EvalOptions, evaluate_batches

    ids, labels, pos = batch
    reads = []
    real_max = torch.Tensor.max
    monkeypatch.setattr(torch.Tensor, "max", lambda self, *a, **k: (reads.append(self.shape), real_max(self, *a, **k))[1])
    opts = EvalOptions(modes=["dense", "sparse"], layer_metrics=False)
    results, _ = evaluate_batches(model, 8, [{"input_ids": ids, "labels": labels, "position_ids": pos}], T, opts)
    assert set(results) == {"dense", "sparse"} and not [s for s in reads if tuple(s) == tuple(pos.shape)], reads
    monkeypatch.setattr(model.config, "max_position_embeddings", T - 1)
    with pytest.raises(ValueError, match=f"eval rows of {T} tokens are beyond max_position_embeddings {T - 1}"):
        evaluate_batches(model, 8, [{"input_ids": ids, "labels": labels, "position_ids": pos}], T, opts)


def test_evaluate_batches_refuses_a_row_longer_than_its_seq_len_naming_the_fix(model, batch):
    # the positions are taken as checked from seq_len: a longer row is refused before any forward,
    # with the seq_len that would cover it
    from dsa_train.eval.run import EvalOptions, evaluate_batches

    ids, labels, pos = batch
    opts = EvalOptions(modes=["dense"], layer_metrics=False)
    with pytest.raises(ValueError, match=f"row of {T} tokens is longer than seq_len {T - 1}; pass seq_len={T}"):
        evaluate_batches(model, 8, [{"input_ids": ids, "labels": labels, "position_ids": pos}], T - 1, opts)


def test_lengths_beyond_the_models_positions_are_refused_in_every_mode(model, tmp_path):
    # d517cc9: the position bound is checked for dense-only evaluations too (it ran only with a
    # sparse mode), since no forward reads the positions back any more
    from dsa_train.eval.run import EvalError, check_lengths

    limit = model.config.max_position_embeddings
    models = [LoadedModel("m", tmp_path, model, None, 8)]
    for modes in (["dense"], ["dense", "sparse"]):
        with pytest.raises(EvalError, match=f"--seq-len {limit + 1} is beyond m's max_position_embeddings {limit}"):
            check_lengths([64, limit + 1], models, modes)
        check_lengths([64, limit], models, modes)
