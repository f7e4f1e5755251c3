"""DSA behaviour of the model: forms, modes, gradient routing, packing and edge cases."""

import pytest
import torch

import dsa_train
from dsa_train.model.moe import MoE
from tests.hf_tiny import randomize_


def tiny(**kw):
    torch.manual_seed(0)
    cfg = dsa_train.tiny_config(**{"index_topk": 8, "index_n_heads": 8, **kw})
    model = dsa_train.DSAForCausalLM(cfg)
    randomize_(model, 3)
    return model


def ids(B=2, T=24, seed=0, vocab=4096):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def packed_positions(lengths_per_row, T):
    rows = []
    for lengths in lengths_per_row:
        assert sum(lengths) == T
        rows.append(torch.cat([torch.arange(n) for n in lengths]))
    return torch.stack(rows)


@torch.no_grad()
def test_mha_and_mqa_forms_are_the_same_function():
    model = tiny()
    x = ids()
    pos = packed_positions([[10, 14], [24]], 24)
    mha = model(x, attention="dense", mla_form="mha", position_ids=pos).logits
    mqa = model(x, attention="dense", mla_form="mqa", position_ids=pos).logits
    torch.testing.assert_close(mha, mqa, rtol=1e-4, atol=1e-5)


@torch.no_grad()
def test_sparse_with_k_at_least_seq_len_equals_dense():
    model = tiny()
    x = ids(T=20)
    dense = model(x, attention="dense").logits
    for k in (20, 64):
        sparse = model(x, attention="sparse", topk=k).logits
        torch.testing.assert_close(sparse, dense, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(model(x, attention="sparse", topk=4).logits, dense, atol=1e-4)


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters()}


def test_sparse_gradient_routing():
    model = tiny()
    x = ids(T=30)
    out = model(x, attention="sparse", labels=x, indexer_loss=True)
    out.lm_loss.backward(retain_graph=True)
    for n, g in _grads(model).items():
        if ".indexer." in n:
            assert g is None or bool((g == 0).all()), f"LM loss reached indexer parameter {n}"
    lm_grads = {n: g.clone() for n, g in _grads(model).items() if g is not None}
    assert any(".self_attn.q_b_proj" in n and g.abs().sum() > 0 for n, g in lm_grads.items())
    model.zero_grad(set_to_none=True)
    out.indexer_loss.backward()
    touched = 0
    for n, g in _grads(model).items():
        if ".indexer." in n:
            touched += int(g is not None and g.abs().sum() > 0)
        else:
            assert g is None or bool((g == 0).all()), f"indexer loss reached main parameter {n}"
    assert touched > 0


def test_dense_warmup_trains_only_the_indexer():
    model = tiny()
    for n, p in model.named_parameters():
        p.requires_grad_(".indexer." in n)
    x = ids(T=30)
    out = model(x, attention="dense", indexer_loss=True, compute_logits=False)
    assert out.logits is None and out.lm_loss is None
    out.indexer_loss.backward()
    got = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert got and all(".indexer." in n for n in got)
    main_indexers = [n for n, _ in model.named_parameters() if ".indexer." in n and "layers.2." not in n]
    assert set(main_indexers) <= {n for n, p in model.named_parameters() if p.grad is not None}


def test_packed_documents_never_select_across_boundaries():
    model = tiny()
    T = 40
    pos = packed_positions([[5, 20, 15], [3, 3, 34]], T)  # docs shorter than k = 8, rows differ
    x = ids(T=T)
    with torch.no_grad():
        out = model(x, attention="sparse", position_ids=pos, return_topk=True)
    doc_start = torch.arange(T) - pos
    for layer_idx in out.topk_indices:
        for b in range(2):
            for t in range(T):
                sel = layer_idx[b, t]
                chosen = sel[sel >= 0]
                assert bool(((chosen >= doc_start[b, t]) & (chosen <= t)).all())
                n_valid = t - int(doc_start[b, t]) + 1
                assert len(chosen) == min(n_valid, 8)  # t < k: every valid key, rest -1


@torch.no_grad()
def test_packed_rows_equal_separate_documents():
    """A packed row gives each document the logits it gets alone (dense and sparse)."""
    model = tiny()
    a, b = ids(B=1, T=13, seed=1), ids(B=1, T=19, seed=2)
    packed = torch.cat([a, b], dim=1)
    pos = packed_positions([[13, 19]], 32)
    for mode in ("dense", "sparse"):
        joint = model(packed, attention=mode, position_ids=pos).logits
        torch.testing.assert_close(joint[:, :13], model(a, attention=mode).logits, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(joint[:, 13:], model(b, attention=mode).logits, rtol=1e-4, atol=1e-5)
    cu = torch.tensor([0, 13, 32])
    torch.testing.assert_close(model(packed, cu_seqlens=cu).logits, model(packed, position_ids=pos).logits)


@pytest.mark.parametrize("T", [1, 7, 33])
def test_lengths_below_k_and_not_multiple_of_chunk(T):
    model = tiny()
    x = ids(T=T)
    out = model(x, attention="sparse", labels=x, indexer_loss=True)
    assert torch.isfinite(out.logits).all() and torch.isfinite(out.indexer_loss)
    out.indexer_loss.backward()
    for n, p in model.named_parameters():
        if p.grad is not None:
            assert torch.isfinite(p.grad).all(), n


def test_indexer_loss_metrics_and_recall():
    model = tiny()
    x = ids(T=48)
    out = model(x, attention="sparse", indexer_loss=True, measure_topk_recall=6)
    m = out.metrics
    assert 0.0 < m["topk_recall"] <= 1.0 + 1e-6
    assert m["indexer_kl"] >= 0 and m["indexer_kl_uniform"] >= 0
    assert {"indexer_kl/layer_0", "indexer_kl/layer_1"} <= set(m)
    dense = model(x, attention="dense", indexer_loss=True, topk=8)
    assert dense.metrics["indexer_kl"] != m["indexer_kl"]
    full = model(x, attention="sparse", measure_topk_recall=6, topk=64)
    assert full.metrics["topk_recall"] == pytest.approx(1.0, abs=1e-5)


def indexer_parameters(model) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if ".indexer." in name}


@torch.no_grad()
@pytest.mark.parametrize("attention", ["dense", "sparse"])
def test_kl_captured_of_a_uniform_indexer_is_zero(attention):
    model = tiny()
    x = ids(T=32)
    assert model(x, attention=attention, indexer_loss=True).metrics["indexer_kl_captured"] < -1.0  # random indexer
    for name, p in indexer_parameters(model).items():
        if name.endswith(".indexer.weights_proj.weight"):
            p.zero_()  # every head weight 0: every visible key scores 0, a uniform indexer
    m = model(x, attention=attention, indexer_loss=True).metrics
    assert m["indexer_kl_uniform"] > 0.01  # the main attention is far from uniform: a real check
    assert m["indexer_kl_captured"] == pytest.approx(0.0, abs=1e-4)


@pytest.mark.slow
def test_kl_captured_rises_as_the_indexer_learns_the_attention():
    model = tiny()
    x = ids(T=32)
    opt = torch.optim.Adam(indexer_parameters(model).values(), lr=2e-2)
    captured = []
    for step in range(7):
        out = model(x, attention="dense", indexer_loss=True)
        if step % 3 == 0:
            captured.append(out.metrics["indexer_kl_captured"])
        opt.zero_grad()
        out.indexer_loss.backward()
        opt.step()
    assert captured == sorted(captured) and captured[0] < captured[-1] < 1.0, captured


def test_kl_captured_is_one_for_the_true_attention_and_grows_towards_it():
    """An indexer whose scores are log p (its softmax is the target p) captures all of the KL; the
    scores t * log p sharpen from uniform (t = 0) to p (t = 1), and the captured share grows with t."""
    from dsa_kernels.ops.indexer_kl import kl_rows

    from dsa_train.loss import metric_values

    g = torch.Generator().manual_seed(0)
    p = torch.softmax(3 * torch.randn(6, 20, generator=g), dim=-1)  # 6 query rows over 20 keys
    valid = torch.ones_like(p, dtype=torch.bool)

    def captured(t):
        kl, kl_uniform = kl_rows(p, t * torch.log(p), valid)
        sums = {"indexer_kl": (float(kl.sum()), 6.0), "indexer_kl_uniform": (float(kl_uniform.sum()), 6.0)}
        return metric_values(sums)["indexer_kl_captured"]

    values = [captured(t) for t in (0.0, 0.25, 0.5, 0.75, 1.0)]
    assert values[0] == pytest.approx(0.0, abs=1e-6) and values[-1] == pytest.approx(1.0, abs=1e-6)
    assert all(a < b for a, b in zip(values, values[1:])), values


def test_router_group_limited_selection_and_bias_only_for_choice():
    model = tiny(n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2)
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    router = moe.gate
    x = torch.randn(64, model.config.hidden_size)
    with torch.no_grad():
        router.e_score_correction_bias.zero_()
        router.e_score_correction_bias[0] = 100.0  # expert 0 always chosen...
        experts, weights = router(x)
    assert bool((experts == 0).any(dim=-1).all())
    scores = torch.sigmoid(x @ router.weight.T)
    picked = scores.gather(1, experts)
    # ...but its weight comes from the unbiased score, normalized, times routed_scaling_factor
    torch.testing.assert_close(weights, picked / picked.sum(-1, keepdim=True) * 2.5)
    groups = experts // 2  # 4 groups of 2 experts
    assert all(len(set(g.tolist())) <= 2 for g in groups)  # at most topk_group groups per token


def test_aux_free_bias_update_moves_towards_balance():
    model = tiny()
    x = ids(T=64)
    with torch.no_grad():
        model(x)
    moe = model.main_moe_modules()[0]
    load = moe.last_expert_load.clone()
    before = moe.gate.e_score_correction_bias.clone()
    model.update_router_bias(0.01)
    delta = moe.gate.e_score_correction_bias - before
    over = load > load.mean()
    assert bool((delta[over] < 0).all()) and bool((delta[load < load.mean()] > 0).all())


def test_router_bias_update_uses_every_micro_batch_since_the_last_update():
    model = tiny().train()
    moe = model.main_moe_modules()[0]
    loads = []
    with torch.no_grad():
        for seed in (1, 2, 3):
            model(ids(T=32, seed=seed))
            loads.append(moe.last_expert_load.clone())
    total = sum(loads)
    torch.testing.assert_close(moe.load_since_update, total)
    before = moe.gate.e_score_correction_bias.clone()
    model.update_router_bias(0.01)
    expected = before + 0.01 * torch.sign(total.mean() - total)
    torch.testing.assert_close(moe.gate.e_score_correction_bias, expected)
    assert float(moe.load_since_update.sum()) == 0.0


def test_mtp_loss_when_enabled():
    model = tiny()
    x = ids(T=16)
    out = model(x, labels=x, mtp=True)
    assert out.mtp_loss is not None and torch.isfinite(out.mtp_loss)
    out.mtp_loss.backward()
    mtp = model.mtp_layers()[0]
    assert mtp.eh_proj.weight.grad is not None and mtp.eh_proj.weight.grad.abs().sum() > 0
    assert model(x, labels=x).mtp_loss is None  # off by default


def test_positions_beyond_the_model_fail_clearly():
    model = tiny(max_position_embeddings=16)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(ids(T=20))


def test_bf16_keeps_indexer_weights_proj_in_fp32():
    model = tiny().cast(torch.bfloat16)
    idx = model.model.layers[0].self_attn.indexer
    assert idx.weights_proj.weight.dtype == torch.float32 and idx.k_norm.bias.dtype == torch.float32
    assert idx.wq_b.weight.dtype == torch.bfloat16
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32  # RoPE frequencies never rounded
    assert model.main_moe_modules()[0].gate.e_score_correction_bias.dtype == torch.float32
    out = model(ids(T=12), attention="sparse", indexer_loss=True)
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.indexer_loss)


@pytest.mark.parametrize("recompute", ["full", "moe"])
def test_router_loads_are_counted_once_when_the_backward_recomputes_the_layer(recompute):
    """A recomputed layer routes the same tokens again in the backward; its loads (the bias update's
    and the metrics') are the forward's, counted once, as without recompute."""
    counted = {}
    for mode in ("none", recompute):
        torch.manual_seed(0)
        model = tiny().train()
        for layer in model.model.layers:
            layer.recompute = mode
        out = model(ids(T=32, seed=1), labels=ids(T=32, seed=1))
        out.lm_loss_sum.backward()
        counted[mode] = [moe.load_since_update.clone() for moe in model.main_moe_modules()]
    assert all(float(load.sum()) > 0 for load in counted["none"])
    for plain, recomputed in zip(counted["none"], counted[recompute]):
        torch.testing.assert_close(recomputed, plain, rtol=0, atol=0)
