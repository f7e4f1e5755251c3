"""The stage type: what each kind trains, how it calls the forward, which loss terms count, its
FLOPs; and a kind declared outside dsa_train (docs/stages.md's worked example) trains what it names."""

import pytest
import torch

from dsa_train.config import Attention, StageConfig, Trainable
from dsa_train.loss import MetricSums, Reduction, micro_batch_loss, step_counts
from dsa_train.model import DSAForCausalLM, flops, tiny_config
from dsa_train.stage import STAGE_KINDS, Stage, StageKind, UnknownStageKind, stage_kind

VOCAB, SEQ = 256, 32

WARMUP = StageConfig(attention=Attention.dense, trainable=Trainable.indexer, lm_loss_coef=0.0, indexer_loss_coef=1.0)
SPARSE = StageConfig(attention=Attention.sparse, trainable=Trainable.all, lm_loss_coef=1.0, indexer_loss_coef=0.5,
                     mtp_loss_coef=0.3, topk=8, topk_recall_queries=4)


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return DSAForCausalLM(tiny_config(vocab_size=VOCAB))


def test_each_kind_selects_its_parameters_in_model_order():
    model = tiny_model()
    names = [n for n, _ in model.named_parameters()]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    warmup = Stage.of("warmup", WARMUP).select_trainable(model)
    assert [n for n, _ in warmup] == [n for n in names if ".indexer." in n] != []
    assert all(p.requires_grad == (".indexer." in n) and p.grad is None for n, p in model.named_parameters())
    everything = Stage.of("sparse", SPARSE).select_trainable(model)
    assert [n for n, _ in everything] == names
    assert all(p.requires_grad for p in model.parameters())


def test_a_kind_with_no_parameters_is_one_clear_error():
    model = torch.nn.Linear(2, 2)  # no ".indexer." parameter
    with pytest.raises(ValueError, match=r"^trainable=indexer: the model has no such parameters$"):
        Stage.of("warmup", WARMUP).select_trainable(model)
    with pytest.raises(UnknownStageKind, match="^trainable=bogus: no such stage kind — use one of indexer, all or declare"):
        stage_kind("bogus")


def test_forward_kwargs_and_loss_terms_follow_the_coefficients():
    warmup, sparse = Stage.of("warmup", WARMUP), Stage.of("sparse", SPARSE)
    assert warmup.forward_kwargs() == {"attention": "dense", "indexer_loss": True, "compute_logits": False,
                                       "topk": None, "mtp": False, "measure_topk_recall": 0}
    assert sparse.forward_kwargs(4) == {"attention": "sparse", "indexer_loss": True, "compute_logits": True,
                                        "topk": 8, "mtp": True, "measure_topk_recall": 4}
    assert (warmup.uses_lm, warmup.uses_mtp, sparse.uses_lm, sparse.uses_mtp) == (False, False, True, True)
    assert (warmup.sparse, warmup.recall_queries, sparse.sparse, sparse.recall_queries) == (False, 0, True, 4)
    assert warmup.loss_coefficients == {"lm": 0.0, "mtp": 0.0, "indexer": 1.0}
    assert sparse.loss_coefficients == {"lm": 1.0, "mtp": 0.3, "indexer": 0.5}
    # the MTP coefficient counts only with the LM head
    no_lm = Stage.of("x", StageConfig(trainable=Trainable.all, lm_loss_coef=0.0, mtp_loss_coef=0.3))
    assert no_lm.loss_coefficients["mtp"] == 0.0 and not no_lm.uses_mtp
    metrics = sparse.add_step_loss({"lm_loss": 2.0, "mtp_loss": 3.0, "indexer_kl": 0.25})
    assert metrics["indexer_loss"] == 0.25 and metrics["loss"] == pytest.approx(2.0 + 0.3 * 3.0 + 0.5 * 0.25)
    assert warmup.add_step_loss({"lm_loss": 2.0, "indexer_kl": 0.25})["loss"] == 0.25


def test_flops_per_token_of_the_shipped_kinds():
    cfg, T = tiny_config(vocab_size=VOCAB), 1024
    # the two kinds' training FLOPs written out from the per-layer arithmetic of model/flops.py
    for attention, topk in (("dense", None), ("sparse", 8)):
        attn = flops.attention_flops_per_token(cfg, T, attention, topk or cfg.index_topk)
        layers = [flops.layer_linear_params(cfg, i) for i in range(cfg.num_hidden_layers)]
        main_fwd = sum(2 * p["main"] + attn["main"] for p in layers)
        # the indexer: projections x3; scores forward over every causal key, backward over the keys its
        # loss differentiates (all causal ones dense, the k_t selected ones sparse)
        indexer = sum(3 * 2 * p["indexer"] + attn["indexer"] + attn["indexer_backward"] for p in layers)
        per_key = 2 * cfg.index_n_heads * cfg.index_head_dim + 2 * cfg.index_n_heads
        keys = (T + 1) / 2 if attention == "dense" else sum(min(t + 1, topk) for t in range(T)) / T
        assert attn["indexer_backward"] == pytest.approx(2 * per_key * keys, rel=1e-12)
        head = 2 * cfg.hidden_size * cfg.vocab_size
        warmup = main_fwd + indexer + cfg.num_hidden_layers * attn["main"]
        full = 3 * (main_fwd + head) + indexer
        common = dict(attention=Attention(attention), topk=topk)
        assert Stage.of("w", StageConfig(trainable=Trainable.indexer, **common)).flops_per_token(cfg, T) \
            == pytest.approx(warmup, rel=1e-12)
        assert Stage.of("s", StageConfig(trainable=Trainable.all, **common)).flops_per_token(cfg, T) \
            == pytest.approx(full, rel=1e-12)


def test_describe_is_the_stage_opening_line():
    stage = Stage.of("sparse", StageConfig(attention=Attention.sparse, trainable=Trainable.all, steps=7,
                                           global_batch_size=4))
    assert stage.describe(12) == "stage sparse: sparse attention, trains all (12 tensors), 7 steps x 4 sequences"


# docs/stages.md's worked example: a kind that trains the indexer and the attention projections
def _is_attention_parameter(name: str) -> bool:
    return ".self_attn." in name  # MLA projections, their norms and the indexer inside them


INDEXER_AND_ATTENTION = StageKind(
    "indexer_and_attention", trains=_is_attention_parameter, main_backward=True, lm_head=True,
    kl_recomputes_main_scores=False, summary="the attention projections and the indexer",
)


def test_a_new_kind_trains_only_what_it_names(monkeypatch):
    monkeypatch.setitem(STAGE_KINDS, INDEXER_AND_ATTENTION.name, INDEXER_AND_ATTENTION)
    config = StageConfig(attention=Attention.sparse, trainable="indexer_and_attention", lm_loss_coef=1.0,
                         indexer_loss_coef=1.0, topk=8)
    stage = Stage.of("attention", config)
    model = tiny_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = stage.select_trainable(model)
    assert {n for n, _ in trainable} == {n for n in before if ".self_attn." in n}
    optimizer = torch.optim.AdamW([p for _, p in trainable], lr=1e-2)

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (2, SEQ), generator=g)
    mb = {"input_ids": ids, "labels": torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1),
          "position_ids": torch.arange(SEQ).expand(2, SEQ)}
    counts, sums = step_counts([mb], Reduction()), MetricSums()
    out = model(mb["input_ids"], labels=mb["labels"], position_ids=mb["position_ids"], **stage.forward_kwargs())
    micro_batch_loss(out, stage.loss_coefficients, counts, Reduction()).backward()
    sums.add(out.stats)
    optimizer.step()

    metrics = stage.add_step_loss(sums.values(Reduction(), device=ids.device))
    assert torch.isfinite(torch.tensor(metrics["loss"])) and metrics["loss"] > 0
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert any(".indexer." in n for n in changed) and any(".o_proj." in n for n in changed)
    assert all(".self_attn." in n for n in changed)
    assert stage.flops_per_token(model.config, SEQ) == Stage.of(
        "s", StageConfig(attention=Attention.sparse, trainable=Trainable.all, topk=8)).flops_per_token(model.config, SEQ)


def test_the_indexer_kind_rejects_loss_terms_that_cannot_train_it():
    kind = stage_kind(Trainable.indexer)
    assert kind.config_errors(WARMUP) == []
    bad = StageConfig(trainable=Trainable.indexer, lm_loss_coef=1.0, indexer_loss_coef=0.0, router_bias_update_rate=0.1)
    assert [f for f, _ in kind.config_errors(bad)] == ["indexer_loss_coef", "lm_loss_coef", "router_bias_update_rate"]
    assert stage_kind("all").config_errors(bad) == []
