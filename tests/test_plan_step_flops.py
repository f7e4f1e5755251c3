"""One count per stage: `Stage.step_flops` gives the FLOPs users count (the trainer's `perf/mfu`
divides them by the step's time) beside what the CUDA path issues (the plan times it). The plan's
model FLOPs are the trainer's, its compute is the issued parts timed, and the parts that have a
closed form are counted by hand here (dsa_train/model/step_flops.py)."""

import json

import pytest

from dsa_train.config import Attention, StageConfig, Trainable
from dsa_train.model import flops
from dsa_train.model.config import DSAConfig
from dsa_train.model.step_flops import step_flops
from dsa_train.plan.compute import compute_seconds
from dsa_train.plan.estimate import main as plan_main
from dsa_train.stage import Stage

RATE = 989e12 * 0.35


def _plan(capsys, *args):
    assert plan_main([*args, "--json"]) in (0, 1)
    return json.loads(capsys.readouterr().out)


def _tokens_per_rank(plan, d):
    return d["tokens_per_step"] / plan["layout"]["world"]


@pytest.mark.parametrize("recipe", ["v3.2_sparse", "v3.2_warmup"])
def test_the_plan_counts_the_trainers_model_flops_and_times_what_runs(capsys, recipe):
    """The plan's model FLOPs per token are `Stage.flops_per_token` (what the trainer's MFU divides)
    and the closed form of model/flops.py; its compute is the sum of the issued parts' times; its MFU
    is the trainer's formula at the planned step time."""

    plan = _plan(capsys, "--config-name", recipe)
    (s,) = plan["stages"]
    d = s["step_detail"]
    c, T = DSAConfig(), plan["seq_len"]
    stage_cfg = StageConfig(attention=Attention(s["attention"]), trainable=Trainable(s["trainable"]),
                            lm_loss_coef=1.0 if s["trainable"] == "all" else 0.0, indexer_loss_coef=1.0,
                            topk=2048 if s["attention"] == "sparse" else None)
    stage = Stage.of(s["stage"], stage_cfg)
    assert d["flops_per_token"] == pytest.approx(stage.flops_per_token(c, T), rel=1e-12)
    kind = stage.kind
    closed = flops.flops_per_token(c, T, stage.attention, stage.topk_for(c), main_backward=kind.main_backward,
                                   lm_head=kind.lm_head, kl_recomputes_main_scores=kind.kl_recomputes_main_scores)
    assert d["flops_per_token"] == pytest.approx(closed, rel=1e-12)
    assert sum(p["model_flops"] for p in d["parts"].values()) == pytest.approx(d["flops_per_token"], rel=1e-12)
    assert sum(p["issued_flops"] for p in d["parts"].values()) == pytest.approx(d["issued_flops_per_token"], rel=1e-12)
    assert d["compute_s"] == pytest.approx(sum(p["seconds"] for p in d["parts"].values()))
    n = _tokens_per_rank(plan, d)
    for name, p in d["parts"].items():  # each part at max(FLOPs at the MFU, bytes at 3.35 TB/s)
        assert p["seconds"] == pytest.approx(max(n * p["issued_flops"] / RATE, n * p["hbm_bytes"] / 3.35e12)), name
    assert s["step_s"] == pytest.approx(d["compute_s"] + d["communication_s"])
    assert d["mfu"] == pytest.approx(d["tokens_per_step"] * d["flops_per_token"] / (plan["layout"]["world"] * 989e12
                                                                                     * s["step_s"]))
    assert d["issued_flops_per_token"] > d["flops_per_token"] and d["mfu"] < 0.35
    assert d["model_flops_compute_s"] == pytest.approx(n * d["flops_per_token"] / RATE)


def test_671b_warmup_step_comes_from_the_frozen_path(capsys):
    plan = _plan(capsys, "--config-name", "v3.2_warmup")
    (stage,) = plan["stages"]
    d = stage["step_detail"]
    parts = d["parts"]
    c, T, cp = DSAConfig(), plan["seq_len"], plan["layout"]["cp"]
    n = _tokens_per_rank(plan, d)
    L, H = c.num_hidden_layers, c.num_attention_heads
    # attention: MHA form, 2 H (192 + 128) per causal key, forward only (frozen)
    assert parts["attention"]["seconds"] == pytest.approx(n * L * 2 * H * (T + 1) / 2 * 320 / RATE)
    # CP 16: (2 CP + 1) / 2 up-projections of a key per local token (one of them is kv_b, counted in the
    # main forward), plus the KL's absorbed query
    up, absorb = 2 * 512 * H * 256, 2 * H * 128 * 512
    assert cp == 16
    assert parts["cp_up_projection"]["seconds"] == pytest.approx(n * L * ((2 * cp + 1) / 2 - 1) * up / RATE
                                                                 + n * L * absorb / RATE)
    assert parts["cp_up_projection"]["model_flops"] == 0  # not the model's work
    # the KL kernel at its roofline: memory-bound at these shapes (its re-reads and dq_I atomics)
    for name in ("kl_stats", "kl_grad"):
        assert parts[name]["bound"] == "memory"
        assert parts[name]["seconds"] > n * parts[name]["issued_flops"] / RATE
    assert d["model_flops_compute_s"] < d["compute_s"]  # the model count misses the KL kernel's cost


def test_warmup_kl_form_follows_context_parallelism():
    """Without CP the KL's main scores are the MHA form (192 dims per head); under CP the shared
    576-dim key (what `_frozen_kl` passes the kernel): 3x the main-score FLOPs; no up-projection term."""
    c = DSAConfig(num_hidden_layers=2, first_k_dense_replace=1)

    def warmup(context, recompute):
        return step_flops(c, 4096, "dense", main_backward=False, lm_head=False, kl_recomputes_main_scores=True,
                          context=context, recompute=recompute).parts

    one, many = warmup(1, "full"), warmup(4, "full")
    assert one["cp_up_projection"].issued == 0 < many["cp_up_projection"].issued
    H, HI, DI, keys = c.num_attention_heads, c.index_n_heads, c.index_head_dim, (4096 + 1) / 2
    L = c.num_hidden_layers
    # issued FLOPs per token >= the useful ones: main scores + indexer scores per causal key, per layer
    assert one["kl_stats"].issued >= L * 2 * (H * 192 + HI * DI) * keys
    assert many["kl_stats"].issued >= L * 2 * (H * 576 + HI * DI) * keys
    # (128 x 576 + 64 x 128) / (128 x 192 + 64 x 128) = 2.5 in the useful FLOPs; the tiles' padding moves it little
    assert 2.0 < many["kl_stats"].issued / one["kl_stats"].issued < 3.0
    # no recompute: neither the KL inputs nor the indexer are formed again
    assert warmup(1, "none")["recompute"].issued == 0 < one["recompute"].issued
    s = compute_seconds(step_flops(c, 4096, "dense", main_backward=False, lm_head=False,
                                   kl_recomputes_main_scores=True), 1.0, 1e15, 0.5, hbm_bytes_per_s=1e30)
    assert all(p["bound"] == "compute" for p in s["parts"].values())  # unbounded memory: FLOPs only


SPARSE = dict(attention="sparse", main_backward=True, lm_head=True)
WARMUP = dict(attention="dense", main_backward=False, lm_head=False, kl_recomputes_main_scores=True)


@pytest.mark.parametrize("kind", [SPARSE, WARMUP], ids=["sparse", "warmup"])
def test_the_model_count_does_not_depend_on_the_layout_and_the_recompute_adds_issued_work(kind):
    c = DSAConfig(num_hidden_layers=3, first_k_dense_replace=1)
    T = 2048
    base = step_flops(c, T, topk=512, **kind)
    for layout in (dict(context=4), dict(recompute="full"), dict(recompute="attention", micro_batch=2)):
        other = step_flops(c, T, topk=512, **kind, **layout)
        assert other.model == pytest.approx(base.model, rel=1e-12), layout
    full = step_flops(c, T, topk=512, **kind, recompute="full")
    assert base.recomputed == 0 < full.recomputed
    assert full.issued == pytest.approx(base.issued + full.recomputed, rel=1e-9)
    assert step_flops(c, T, topk=512, **kind, issued=False).model == pytest.approx(base.model, rel=1e-12)


def test_671b_sparse_step_counts_what_runs():
    """CP 32, recompute full, 128K tokens, k = 2048: the recompute re-runs every layer's forward
    (projections, experts, the sparse MLA forward and the KL target, the KL's statistics pass) but
    scores and selects again only in the layers whose top-k indices the memo did not keep."""
    c, T, k = DSAConfig(), 131072, 2048
    L, H = c.num_hidden_layers, c.num_attention_heads
    p = step_flops(c, T, topk=k, **SPARSE, context=32, recompute="full").parts
    keys = k - k * (k - 1) / (2 * T)  # mean of min(t + 1, k)
    mla = L * 2 * H * keys * (576 + 512)
    assert p["sparse_mla_forward"].model == pytest.approx(mla)
    assert p["sparse_mla_backward"].model == pytest.approx(2 * mla)
    assert p["sparse_mla_forward"].issued >= 2 * mla  # forward + recompute, tiles padded
    assert p["sparse_mla_forward"].recomputed == pytest.approx(p["sparse_mla_forward"].issued / 2)
    # the backward issues at least S, dP, dq, dkv (TileLang's count), more than the convention's 2x
    assert p["sparse_mla_backward"].issued >= L * 2 * H * keys * (3 * 576 + 2 * 512) > 2 * mla
    # fwd + bwd + recompute fwd; the absorbed form runs kv_b as the absorption (not a linear); the
    # row-chunked MLPs' backward forms gate and up again (the dense MLP's, the shared experts')
    h, I, Is = c.hidden_size, c.intermediate_size, c.moe_intermediate_size * c.n_shared_experts
    kv_b = L * 2 * c.kv_lora_rank * H * (c.qk_nope_head_dim + c.v_head_dim)
    dense, moe_layers = c.first_k_dense_replace, L - c.first_k_dense_replace
    again = {"mlp": dense * 2 / 3 * 2 * 3 * h * I, "moe": moe_layers * 2 / 3 * 2 * 3 * h * Is}
    assert p["attention_projections"].issued == pytest.approx((p["attention_projections"].model - 3 * kv_b) * 4 / 3)
    for name in ("mlp", "moe", "absorption"):
        assert p[name].issued == pytest.approx(p[name].model * 4 / 3 + again.get(name, 0.0)), name
    assert p["lm_head"].issued == p["lm_head"].model  # outside the checkpointed layers
    # the indexer: forward + weight gradients (detached input) + the recompute's forward; and the
    # Hadamard rotation of q_I / k_I (a [d_I, d_I] matmul per head and for the key): forward, its input
    # gradient, the recompute's forward
    rot = L * 2 * c.index_head_dim**2 * (c.index_n_heads + 1)
    assert c.index_hadamard
    assert p["indexer_projections"].issued == pytest.approx(p["indexer_projections"].model + 3 * rot)
    assert p["kl_target"].model == 0 < p["kl_target"].issued
    assert p["select"].issued == 0 < p["select"].hbm_bytes
    # the memo keeps 1 GiB of indices: 32 layers of 4096 x 2048 int32; the other 29 score again
    from dsa_kernels.ops.indexer_topk.memo import DEFAULT_BUDGET_BYTES

    kept = DEFAULT_BUDGET_BYTES // (T // 32 * k * 4)
    assert kept == 32
    once = p["index_scores"].issued - p["index_scores"].recomputed
    assert p["index_scores"].recomputed == pytest.approx(once * (L - kept) / L)
    # every causal key's q_I . k_I products (tiles padded; the model count adds the weighting, 2 H_I per key)
    assert once >= L * 2 * c.index_n_heads * c.index_head_dim * (T + 1) / 2
    none = step_flops(c, T, topk=k, **SPARSE, context=32).parts
    assert none["index_scores"].recomputed == 0 and none["sparse_mla_forward"].issued == pytest.approx(
        p["sparse_mla_forward"].issued / 2)
