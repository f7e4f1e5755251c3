"""One dtype policy (dsa_train/model/dtypes.py) on every path that makes a model: in bf16, the router
bias, the token-load accumulators, RoPE's frequencies, the Hadamard matrix and the indexer's
weights_proj / k_norm stay fp32; everything else is bf16. (A new model once got `.to(bf16)`: the
router bias rounded, so its load-balancing update stalled near 0.5.)"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

import dsa_train
from dsa_train.model.dtypes import STORED_FP32, tensor_dtype, violations

BF16 = torch.bfloat16


def _assert_policy(model):
    assert violations(model, BF16) == []
    names = dict(model.named_buffers())
    assert any(n.endswith("e_score_correction_bias") for n in names)
    assert any(n.endswith("load_since_update") for n in names)
    for name, b in names.items():
        assert b.dtype == torch.float32, name
    params = dict(model.named_parameters())
    assert params["model.embed_tokens.weight"].dtype == BF16
    assert params["model.layers.0.self_attn.indexer.weights_proj.weight"].dtype == torch.float32


def test_from_scratch_in_the_trainer_keeps_the_policy():
    from dsa_train.config.recipes import compose_recipe, to_train_config
    from dsa_train.trainer.trainer import build_model

    cfg = to_train_config(compose_recipe("demo", ["model.dtype=bfloat16"]))
    model = build_model(cfg, vocab_size=512)
    _assert_policy(model)
    # the bias update that bf16 rounded away: 0.5 + 1e-3 is a different number in fp32
    bias = next(b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    bias.fill_(0.5)
    bias += 1e-3
    assert (bias > 0.5).all()


def test_pretrained_load_and_export_keep_the_policy(tmp_path):
    from dsa_train.checkpoint.tiny import make_tiny_checkpoint

    make_tiny_checkpoint(tmp_path / "v31")
    model = dsa_train.from_pretrained(tmp_path / "v31", dtype=BF16)
    _assert_policy(model)
    dsa_train.save_pretrained(model, tmp_path / "out")
    stored = {}
    for shard in (tmp_path / "out").glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            stored.update({name: f.get_slice(name).get_dtype() for name in f.keys()})
    biases = [n for n in stored if n.endswith("mlp.gate.e_score_correction_bias")]
    assert biases, "no router bias exported"
    for name, dtype in stored.items():
        if name.endswith(STORED_FP32):
            assert dtype == "F32", (name, dtype)
    assert stored["model.layers.0.self_attn.q_a_proj.weight"] == "BF16"


@pytest.mark.parametrize("name,buffer,expected", [
    ("model.layers.3.mlp.gate.e_score_correction_bias", True, torch.float32),
    ("model.layers.3.mlp.gate.e_score_correction_bias", False, torch.float32),  # as a checkpoint tensor
    ("model.layers.3.self_attn.indexer.k_norm.bias", False, torch.float32),
    ("model.layers.3.self_attn.indexer.wq_b.weight", False, BF16),
    ("model.rotary_emb.inv_freq", True, torch.float32),
])
def test_tensor_dtype(name, buffer, expected):
    assert tensor_dtype(name, BF16, buffer=buffer) == expected
