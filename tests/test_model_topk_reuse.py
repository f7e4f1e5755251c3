"""Activation recompute reuses the forward's top-k indices (`dsa_kernels.ops.indexer_topk.memo`,
`dsa_train.model.recompute.topk_reuse_contexts`): the gradients equal those without recompute, and
the select runs once per layer and forward, not again in the recompute."""

import pytest
import torch

import dsa_kernels.ops.indexer_topk as TI
import dsa_train
from dsa_kernels.ops.indexer_topk import TopkMemo
from tests.hf_tiny import randomize_


def tiny(recompute: str):
    torch.manual_seed(0)
    cfg = dsa_train.tiny_config(index_topk=6, index_n_heads=8)
    model = dsa_train.DSAForCausalLM(cfg)
    randomize_(model, 3)
    for layer in model.model.layers:
        layer.recompute = recompute
    return model


def packed_positions(lengths_per_row):
    return torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in lengths_per_row])


def count_selects(monkeypatch) -> list:
    """Counts the selections the reference path computes (the CPU entry point's only paths)."""
    calls = []
    real_ref, real_op = TI.indexer_topk_ref, TI.indexer_topk_at_positions_op

    def ref(*a, **kw):
        calls.append("ref")
        return real_ref(*a, **kw)

    def op(*a, **kw):
        calls.append("positions")
        return real_op(*a, **kw)

    monkeypatch.setattr(TI, "indexer_topk_ref", ref)
    monkeypatch.setattr(TI, "indexer_topk_at_positions_op", op)
    return calls


def step(model, x, pos):
    out = model(x, attention="sparse", labels=x, indexer_loss=True, position_ids=pos)
    (out.lm_loss + out.indexer_loss).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, out


@pytest.mark.parametrize("recompute", ["full", "attention"])
def test_recompute_reuses_topk_gradients_identical(monkeypatch, recompute):
    x = torch.randint(0, 4096, (2, 20), generator=torch.Generator().manual_seed(1))
    pos = packed_positions([[7, 13], [20]])  # packed documents in one row
    calls = count_selects(monkeypatch)
    plain, out_plain = step(tiny("none"), x, pos)
    n_layers = len(calls)
    assert n_layers == tiny("none").config.num_hidden_layers > 1  # one select per layer
    calls.clear()
    reused, out_reused = step(tiny(recompute), x, pos)
    assert len(calls) == n_layers, f"the select ran {len(calls)} times for {n_layers} layers (recomputed?)"
    assert torch.equal(out_plain.lm_loss, out_reused.lm_loss)
    assert plain.keys() == reused.keys()
    for name in plain:
        assert torch.equal(plain[name], reused[name]), name


def test_without_reuse_the_recompute_would_select_again(monkeypatch):
    # the count above can fail: with the checkpoint's context_fn made a no-op the select runs twice
    def no_reuse():
        import contextlib

        return contextlib.nullcontext(), contextlib.nullcontext()

    monkeypatch.setattr("dsa_train.model.recompute.topk_reuse_contexts", no_reuse)
    x = torch.randint(0, 4096, (1, 16), generator=torch.Generator().manual_seed(2))
    calls = count_selects(monkeypatch)
    model = tiny("full")
    step(model, x, None)
    assert len(calls) == 2 * model.config.num_hidden_layers


def test_memo_replays_in_order_and_refuses_a_different_call():
    memo = TopkMemo()
    q, k, w = torch.randn(1, 9, 2, 8), torch.randn(1, 9, 8), torch.randn(1, 9, 2)
    ds = torch.zeros(1, 9, dtype=torch.long)
    with memo.recording():
        a = TI.indexer_topk(q, k, w, ds, 4)
        b = TI.indexer_topk(q, k, w, ds, 3)
    assert memo.computed == 2 and memo.nbytes() == (9 * 4 + 9 * 3) * 4
    for _ in range(2):  # reusable: a second backward through a retained graph replays again
        with memo.replaying():
            ra, sa = TI.indexer_topk(q, k, w, ds, 4)
            rb, _ = TI.indexer_topk(q, k, w, ds, 3)
        assert ra is a[0] and rb is b[0] and sa is None
    with memo.replaying(), pytest.raises(RuntimeError, match="has inputs .* but the forward's had"):
        TI.indexer_topk(q, k, w, ds, 5)
    with memo.replaying(), pytest.raises(RuntimeError, match="more top-k selections than the forward"):
        for _ in range(3):
            TI.indexer_topk(q, k, w, ds, 4 if _ != 1 else 3)
    assert TI.indexer_topk(q, k, w, ds, 4)[1] is not None  # outside a memo: computed, with scores


def test_over_the_budget_a_layer_selects_again_and_the_bytes_are_released(monkeypatch):
    # a budget of one layer's indices: the first recomputed layer replays, the others select again;
    # the gradients stay identical; the live bytes return to zero once the graph is freed
    from dsa_kernels.ops.indexer_topk import memo as M

    x = torch.randint(0, 4096, (1, 16), generator=torch.Generator().manual_seed(3))
    calls = count_selects(monkeypatch)
    plain, _ = step(tiny("none"), x, None)
    n_layers = len(calls)
    one_layer = 1 * 16 * 6 * 4  # [B, T, k] int32
    monkeypatch.setattr(M, "DEFAULT_BUDGET_BYTES", one_layer)
    calls.clear()
    assert M.live_bytes() == 0
    reused, _ = step(tiny("full"), x, None)
    assert len(calls) == 2 * n_layers - 1
    for name in plain:
        assert torch.equal(plain[name], reused[name]), name
    import gc

    gc.collect()
    assert M.live_bytes() == 0
