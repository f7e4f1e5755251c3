"""Every way a checkpoint can be wrong fails with an error naming the tensor and the file."""

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

import dsa_train
from dsa_train.checkpoint import CheckpointError
from dsa_train.checkpoint.tiny import make_tiny_checkpoint
from tests.checkpoint_helpers import raw_tensors

INDEX = "model.safetensors.index.json"
KV_A = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    path = tmp_path_factory.mktemp("pristine")
    make_tiny_checkpoint(path, seed=0)
    return path


@pytest.fixture
def ckpt(pristine, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(pristine, path)
    return path


def shard_of(path, name):
    return path / json.loads((path / INDEX).read_text())["weight_map"][name]


def rewrite_shard(path, name, change):
    """Rewrite the shard holding `name` with change(tensors) applied."""
    shard = shard_of(path, name)
    tensors = {k: v for k, v in raw_tensors(path).items() if shard_of(path, k) == shard}
    change(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return shard


def edit_json(file, change):
    d = json.loads(file.read_text())
    change(d)
    file.write_text(json.dumps(d))


def load_error(path) -> str:
    with pytest.raises(CheckpointError) as e:
        dsa_train.from_pretrained(path)
    return str(e.value)


def test_missing_tensor(ckpt):
    name = "model.layers.1.mlp.experts.5.up_proj.weight"
    rewrite_shard(ckpt, name, lambda t: (t.pop(name), t.pop(name + "_scale_inv")))
    edit_json(ckpt / INDEX, lambda d: (d["weight_map"].pop(name), d["weight_map"].pop(name + "_scale_inv")))
    msg = load_error(ckpt)
    assert name in msg and "missing" in msg


def test_wrong_shape(ckpt):
    name = "model.layers.1.post_attention_layernorm.weight"
    shard = rewrite_shard(ckpt, name, lambda t: t.__setitem__(name, torch.ones(100, dtype=torch.bfloat16)))
    msg = load_error(ckpt)
    assert name in msg and shard.name in msg and "[100]" in msg and "[192]" in msg


def test_wrong_dtype(ckpt):
    name = "model.norm.weight"
    shard = rewrite_shard(ckpt, name, lambda t: t.__setitem__(name, torch.ones(192, dtype=torch.int32)))
    msg = load_error(ckpt)
    assert name in msg and shard.name in msg and "I32" in msg


def test_fp8_weight_without_scales(ckpt):
    rewrite_shard(ckpt, KV_A, lambda t: t.pop(KV_A + "_scale_inv"))
    edit_json(ckpt / INDEX, lambda d: d["weight_map"].pop(KV_A + "_scale_inv"))
    msg = load_error(ckpt)
    assert KV_A in msg and "weight_scale_inv" in msg


def test_truncated_shard(ckpt):
    shard = shard_of(ckpt, KV_A)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 1000])
    msg = load_error(ckpt)
    assert shard.name in msg and "truncated" in msg


def test_corrupt_shard_header(ckpt):
    shard = shard_of(ckpt, KV_A)
    data = bytearray(shard.read_bytes())
    data[8:40] = b"\xff" * 32
    shard.write_bytes(bytes(data))
    msg = load_error(ckpt)
    assert shard.name in msg and "corrupt" in msg


def test_corrupt_tensor_data(ckpt):
    name = "model.layers.0.input_layernorm.weight"
    shard = rewrite_shard(ckpt, name, lambda t: t[name].__setitem__(3, float("nan")))
    msg = load_error(ckpt)
    assert name in msg and shard.name in msg and "NaN" in msg


def test_config_that_does_not_match_the_weights(ckpt):
    edit_json(ckpt / "config.json", lambda d: d.__setitem__("moe_intermediate_size", 64))
    msg = load_error(ckpt)
    assert "mlp.experts" in msg and "config.json does not match the weights" in msg


def test_config_with_fewer_layers_than_the_weights(ckpt):
    edit_json(ckpt / "config.json", lambda d: d.__setitem__("num_hidden_layers", 1))
    msg = load_error(ckpt)
    assert "model.layers.2." in msg and "num_hidden_layers=1" in msg


def test_llama_directory(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    msg = load_error(tmp_path / "llama")
    assert "llama" in msg and "config.json" in msg and "DeepSeek-V3 architecture" in msg


def test_llama_weights_under_a_deepseek_config(ckpt, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=4096, hidden_size=192, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    for f in list(ckpt.glob("*.safetensors")) + [ckpt / INDEX]:
        f.unlink()
    shutil.copy(tmp_path / "llama" / "model.safetensors", ckpt / "model.safetensors")
    msg = load_error(ckpt)
    assert "another architecture" in msg and "q_proj" in msg


def test_tensor_missing_from_the_index(ckpt):
    edit_json(ckpt / INDEX, lambda d: d["weight_map"].pop(KV_A))
    msg = load_error(ckpt)
    assert KV_A in msg and "has no entry" in msg and INDEX in msg


def test_index_entry_for_a_tensor_the_shard_lacks(ckpt):
    edit_json(ckpt / INDEX, lambda d: d["weight_map"].__setitem__("model.layers.0.extra.weight", d["weight_map"][KV_A]))
    msg = load_error(ckpt)
    assert "model.layers.0.extra.weight" in msg and "no such tensor" in msg


def test_index_names_a_missing_shard(ckpt):
    shard = shard_of(ckpt, KV_A)
    shard.unlink()
    msg = load_error(ckpt)
    assert shard.name in msg and "missing" in msg


def test_no_config(ckpt):
    (ckpt / "config.json").unlink()
    assert "config.json" in load_error(ckpt)


def test_failed_load_returns_nothing_and_a_fixed_checkpoint_loads(ckpt):
    shard = shard_of(ckpt, KV_A)
    good = shard.read_bytes()
    shard.write_bytes(good[:-10])
    with pytest.raises(CheckpointError):
        dsa_train.from_pretrained(ckpt)
    shard.write_bytes(good)
    assert dsa_train.from_pretrained(ckpt).config.num_hidden_layers == 2
