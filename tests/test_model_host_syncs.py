"""Metrics stay on the device until the end of the step: the model's forward reads no floating-point
value back to the host (its stats are device tensors), and a training step reads floats back
twice, whatever the number of layers and micro-batches (the step's token counts, `step_counts`,
and its metrics, `MetricSums.values`). The on-device arithmetic gives the numbers of reading
each value back as it came (Python floats)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from dsa_train.loss import MetricSums, Reduction, metric_values, micro_batch_loss, step_counts
from dsa_train.model import DSAForCausalLM, tiny_config
from dsa_train.model.transformer import mean_over_layers

VOCAB, SEQ = 256, 32
READ_BACKS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__")


@pytest.fixture
def float_read_backs(monkeypatch):
    """Counts the host read-backs of floating-point tensors (method -> calls) while active."""
    counts: Counter = Counter()
    for name in READ_BACKS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            if self.is_floating_point():
                counts[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return counts


def micro_batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (2, SEQ), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    labels[0, 5] = -100
    return {"input_ids": ids, "labels": labels, "position_ids": torch.arange(SEQ).expand(2, SEQ)}


# the sparse stage of the recipes: LM + indexer KL + MTP, recall measured on the first micro-batch
FORWARD = dict(attention="sparse", indexer_loss=True, topk=8, mtp=True)
COEFS = {"lm": 1.0, "mtp": 0.3, "indexer": 1.0}


@pytest.mark.parametrize("layers,n_micro", [(3, 2)])
def test_a_step_reads_floats_back_twice_and_the_model_none(float_read_backs, layers, n_micro):
    torch.manual_seed(0)
    model = DSAForCausalLM(tiny_config(vocab_size=VOCAB, num_hidden_layers=layers))
    micro_batches = [micro_batch(i) for i in range(n_micro)]
    counts, sums = step_counts(micro_batches, Reduction()), MetricSums()
    assert sum(float_read_backs.values()) == 1  # the step's token counts, one read-back
    for i, mb in enumerate(micro_batches):
        out = model(mb["input_ids"], labels=mb["labels"], position_ids=mb["position_ids"],
                    measure_topk_recall=6 if i == 0 else 0, **FORWARD)
        micro_batch_loss(out, COEFS, counts, Reduction()).backward()
        sums.add(out.stats)
    assert sum(float_read_backs.values()) == 1, float_read_backs  # forward, backward, add: none
    metrics = sums.values(Reduction())
    assert float_read_backs == {"tolist": 2}
    expected = {"lm_loss", "mtp_loss", "indexer_kl", "indexer_kl_uniform", "indexer_kl_captured", "topk_recall",
                "moe/expert_load_min", "moe/expert_load_max", "moe/expert_load_cv"}
    assert expected | {f"indexer_kl/layer_{i}" for i in range(layers)} == set(metrics)
    assert all(isinstance(v, float) for v in metrics.values())


def test_metric_sums_on_the_device_equal_python_float_sums():
    """MetricSums over device tensors gives exactly what adding `float(value)`s in Python gives."""
    g = torch.Generator().manual_seed(3)
    steps = [{"a": (torch.randn((), generator=g) * 7, torch.tensor(37)),
              "b": (torch.rand((), generator=g, dtype=torch.float64), 12.0),
              "c": (0.25 * (i + 1), 3.0)} for i in range(5)]
    sums = MetricSums()
    python: dict[str, list[float]] = {}
    for stats in steps:
        sums.add(stats)
        for key, (num, den) in stats.items():
            acc = python.setdefault(key, [0.0, 0.0])
            acc[0] += float(num)
            acc[1] += float(den)
    assert sums.values(Reduction()) == metric_values(python)


def test_mean_over_layers_is_the_python_float_mean():
    rng = random.Random(0)
    for n in (1, 2, 3, 7, 61):
        for _ in range(20):
            values = [torch.tensor(rng.uniform(-1e3, 1e3) * 10 ** rng.randint(-6, 3), dtype=torch.float32)
                      for _ in range(n)]
            want = sum(float(v) for v in values) / len(values)
            got = mean_over_layers(values)
            assert got.dtype == torch.float64 and float(got) == want
