"""Tensor parallelism replicates the indexer's top-k on every TP rank, and the sparse KL's target is
the ranks' local Sigma_h P added slot by slot (`TensorParallelHeads.sum_heads`): the ranks must
select the same keys in the same slots. A timed kernel choice can differ between ranks, and the index
score configs differ in the last bits (which reorders close scores), so the top-k runs untimed under
TP (`dsa_kernels.autotune.untimed`, `TensorParallelHeads.replicated`)."""

import itertools
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dsa_kernels import autotune  # noqa: E402

_KEYS = itertools.count()  # a new shape key per probe: a choice remembered in memory is not reused


def _probe(timed: list):
    """An autotuned choice between two configs on a (pretended) GPU: which one, and whether it timed."""

    def bench(launch):
        timed.append(launch)
        return {"default": 2.0, "other": 1.0}[launch]

    return autotune.pick("review-probe", (next(_KEYS),), ["default", "other"], lambda n: n, True, "probe-gpu",
                         bench=bench)[0]


def test_untimed_returns_the_default_without_timing(tmp_path, monkeypatch):
    monkeypatch.setenv("DSA_AUTOTUNE_CACHE", str(tmp_path / "autotune.json"))
    timed = []
    with autotune.untimed():
        assert _probe(timed) == "default" and timed == []
    assert _probe(timed) == "other" and timed == ["default", "other"]  # outside it: timed, the faster


def test_score_configs_differ_in_the_last_bits():
    # why the ranks cannot each time their own choice: the two Triton score configs sum in other
    # orders (interpreter here; the compiled kernels' orders differ too)
    from dsa_kernels.ops.indexer_topk.kernel import index_scores_triton

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 32, 8, 64, generator=g).bfloat16()
    k = torch.randn(1, 32, 64, generator=g).bfloat16()
    w = torch.randn(1, 32, 8, generator=g)
    ds = torch.zeros(1, 32, dtype=torch.int64)
    a, _ = index_scores_triton(q, k, w, ds, 16, 32, config="heads-rows")
    b, _ = index_scores_triton(q, k, w, ds, 16, 32, config="keys-rows")
    fin = torch.isfinite(a)
    torch.testing.assert_close(a[fin], b[fin], rtol=1e-5, atol=1e-5)
    assert not torch.equal(a[fin], b[fin])


@pytest.mark.parametrize("tensor_parallel", [False, True])
def test_the_sparse_forward_selects_untimed_under_tensor_parallelism(tensor_parallel, tmp_path, monkeypatch):
    import dsa_train
    from dsa_train.model import mla
    from dsa_train.parallel.tensor import TensorParallelHeads

    class OneRankTP(TensorParallelHeads):  # TP's head placement, its collectives on a group of one
        def __init__(self):
            self.group = None

        def shared(self, x):
            return x

        def gather(self, x, dim=2):
            return x

        def sum_heads(self, x):
            return x

    monkeypatch.setenv("DSA_AUTOTUNE_CACHE", str(tmp_path / "autotune.json"))
    monkeypatch.setenv("DSA_KERNELS", "ref")
    timed_in_select = []
    real = mla.select_topk

    def select_topk(*args, **kwargs):
        timed = []
        _probe(timed)
        timed_in_select.append(bool(timed))
        return real(*args, **kwargs)

    monkeypatch.setattr(mla, "select_topk", select_topk)
    torch.manual_seed(0)
    model = dsa_train.DSAForCausalLM(dsa_train.tiny_config(index_topk=4, num_hidden_layers=2, first_k_dense_replace=1,
                                                           num_nextn_predict_layers=0))
    if tensor_parallel:
        for layer in model.model.layers:
            layer.self_attn.heads = OneRankTP()
    x = torch.randint(0, 4096, (1, 12), generator=torch.Generator().manual_seed(0))
    model(x, attention="sparse", labels=x, indexer_loss=True)
    assert timed_in_select == [not tensor_parallel] * 2
