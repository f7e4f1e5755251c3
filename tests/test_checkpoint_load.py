"""The tiny V3.1-Terminus-layout checkpoint: its layout, and loading it (FP8 edge blocks, MTP,
fresh indexers, per-rank filters and slices)."""

import re

import pytest
import torch

import dsa_train
from dsa_train.checkpoint.tiny import make_tiny_checkpoint
from tests.checkpoint_helpers import raw_tensors, read_json, reference_weights


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_tiny_checkpoint(path, seed=3)
    return path


def test_tiny_checkpoint_has_the_terminus_layout(tiny):
    cfg = read_json(tiny / "config.json")
    assert cfg["model_type"] == "deepseek_v3" and cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert cfg["quantization_config"] == {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
        "weight_block_size": [128, 128], "scale_fmt": "ue8m0",
    }
    assert cfg["vocab_size"] == 4096 and cfg["hidden_size"] % 128
    raw = raw_tensors(tiny)
    index = read_json(tiny / "model.safetensors.index.json")["weight_map"]
    assert set(index) == set(raw) and len(set(index.values())) > 1
    L = cfg["num_hidden_layers"]
    for key in ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight",
                "shared_head.head.weight", "embed_tokens.weight", "self_attn.kv_b_proj.weight",
                "mlp.experts.7.down_proj.weight", "mlp.gate.e_score_correction_bias"):
        assert f"model.layers.{L}.{key}" in raw, key
    assert not any(".indexer." in n for n in raw)
    for name, t in raw.items():
        if name.endswith("_scale_inv"):
            w = raw[name[: -len("_scale_inv")]]
            assert w.dtype == torch.float8_e4m3fn and t.dtype == torch.float32
            assert t.shape == (-(-w.shape[0] // 128), -(-w.shape[1] // 128))
            assert torch.equal(torch.log2(t), torch.log2(t).round())  # ue8m0
        elif t.dtype == torch.float8_e4m3fn and name + "_scale_inv" not in raw:
            raise AssertionError(f"{name} is FP8 without scales")
    assert raw["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].shape == (80, 192)  # edge blocks
    assert raw["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    assert raw["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    for name in ("model.embed_tokens.weight", "lm_head.weight", f"model.layers.{L}.eh_proj.weight"):
        assert raw[name].dtype == torch.bfloat16
    assert (tiny / "tokenizer.json").is_file() and (tiny / "tokenizer_config.json").is_file()


def test_loaded_weights_equal_a_reference_dequantization(tiny):
    model = dsa_train.from_pretrained(tiny, dtype=torch.float32)
    assert not model.config.has_indexer_weights and model.config.num_nextn_predict_layers == 1
    ref = reference_weights(tiny)
    state = model.state_dict()
    for name, value in ref.items():
        assert torch.equal(state[name], value), name
    missing = set(state) - set(ref)
    assert missing and all(".indexer." in n for n in missing)  # dense: fresh indexers
    wk = state["model.layers.0.self_attn.indexer.wk.weight"]
    assert wk.abs().sum() > 0 and torch.equal(state["model.layers.0.self_attn.indexer.k_norm.weight"], torch.ones(32))
    ids = torch.randint(0, 4096, (1, 80), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(model(ids, attention="sparse").logits).all()


def test_bf16_load_keeps_indexer_projections_and_router_bias_fp32(tiny):
    model = dsa_train.from_pretrained(tiny, dtype=torch.bfloat16)
    dtypes = {n: p.dtype for n, p in model.state_dict().items()}
    assert dtypes["model.layers.0.self_attn.q_a_proj.weight"] == torch.bfloat16
    assert dtypes["model.layers.0.self_attn.indexer.weights_proj.weight"] == torch.float32
    assert dtypes["model.layers.1.mlp.gate.e_score_correction_bias"] == torch.float32
    ref = reference_weights(tiny)["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert torch.equal(model.state_dict()["model.layers.1.mlp.gate.e_score_correction_bias"], ref)


def test_v32_checkpoint_keeps_its_indexer(tiny, tmp_path):
    model = dsa_train.from_pretrained(tiny)
    dsa_train.save_pretrained(model, tmp_path / "v32")
    again = dsa_train.from_pretrained(tmp_path / "v32")
    assert again.config.has_indexer_weights
    for name, value in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], value), name


def test_rank_filter_and_tensor_parallel_slices(tiny):
    """A rank owning experts {0, 1} and half of every o_proj's input columns."""
    expert = re.compile(r"\.mlp\.experts\.(\d+)\.")

    def owns(name):
        m = expert.search(name)
        return m is None or int(m.group(1)) < 2

    def tp_slice(name, t):
        if name.endswith("self_attn.o_proj.weight"):
            return t[:, : t.shape[1] // 2].clone()
        return t

    full = reference_weights(tiny)
    model = dsa_train.from_pretrained(tiny, torch.float32, param_filter=owns, shard_fn=tp_slice)
    params = dict(model.named_parameters())
    for name, p in params.items():
        if expert.search(name) and not owns(name):
            assert p.is_meta, name
        elif name.endswith("o_proj.weight"):
            assert torch.equal(p, full[name][:, : full[name].shape[1] // 2]), name
        elif name in full:
            assert not p.is_meta and torch.equal(p, full[name]), name
    assert not params["model.layers.0.self_attn.indexer.wq_b.weight"].is_meta  # owned: initialized


def test_shard_fn_returning_none_drops_the_tensor(tiny):
    model = dsa_train.from_pretrained(tiny, shard_fn=lambda name, t: None if name == "lm_head.weight" else t)
    assert model.lm_head.weight.is_meta and not model.model.embed_tokens.weight.is_meta


def test_transformers_fused_experts_are_split(tmp_path):
    """transformers-5 fused expert tensors load as per-expert weights."""
    from safetensors.torch import save_file

    from tests.hf_tiny import make_v3

    ref = make_v3(tmp_path / "v3", seed=4)
    raw = raw_tensors(tmp_path / "v3")
    fused = {}
    for layer in range(1, 3):
        p = f"model.layers.{layer}.mlp.experts"
        gate_up = [torch.cat([raw.pop(f"{p}.{e}.gate_proj.weight"), raw.pop(f"{p}.{e}.up_proj.weight")]) for e in range(8)]
        fused[f"{p}.gate_up_proj"] = torch.stack(gate_up)
        fused[f"{p}.down_proj"] = torch.stack([raw.pop(f"{p}.{e}.down_proj.weight") for e in range(8)])
    out = tmp_path / "fused"
    out.mkdir()
    (out / "config.json").write_text((tmp_path / "v3" / "config.json").read_text())
    save_file({**raw, **fused}, str(out / "model.safetensors"), metadata={"format": "pt"})
    a, b = dsa_train.from_pretrained(tmp_path / "v3"), dsa_train.from_pretrained(out)
    for name, p in a.state_dict().items():
        if ".indexer." not in name:
            assert torch.equal(p, b.state_dict()[name]), name
    del ref


def test_scales_stored_as_e8m0_load_the_same(tiny, tmp_path):
    """Some converted checkpoints store ue8m0 scales as float8_e8m0fnu instead of fp32."""
    import shutil

    from safetensors.torch import save_file

    out = tmp_path / "e8m0"
    shutil.copytree(tiny, out)
    for f in out.glob("model-*.safetensors"):
        tensors = raw_tensors_of_file(f)
        tensors = {k: v.to(torch.float8_e8m0fnu) if k.endswith("_scale_inv") else v for k, v in tensors.items()}
        save_file(tensors, str(f), metadata={"format": "pt"})
    a, b = dsa_train.from_pretrained(tiny).state_dict(), dsa_train.from_pretrained(out).state_dict()
    for name, value in a.items():
        if ".indexer." not in name:
            assert torch.equal(b[name], value), name


def raw_tensors_of_file(f):
    from safetensors import safe_open

    with safe_open(str(f), framework="pt") as h:
        return {k: h.get_tensor(k) for k in h.keys()}
