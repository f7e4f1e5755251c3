"""A warm-up step shaped like the warm-up (issue 32): with every parameter but the indexer's frozen,
the main model runs without autograd and is never recomputed whatever `recompute` says; only the
indexer's forward and the KL carry a graph. Its KL and indexer gradients equal those of the general
path (the main model under autograd, whole layers checkpointed)."""

import pytest
import torch

import dsa_train
from tests.hf_tiny import randomize_


def _tiny():
    torch.manual_seed(0)
    model = dsa_train.DSAForCausalLM(dsa_train.tiny_config(index_topk=8, index_n_heads=8))
    randomize_(model, 3)
    return model


def _positions():
    return torch.stack([torch.cat([torch.arange(9), torch.arange(15)]), torch.arange(24)])


def _step(model, recompute, frozen):
    for name, p in model.named_parameters():
        p.requires_grad_(".indexer." in name or not frozen)
        p.grad = None
    for layer in model.main_layers():
        layer.recompute = recompute
    ids = torch.randint(0, 4096, (2, 24), generator=torch.Generator().manual_seed(1))
    out = model(ids, attention="dense", indexer_loss=True, compute_logits=False, position_ids=_positions())
    out.indexer_loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if ".indexer." in n and p.grad is not None}
    return out.indexer_loss.detach(), out.stats["indexer_kl_uniform"][0], grads


@pytest.mark.parametrize("recompute", ["none", "full", "attention"])
def test_frozen_main_model_gives_the_general_paths_kl_and_gradients(recompute):
    model = _tiny()
    loss_g, klu_g, grads_g = _step(model, "full", frozen=False)  # main under autograd, layers checkpointed
    loss_f, klu_f, grads_f = _step(model, recompute, frozen=True)
    torch.testing.assert_close(loss_f, loss_g, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(klu_f, klu_g, rtol=1e-6, atol=1e-7)
    assert grads_f.keys() == grads_g.keys() and len(grads_f) > 0
    for name in grads_g:
        torch.testing.assert_close(grads_f[name], grads_g[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_frozen_main_model_runs_once_without_a_graph(recompute):
    model = _tiny()
    calls = {"mlp": 0, "kv_b": 0, "wq_b": 0}
    graph = []

    def count(key, check_graph=False):
        def hook(module, args, output):
            calls[key] += 1
            if check_graph:
                graph.append(output.requires_grad)
        return hook

    for layer in model.main_layers():
        layer.mlp.register_forward_hook(count("mlp", check_graph=True))
        layer.self_attn.kv_b_proj.register_forward_hook(count("kv_b"))
        layer.self_attn.indexer.wq_b.register_forward_hook(count("wq_b"))
    _, _, grads = _step(model, recompute, frozen=True)
    n = len(model.main_layers())
    assert calls["mlp"] == n, calls  # the MLP / MoE ran once per layer: never recomputed
    assert graph and not any(graph)  # ... and without autograd
    # the indexer (and the KL's main-model inputs, from the layer input) run again only when recomputed
    assert calls["wq_b"] == (2 * n if recompute == "full" else n), calls
    assert calls["kv_b"] == (2 * n if recompute == "full" else n), calls
    assert grads and all(g.abs().sum() > 0 for g in grads.values())


def test_recompute_skips_the_kl_statistics_pass_on_the_triton_path(monkeypatch):
    """Triton path (interpreter): under `recompute` the checkpoint's recompute reuses the KL's row
    statistics from the forward, so the statistics pass runs once per layer, not twice, and the
    gradients equal those of the run without recompute."""
    monkeypatch.setenv("DSA_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from dsa_kernels.ops.indexer_kl import function

    launches = []
    real = function.plan_dense_kl

    def counting(*args, stats=True, **kwargs):
        launches.append("stats" if stats else "grad")
        return real(*args, stats=stats, **kwargs)

    monkeypatch.setattr(function, "plan_dense_kl", counting)
    model = _tiny()
    loss_n, klu_n, grads_n = _step(model, "none", frozen=True)
    n = len(model.main_layers())
    assert launches == ["stats"] * n + ["grad"] * n, launches
    launches.clear()
    loss_f, klu_f, grads_f = _step(model, "full", frozen=True)
    assert sorted(launches) == ["grad"] * n + ["stats"] * n, launches
    torch.testing.assert_close(loss_f, loss_n, rtol=0, atol=0)
    torch.testing.assert_close(klu_f, klu_n, rtol=0, atol=0)
    for name in grads_n:
        torch.testing.assert_close(grads_f[name], grads_n[name], rtol=1e-6, atol=1e-8, msg=name)
