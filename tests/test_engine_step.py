"""Stage freezing, the LR schedule and gradient-accumulation scaling."""

import math

import pytest
import torch

from dsa_train.config import Attention, Decay, OptimConfig, StageConfig, Trainable
from dsa_train.trainer import Engine, StepHooks, forward_backward, lr_multiplier, train_step
from dsa_train.model import DSAForCausalLM, tiny_config
from dsa_train.stage import STAGE_KINDS, Stage

is_indexer_parameter = STAGE_KINDS["indexer"].trains

VOCAB, SEQ = 256, 48

WARMUP = StageConfig(attention=Attention.dense, trainable=Trainable.indexer, lm_loss_coef=0.0,
                     indexer_loss_coef=1.0, lr=1e-2, steps=4)
SPARSE = StageConfig(attention=Attention.sparse, trainable=Trainable.all, lm_loss_coef=1.0,
                     indexer_loss_coef=1.0, lr=1e-3, steps=4, topk=8)


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return DSAForCausalLM(tiny_config(vocab_size=VOCAB))


def batch(size, seed=1):
    """Packed rows: two documents per row (position ids restart), labels -100 at doc ends."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(2, VOCAB, (size, SEQ), generator=g)
    split = SEQ // 3
    position_ids = torch.cat([torch.arange(split), torch.arange(SEQ - split)]).repeat(size, 1)
    labels = torch.cat([input_ids[:, 1:], torch.full((size, 1), -100)], dim=1)
    labels[:, split - 1] = -100
    labels[0, 5:9] = -100  # micro-batches with different valid-label counts
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}


def split_rows(b):
    return [{k: v[i:i + 1] for k, v in b.items()} for i in range(b["input_ids"].shape[0])]


def test_warmup_trains_only_the_indexer():
    model = tiny_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = Engine(model, Stage.of("test", WARMUP), OptimConfig())
    optimized = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
    indexer = {id(p) for n, p in model.named_parameters() if is_indexer_parameter(n)}
    assert indexer and optimized == indexer

    forward_backward(engine, [batch(2)], Stage.of("test", WARMUP))
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert with_grad and all(is_indexer_parameter(n) for n in with_grad)
    for name, p in model.named_parameters():
        assert p.requires_grad == is_indexer_parameter(name), name
    engine.step()
    assert {id(p) for p in engine.optimizer.state} <= indexer
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(is_indexer_parameter(n) for n in changed)


def test_sparse_stage_trains_everything_and_unfreezes():
    model = tiny_model()
    Engine(model, Stage.of("test", WARMUP), OptimConfig())
    engine = Engine(model, Stage.of("test", SPARSE), OptimConfig())
    n_params = len(list(model.parameters()))
    assert sum(len(g["params"]) for g in engine.optimizer.param_groups) == n_params
    metrics = train_step(engine, [batch(1)], Stage.of("test", SPARSE))
    assert metrics["lm_loss"] > 0 and metrics["indexer_loss"] > 0 and metrics["grad_norm"] > 0
    assert math.isclose(metrics["loss"], metrics["lm_loss"] + metrics["indexer_loss"], rel_tol=1e-5)


def test_warmup_skips_the_lm_head():
    model = tiny_model()
    engine = Engine(model, Stage.of("test", WARMUP), OptimConfig())
    metrics = forward_backward(engine, [batch(1)], Stage.of("test", WARMUP))
    assert "lm_loss" not in metrics and model.lm_head.weight.grad is None
    assert 0 < metrics["indexer_loss"] == metrics["loss"]


def test_no_weight_decay_on_vectors():
    engine = Engine(tiny_model(), Stage.of("test", SPARSE), OptimConfig(weight_decay=0.1))
    decayed, plain = engine.optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and all(p.ndim >= 2 for p in decayed["params"])
    assert plain["weight_decay"] == 0.0 and all(p.ndim < 2 for p in plain["params"])


@pytest.mark.slow
@pytest.mark.parametrize("stage", [WARMUP, SPARSE], ids=["warmup", "sparse"])
def test_gradient_accumulation_matches_one_big_batch(stage):
    full = batch(2)
    grads = []
    losses = []
    for micro_batches in ([full], split_rows(full)):
        model = tiny_model()
        engine = Engine(model, Stage.of("test", stage), OptimConfig())
        metrics = forward_backward(engine, micro_batches, Stage.of("test", stage))
        losses.append(metrics["loss"])
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-6, msg=name)
    assert math.isclose(losses[0], losses[1], rel_tol=1e-5)


def schedule_stage(**kw):
    return StageConfig(steps=10, lr=1.0, **kw)


def test_lr_schedule_warmup_then_constant():
    stage = schedule_stage(warmup_steps=4, decay=Decay.constant)
    assert [lr_multiplier(s, stage) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_lr_schedule_cosine_and_linear_reach_the_floor():
    cosine = schedule_stage(warmup_steps=2, decay=Decay.cosine, min_lr_ratio=0.1)
    values = [lr_multiplier(s, cosine) for s in range(10)]
    assert values[2] == 1.0 and math.isclose(values[-1], 0.1)
    assert all(a >= b for a, b in zip(values[2:], values[3:]))
    assert math.isclose(values[2 + 7 // 2 + 1], 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 7)))
    linear = schedule_stage(warmup_steps=0, decay=Decay.linear, min_lr_ratio=0.0)
    assert [round(lr_multiplier(s, linear), 6) for s in (0, 9)] == [1.0, 0.0]
    assert math.isclose(lr_multiplier(3, linear), 1 - 3 / 9)


def test_engine_applies_the_schedule_per_step():
    stage = StageConfig(trainable=Trainable.all, lm_loss_coef=1.0, indexer_loss_coef=0.0, lr=2e-3, steps=4,
                        warmup_steps=2, decay=Decay.linear)
    engine = Engine(tiny_model(), Stage.of("test", stage), OptimConfig())
    used = [train_step(engine, [batch(1)], Stage.of("test", stage))["lr"] for _ in range(4)]
    assert used == pytest.approx([1e-3, 2e-3, 2e-3, 0.0])


def test_bfloat16_parameters_update_through_fp32_masters():
    model = tiny_model().to(torch.bfloat16)
    stage = StageConfig(trainable=Trainable.all, lm_loss_coef=1.0, indexer_loss_coef=0.0, lr=1e-5, steps=3)
    engine = Engine(model, Stage.of("test", stage), OptimConfig(weight_decay=0.0))
    name = "model.embed_tokens.weight"
    start = engine.masters[name].detach().clone()
    for _ in range(3):
        train_step(engine, [batch(1)], Stage.of("test", stage))
    master = engine.masters[name]
    assert master.dtype == torch.float32
    assert (master - start).abs().max() > 0  # 3 x 1e-5 steps: lost to rounding in bfloat16 alone
    assert torch.equal(dict(model.named_parameters())[name], master.to(torch.bfloat16))
    assert all(p.grad is None for p in model.parameters())
    assert {id(p) for g in engine.optimizer.param_groups for p in g["params"]} == {id(m) for m in engine.masters.values()}


def test_mtp_loss_coef_trains_the_mtp_module():
    import dataclasses

    model = tiny_model()
    stage = dataclasses.replace(SPARSE, mtp_loss_coef=0.3)
    engine = Engine(model, Stage.of("test", stage), OptimConfig())
    metrics = forward_backward(engine, [batch(2)], Stage.of("test", stage))
    assert metrics["mtp_loss"] > 0
    mtp = model.mtp_layers()[0]
    assert mtp.eh_proj.weight.grad is not None and mtp.eh_proj.weight.grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)
    metrics = forward_backward(engine, [batch(2)], Stage.of("test", SPARSE))  # default 0: MTP untouched
    assert "mtp_loss" not in metrics and mtp.eh_proj.weight.grad is None


class RecordingHooks(StepHooks):
    """Records what each point of train_step sees; `skip` decides the update."""

    def __init__(self, skip: bool):
        self.skip, self.seen = skip, []

    def after_backward(self, engine, metrics):
        has_grads = any(p.grad is not None for _, p in engine.trainable)
        self.seen.append(("after_backward", has_grads, "grad_norm" in metrics))

    def skip_update(self, engine, metrics):
        self.seen.append(("skip_update", "grad_norm" in metrics))
        if self.skip:
            engine.zero_grad()
        return self.skip

    def after_update(self, engine, metrics, skipped):
        self.seen.append(("after_update", skipped, "grad_norm" in metrics and "lr" in metrics))


def test_train_step_hooks_run_between_backward_and_update_and_can_skip_it():
    model = tiny_model()
    engine = Engine(model, Stage.of("test", SPARSE), OptimConfig())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    lr = engine.lr
    skipping, watching = RecordingHooks(skip=True), RecordingHooks(skip=False)
    metrics = train_step(engine, [batch(1)], Stage.of("test", SPARSE), hooks=[skipping, watching])
    expected = [("after_backward", True, False), ("skip_update", False), ("after_update", True, True)]
    assert skipping.seen == watching.seen == expected  # every hook asked at every point, in order
    assert math.isnan(metrics["grad_norm"]) and metrics["lr"] == lr
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # no update
    assert engine.scheduler.last_epoch == 0  # nor a schedule step

    applied = RecordingHooks(skip=False)
    metrics = train_step(engine, [batch(1)], Stage.of("test", SPARSE), hooks=[applied])
    assert applied.seen[-1] == ("after_update", False, True) and metrics["grad_norm"] > 0
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_the_step_drops_its_outputs_before_the_backward():
    """forward_backward keeps no micro-batch output through its backward: the logits ([T, vocab],
    ~1 GiB a rank at 671B) are freed once the LM head's backward has read them, not held until the
    whole backward returns (trainer/step.py; the plan counts them only beside the head's backward)."""
    import weakref

    model = tiny_model()
    seen = []

    class Probe:  # what forward_backward needs of a TrainingEngine, watching the logits
        def forward(self, *args, **kwargs):
            out = model(*args, **kwargs)
            self.logits = weakref.ref(out.logits)
            return out

        def backward(self, loss):
            assert self.logits() is not None  # alive into the backward (the loss saved them)
            loss.backward()
            seen.append(self.logits() is None)

    forward_backward(Probe(), split_rows(batch(2)), Stage.of("test", SPARSE))
    assert seen == [True, True]


def test_a_micro_batch_without_labels_still_runs_its_backward():
    """A micro-batch whose labels are all ignored has no loss term, yet its backward runs (a zero
    term): on many ranks the backward's collectives (gradient buckets, EP all-to-alls) must be
    issued by every rank for every micro-batch, or the ranks fall out of step and hang."""
    lm_only = StageConfig(attention=Attention.dense, trainable=Trainable.all, lm_loss_coef=1.0,
                          indexer_loss_coef=0.0, lr=1e-3, steps=1)
    stage = Stage.of("test", lm_only)
    rows = split_rows(batch(2))
    rows[1]["labels"] = torch.full_like(rows[1]["labels"], -100)
    model = tiny_model()
    backwards = []

    class Probe:  # what forward_backward needs of a TrainingEngine, counting the backwards
        def forward(self, *args, **kwargs):
            return model(*args, **kwargs)

        def backward(self, loss):
            loss.backward()
            backwards.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})

    forward_backward(Probe(), rows, stage)
    assert len(backwards) == 2  # one per micro-batch, the label-less one included
    first, second = backwards
    assert first.keys() == second.keys() and first  # the same parameters reached by both backwards
    assert all(torch.equal(first[n], second[n]) for n in first)  # and the second added nothing
