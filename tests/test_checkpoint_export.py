"""Terminus-layout FP8 checkpoint -> load -> train -> export (V3.2-Exp layout) -> transformers."""

import shutil

import pytest
import torch
from torch.nn import functional as F

import dsa_train
from dsa_train.checkpoint.cli import main as checkpoint_cli
from dsa_train.checkpoint.fp8 import is_quantized_in_reference
from dsa_train.checkpoint.tiny import make_tiny_checkpoint
from tests.checkpoint_helpers import BLOCK_ALIGNED, assert_close_logits, raw_tensors, read_json, reference_weights

pytestmark = pytest.mark.slow  # the module fixture loads, trains and exports (~8 s of CPU); ~25 s of CPU in all


def train_a_few_steps(model, steps=3, seed=0):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (2, 97), generator=g)
        out = model(ids[:, :-1], attention="sparse", labels=ids[:, 1:])
        out.lm_loss.backward()
        opt.step()
        opt.zero_grad()
    return model


def transformers_v32(path):
    import transformers
    from transformers import DeepseekV32ForCausalLM

    transformers.logging.set_verbosity_error()
    return DeepseekV32ForCausalLM.from_pretrained(path, dtype=torch.float32).eval().float()


def probe_ids(vocab):
    return torch.randint(0, vocab, (2, 150), generator=torch.Generator().manual_seed(7))  # > index_topk 64


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The tiny FP8 Terminus checkpoint (dims not multiples of 128), loaded, trained 3 steps, and
    saved as a dsa_train training checkpoint."""
    from dsa_train.checkpoint.training import TrainerState, save_checkpoint
    from dsa_train.checkpoint.sharded_state import model_pieces

    root = tmp_path_factory.mktemp("pipeline")
    make_tiny_checkpoint(root / "terminus", seed=1)
    model = train_a_few_steps(dsa_train.from_pretrained(root / "terminus"))
    step = save_checkpoint(root / "run" / "checkpoints", TrainerState(global_step=3), model_pieces(model), {}, {},
                           keep_last=2, config_json=model.config.to_hf_dict())
    return root, model, step


def test_fp32_export_gives_transformers_the_same_sparse_logits(trained, tmp_path):
    root, model, step = trained
    rc = checkpoint_cli(["export", str(step), str(tmp_path / "v32"), "--dtype", "float32", "--max-shard-size", "4MB"])
    assert rc == 0
    cfg = read_json(tmp_path / "v32" / "config.json")
    assert cfg["model_type"] == "deepseek_v32" and cfg["architectures"] == ["DeepseekV32ForCausalLM"]
    assert (cfg["index_n_heads"], cfg["index_head_dim"], cfg["index_topk"]) == (16, 32, 64)
    assert "quantization_config" not in cfg
    index = read_json(tmp_path / "v32" / "model.safetensors.index.json")["weight_map"]
    assert len(set(index.values())) > 1
    for f in set(index.values()):
        assert (tmp_path / "v32" / f).stat().st_size < 4.2e6
    assert (tmp_path / "v32" / "tokenizer.json").is_file()  # the run's (bundled) tokenizer
    ids = probe_ids(4096)
    with torch.no_grad():
        ours = model(ids, attention="sparse").logits
        assert_close_logits(ours, transformers_v32(tmp_path / "v32")(ids).logits)
        again = dsa_train.from_pretrained(tmp_path / "v32")
        assert_close_logits(again(ids, attention="sparse").logits, ours)


def test_export_layout_follows_the_reference_dtypes(trained, tmp_path):
    root, model, step = trained
    assert checkpoint_cli(["export", str(root / "run"), str(tmp_path / "out"), "--ue8m0"]) == 0  # newest step
    cfg = read_json(tmp_path / "out" / "config.json")
    assert cfg["quantization_config"]["scale_fmt"] == "ue8m0" and cfg["quantization_config"]["weight_block_size"] == [128, 128]
    assert cfg["torch_dtype"] == "bfloat16"
    raw = raw_tensors(tmp_path / "out")
    state = model.state_dict()
    assert {n for n in raw if not n.endswith("_scale_inv")} == set(state)
    for name, t in raw.items():
        if name.endswith("_scale_inv"):
            assert t.dtype == torch.float32 and torch.equal(torch.log2(t), torch.log2(t).round())
        elif is_quantized_in_reference(name):
            assert t.dtype == torch.float8_e4m3fn and name + "_scale_inv" in raw, name
        elif name.endswith(("k_norm.weight", "k_norm.bias", "e_score_correction_bias")):
            assert t.dtype == torch.float32, name
        else:
            assert t.dtype == torch.bfloat16, name  # weights_proj, norms, embeddings, lm_head, router, eh_proj
    assert raw["model.layers.0.self_attn.indexer.weights_proj.weight"].dtype == torch.bfloat16
    # FP8 weights are the trained ones up to e4m3 rounding
    dq = reference_weights(tmp_path / "out")
    for name in ("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "model.layers.1.mlp.experts.3.up_proj.weight"):
        w = state[name]
        assert ((dq[name] - w).abs() <= w.abs() * 2**-4 + 2**-10 * w.abs().max()).all(), name


def test_fp8_export_loads_in_transformers_with_close_logits(tmp_path):
    """FP8 (ue8m0) export. transformers and dsa_train read the same dequantized weights: logits
    agree to 1e-4 x max|logit|. Against the trained fp32 model the export differs by FP8 rounding
    (relative error up to 2^-4 per weight) plus bf16 for the other tensors; in this random tiny
    model (near-tied router scores and near-flat logits) that flips some expert-routing and top-k
    decisions, so neither max|diff| nor argmax agreement is meaningful. The bound is on the
    relative RMS error of all logits, <= 0.3 (measured 0.19 here; a bf16-only export of the same
    model measures about 0.08), and their cosine similarity, >= 0.95 (measured 0.98)."""
    make_tiny_checkpoint(tmp_path / "terminus", seed=2, **BLOCK_ALIGNED)
    model = train_a_few_steps(dsa_train.from_pretrained(tmp_path / "terminus"), steps=2)
    dsa_train.save_pretrained(model, tmp_path / "fp8", fp8=True, ue8m0=True, dtype=torch.bfloat16)
    ids = probe_ids(4096)
    with torch.no_grad():
        hf = transformers_v32(tmp_path / "fp8")(ids).logits
        ours_on_export = dsa_train.from_pretrained(tmp_path / "fp8")(ids, attention="sparse").logits
        trained_logits = model(ids, attention="sparse").logits
    assert_close_logits(ours_on_export, hf)
    rel_rms = ((hf - trained_logits).norm() / trained_logits.norm()).item()
    cosine = F.cosine_similarity(hf.flatten(), trained_logits.flatten(), dim=0).item()
    assert rel_rms <= 0.3 and cosine >= 0.95, (rel_rms, cosine)


def test_export_of_a_dense_hf_directory_initializes_indexers_and_copies_the_tokenizer(tmp_path):
    make_tiny_checkpoint(tmp_path / "terminus", seed=5)
    assert checkpoint_cli(["export", str(tmp_path / "terminus"), str(tmp_path / "v32")]) == 0
    raw = raw_tensors(tmp_path / "v32")
    assert "model.layers.2.self_attn.indexer.wq_b.weight" in raw  # MTP layer too
    assert (tmp_path / "v32" / "tokenizer.json").read_bytes() == (tmp_path / "terminus" / "tokenizer.json").read_bytes()
    model = dsa_train.from_pretrained(tmp_path / "v32")
    assert model.config.has_indexer_weights


def test_training_checkpoint_without_config_json(trained, tmp_path):
    """Older training checkpoints have no config.json: --config, else the run's Hydra config."""
    root, model, step = trained
    run = tmp_path / "run"
    shutil.copytree(step, run / "checkpoints" / step.name)
    (run / "checkpoints" / step.name / "config.json").unlink()
    assert checkpoint_cli(["export", str(run), str(tmp_path / "no_config")]) == 2  # one line (dsa_train/errors.py)
    assert checkpoint_cli(["export", str(run), str(tmp_path / "a"), "--dtype", "float32", "--config", str(root / "terminus")]) == 0
    (run / ".hydra").mkdir()
    (run / ".hydra" / "config.yaml").write_text(f"model:\n  pretrained: {root / 'terminus'}\n  arch: {{}}\ndata:\n  tokenizer: null\n")
    assert checkpoint_cli(["export", str(run), str(tmp_path / "b"), "--dtype", "float32"]) == 0
    for out in ("a", "b"):
        again = dsa_train.from_pretrained(tmp_path / out)
        for name, p in model.state_dict().items():
            assert torch.equal(again.state_dict()[name], p), (out, name)


def test_rank_files_merge_by_their_layout(tmp_path):
    """A distributed checkpoint: each rank's model file + layout. Tensor-parallel slices are
    concatenated in order, replicas taken once, experts collected; a missing slice, a replica of
    another shape, or duplicate keys without a layout are errors naming the files."""
    import json

    from dsa_train.checkpoint.errors import CheckpointError
    from dsa_train.checkpoint.training_source import _read_state

    full = torch.arange(24.0).reshape(6, 4)
    norm = torch.ones(4)
    step = tmp_path / "step_00000001"
    step.mkdir()
    for r, (lo, hi) in enumerate([(0, 3), (3, 6)]):
        suffix = "" if r == 0 else f".rank{r:05d}"
        torch.save({"q.weight": full[lo:hi].clone(), "norm.weight": norm.clone(), f"experts.{r}.w": torch.full((2,), float(r))},
                   step / f"model{suffix}.pt")
        (step / f"layout{suffix}.json").write_text(json.dumps({"tensor_parallel": 2, "shards": {"q.weight": [0, lo, hi]}}))
    state, files = _read_state(step)
    assert torch.equal(state["q.weight"], full) and torch.equal(state["norm.weight"], norm)
    assert torch.equal(state["experts.1.w"], torch.ones(2)) and set(state) == {"q.weight", "norm.weight", "experts.0.w", "experts.1.w"}

    (step / "model.rank00001.pt").unlink()  # the second TP rank's file is gone
    torch.save({"q.weight": full[3:6].clone(), "norm.weight": torch.ones(5)}, step / "model.rank00002.pt")
    (step / "layout.rank00002.json").write_text(json.dumps({"tensor_parallel": 2, "shards": {}}))
    with pytest.raises(CheckpointError, match=r"norm.weight: replica in .*model.rank00002.pt has shape \(5,\)"):
        _read_state(step)
    torch.save({"q.weight": full[4:6].clone()}, step / "model.rank00002.pt")
    (step / "layout.rank00002.json").write_text(json.dumps({"shards": {"q.weight": [0, 4, 6]}}))
    with pytest.raises(CheckpointError, match=r"q.weight: slice \[4:6\] in .*model.rank00002.pt does not continue \[0:3\]"):
        _read_state(step)
    for f in step.glob("layout*.json"):
        f.unlink()
    torch.save({"norm.weight": norm.clone()}, step / "model.rank00002.pt")
    with pytest.raises(CheckpointError, match="norm.weight is in both .* has no layout.rank00002.json"):
        _read_state(step)
