"""`dsa-train plan`'s warm-up step time comes from the code that runs (dsa_train/plan/warmup.py):
the frozen main model's forward once, library attention in the MHA form (CP: the gathered latent
up-projected per run), the indexer's forward and weight gradients, the checkpoint's recompute, and
the dense KL kernel's statistics and gradient passes (the compile report's FLOPs / bytes of the same
launch). Hand counts of the terms that have a closed form; the sparse stage keeps the model FLOPs."""

import json

import pytest

from dsa_train.model.config import DSAConfig
from dsa_train.plan.estimate import main as plan_main
from dsa_train.plan.warmup import warmup_compute_seconds, warmup_step_work


def _plan(capsys, *args):
    assert plan_main([*args, "--json"]) in (0, 1)
    return json.loads(capsys.readouterr().out)


def test_671b_warmup_step_comes_from_the_frozen_path(capsys):
    plan = _plan(capsys, "--config-name", "v3.2_warmup")
    (stage,) = plan["stages"]
    d = stage["step_detail"]
    w = d["warmup"]
    c, T, cp = DSAConfig(), plan["seq_len"], plan["layout"]["cp"]
    tokens_per_rank = d["tokens_per_step"] / plan["layout"]["world"]
    rate = 989e12 * 0.35
    L, H = c.num_hidden_layers, c.num_attention_heads
    # attention: MHA form, 2 H (192 + 128) per causal key, forward only (frozen)
    assert w["parts_s"]["attention"] == pytest.approx(tokens_per_rank * L * 2 * H * (T + 1) / 2 * 320 / rate)
    # CP 16: (2 CP + 1) / 2 up-projections of a key per local token (one of them is kv_b, counted in the
    # main forward), plus the KL's absorbed query
    up, absorb = 2 * 512 * H * 256, 2 * H * 128 * 512
    assert cp == 16
    assert w["parts_s"]["cp_up_projection"] == pytest.approx(tokens_per_rank * L * ((2 * cp + 1) / 2 - 1) * up / rate
                                                             + tokens_per_rank * L * absorb / rate)
    # the step's compute is the parts at the MFU with the KL at its roofline, and the plan prints both figures
    kl_flops_s = w["parts_s"]["kl_stats"] + w["parts_s"]["kl_grad"]
    assert w["kl_s"] >= kl_flops_s
    assert d["compute_s"] == pytest.approx(sum(w["parts_s"].values()) - kl_flops_s + w["kl_s"])
    assert w["kl_bound"] == "memory"  # at these shapes: its re-reads and dq_I atomics
    assert stage["step_s"] == pytest.approx(d["compute_s"] + d["communication_s"])
    assert w["compute_s_before"] < d["compute_s"]  # the old model missed the KL kernel's cost


def test_warmup_kl_form_follows_context_parallelism():
    """Without CP the KL's main scores are the MHA form (192 dims per head); under CP the shared
    576-dim key (what `_frozen_kl` passes the kernel): 3x the main-score FLOPs; no up-projection term."""
    c = DSAConfig(num_hidden_layers=2, first_k_dense_replace=1)
    one, many = warmup_step_work(c, 4096, 1, "full"), warmup_step_work(c, 4096, 4, "full")
    assert one["flops"]["cp_up_projection"] == 0 < many["flops"]["cp_up_projection"]
    H, HI, DI, keys = c.num_attention_heads, c.index_n_heads, c.index_head_dim, (4096 + 1) / 2
    # issued FLOPs per token >= the useful ones: main scores + indexer scores per causal key, per layer
    assert one["flops"]["kl_stats"] >= 2 * 2 * (H * 192 + HI * DI) * keys
    assert many["flops"]["kl_stats"] >= 2 * 2 * (H * 576 + HI * DI) * keys
    # (128 x 576 + 64 x 128) / (128 x 192 + 64 x 128) = 2.5 in the useful FLOPs; the tiles' padding moves it little
    assert 2.0 < many["flops"]["kl_stats"] / one["flops"]["kl_stats"] < 3.0
    # no recompute: neither the KL inputs nor the indexer are formed again
    assert warmup_step_work(c, 4096, 1, "none")["flops"]["recompute"] == 0 < one["flops"]["recompute"]
    s = warmup_compute_seconds(one, 1.0, 1e15, 0.5, hbm_bytes_per_s=1e30)  # unbounded memory: FLOPs only
    assert s["kl_bound"] == "compute" and s["compute_s"] == pytest.approx(one["total_flops"] / 5e14)


def test_sparse_stage_step_is_unchanged(capsys):
    plan = _plan(capsys, "--config-name", "v3.2_sparse")
    (stage,) = plan["stages"]
    assert "warmup" not in stage["step_detail"]
