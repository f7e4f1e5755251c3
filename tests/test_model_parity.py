"""dsa_train's model is the same function as transformers' DeepSeek-V3 / V3.2 (fp32)."""

import pytest
import torch

import dsa_train
from tests.hf_tiny import PLAIN_ROPE, make_v3, make_v32

V3_CONFIGS = {
    "q_lora+yarn+groups": {},
    "no_q_lora": {"q_lora_rank": None},
    "plain_rope": {"rope_parameters": PLAIN_ROPE},
    "one_group_all_dense_first": {"n_group": 1, "topk_group": 1, "first_k_dense_replace": 2},
    "many_groups": {"n_routed_experts": 16, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 4},
}


def assert_close_logits(ours: torch.Tensor, ref: torch.Tensor) -> None:
    err = (ours - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= 1e-4 * scale, f"max |diff| {err:.3e} > 1e-4 x max |logit| {scale:.3e}"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(V3_CONFIGS))
def test_dense_logits_match_transformers_v3(tmp_path, name):
    ref_model = make_v3(tmp_path, seed=1, **V3_CONFIGS[name])
    model = dsa_train.from_pretrained(tmp_path, dtype=torch.float32)
    assert not model.config.has_indexer_weights  # dense checkpoint -> fresh indexers
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = ref_model(ids).logits
        for form in ("mha", "mqa"):
            ours = model(ids, attention="dense", mla_form=form).logits
            assert_close_logits(ours, ref)


def _capture_hf_topk(ref_model):
    captured = []
    hooks = [
        layer.self_attn.indexer.register_forward_hook(lambda m, i, o: captured.append(o))
        for layer in ref_model.model.layers
    ]
    return captured, hooks


@pytest.mark.parametrize("seq_len", [40, 53])
def test_sparse_logits_and_selection_match_transformers_v32(tmp_path, seq_len):
    ref_model = make_v32(tmp_path, seed=2)
    model = dsa_train.from_pretrained(tmp_path, dtype=torch.float32)
    assert model.config.has_indexer_weights and model.config.index_topk == 16
    ids = torch.randint(0, 256, (2, seq_len), generator=torch.Generator().manual_seed(3))
    captured, hooks = _capture_hf_topk(ref_model)
    with torch.no_grad():
        ref = ref_model(ids).logits
        out = model(ids, attention="sparse", return_topk=True)
    for h in hooks:
        h.remove()
    assert_close_logits(out.logits, ref)
    k = model.config.index_topk
    for layer, (hf_idx, ours) in enumerate(zip(captured, out.topk_indices)):
        for b in range(ids.shape[0]):
            for t in range(seq_len):
                hf_set = {int(s) for s in hf_idx[b, t] if s <= t}  # HF pads t < k rows with masked keys
                our_set = {int(s) for s in ours[b, t] if s >= 0}
                assert our_set == hf_set, f"layer {layer} row {b} query {t}"
                assert len(our_set) == min(t + 1, k)


def test_export_loads_in_transformers_v32(tmp_path):
    """dsa_train.save_pretrained writes the V3.2 layout that DeepseekV32ForCausalLM loads, same sparse logits."""
    from transformers import DeepseekV32ForCausalLM

    cfg = dsa_train.tiny_config(vocab_size=256, index_topk=8, index_n_heads=16, num_nextn_predict_layers=1)
    torch.manual_seed(0)
    model = dsa_train.DSAForCausalLM(cfg)
    from tests.hf_tiny import randomize_

    randomize_(model, 5)
    dsa_train.save_pretrained(model, tmp_path)
    ref_model = DeepseekV32ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_close_logits(model(ids, attention="sparse").logits, ref_model(ids).logits)
    again = dsa_train.from_pretrained(tmp_path)
    assert again.config.num_nextn_predict_layers == 1  # the MTP layer round-trips
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), again.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1
