"""Expert, tensor and context parallelism (CPU, gloo, torchrun) == one process over the same global
batch: per-step losses and grad norms, last-step gradients (each rank's shard) and final parameters.
Also the context-parallel pieces that need no process group."""

import pytest
import torch

from tests.helpers import launch_selftest



def _check(results, n, layout):
    assert len(results) == n, results
    for r in results:
        for key, value in layout.items():
            assert r["layout"][key] == value, r["layout"]
        assert not r["failures"], r["failures"]
        assert r["worst"]["loss"] < 2e-4 and r["worst"]["grad"] < 1e-3, r["worst"]


@pytest.mark.integration
@pytest.mark.slow
def test_expert_parallel_2(tmp_path):
    rc, results, log = launch_selftest(2, ["--ep", "2", "--zero", "0,1,2"], str(tmp_path / "r.jsonl"))
    assert rc == 0, log
    _check(results, 3, {"ep": 2, "dp": 2})
    # expert-load metrics count the tokens of the whole EP group
    assert 0 < results[0]["metrics"]["moe/expert_load_min"] <= results[0]["metrics"]["moe/expert_load_max"]


@pytest.mark.integration
@pytest.mark.slow
def test_tensor_parallel_2_with_attention_recompute(tmp_path):
    rc, results, log = launch_selftest(2, ["--tp", "2", "--zero", "0,1,3", "--recompute", "attention"], str(tmp_path / "r.jsonl"))
    assert rc == 0, log
    _check(results, 3, {"tp": 2, "dp": 1})


@pytest.mark.integration
@pytest.mark.slow
def test_tensor_parallel_2_with_moe_recompute_under_zero2(tmp_path):
    # each TP rank's MoE share gathered again in the recompute; ZeRO-2 reduces in its backward hooks,
    # after the router's and experts' gradients are summed over TP
    rc, results, log = launch_selftest(2, ["--tp", "2", "--zero", "2", "--recompute", "moe"], str(tmp_path / "r.jsonl"))
    assert rc == 0, log
    _check(results, 1, {"tp": 2, "dp": 1, "recompute": "moe"})


@pytest.mark.integration
@pytest.mark.slow
def test_context_parallel_2_sparse_selection_crosses_ranks(tmp_path):
    # 64 tokens = 4 chunks of 16, top-16: late queries select keys held by the other rank
    rc, results, log = launch_selftest(2, ["--cp", "2", "--zero", "2", "--seq-len", "64", "--topk", "16"], str(tmp_path / "r.jsonl"))
    assert rc == 0, log
    _check(results, 1, {"cp": 2})


# the sparse stage on the Triton kernels (interpreted on the CPU: DSA_KERNELS=triton and
# TRITON_INTERPRET=1 in the ranks' environment), against a single process on the PyTorch references.
# CP 2: top-k at the rank's query positions, sparse MLA and the sparse indexer KL over the gathered
# keys (fewer queries than keys), gradients through the CP gather. TP 2: each rank's sparse MLA
# forward sums its own heads' P, the two sums are all-reduced into the indexer KL's target
# (`TensorParallelHeads.sum_heads`; no head's q or lse gathered), under full recompute (the
# all-reduce runs again in the recompute forward). The indexer loss (a KL near 1e-4 here, a
# difference of terms of size log(keys) ~ 4) gets 2e-6 absolute slack (~4 fp32 ulps of 4):
# kernels and references round those terms in different orders
TRITON_LAYOUTS = {"cp2": (["--cp", "2", "--zero", "2"], {"cp": 2}),
                  "tp2_full_recompute": (["--tp", "2", "--zero", "1", "--recompute", "full"], {"tp": 2, "dp": 1})}


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("layout", list(TRITON_LAYOUTS))
def test_sparse_stage_on_the_triton_kernels(tmp_path, monkeypatch, layout):
    args, expect = TRITON_LAYOUTS[layout]
    monkeypatch.setenv("DSA_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rc, results, log = launch_selftest(2, [*args, "--seq-len", "64", "--topk", "16", "--steps", "1", "--global-batch", "2",
                                           "--reference-kernels", "ref", "--indexer-loss-atol", "2e-6"],
                                       str(tmp_path / "r.jsonl"))
    assert rc == 0, log
    _check(results, 1, expect)


@pytest.mark.integration
@pytest.mark.slow
def test_context_parallel_2_dense_warmup_full_recompute(tmp_path, monkeypatch):
    monkeypatch.setenv("DSA_CP_DENSE_CHUNK", "640")  # 10 queries per chunk: several chunks per rank
    rc, results, log = launch_selftest(
        2, ["--cp", "2", "--zero", "1", "--seq-len", "64", "--attention", "dense", "--trainable", "indexer",
            "--recompute", "full"],
        str(tmp_path / "r.jsonl"),
    )
    assert rc == 0, log
    _check(results, 1, {"cp": 2})


@pytest.mark.slow
@pytest.mark.integration
def test_four_ranks_tp2_cp2_ep2(tmp_path):
    rc, results, log = launch_selftest(4, ["--tp", "2", "--cp", "2", "--ep", "2", "--zero", "1", "--seq-len", "64"],
                              str(tmp_path / "r.jsonl"))
    assert rc == 0, log
    _check(results, 1, {"tp": 2, "cp": 2, "ep": 2})


def test_load_balanced_chunks():
    from dsa_train.parallel.context import local_positions

    assert local_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert local_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    both = torch.cat([local_positions(48, 3, r) for r in range(3)]).sort().values
    assert torch.equal(both, torch.arange(48))
    with pytest.raises(ValueError, match="multiple of 4"):
        local_positions(18, 2, 0)


def test_global_topk_at_local_positions_matches_full_sequence():
    import dsa_kernels as K
    from dsa_train.parallel.context import local_positions

    torch.manual_seed(0)
    B, T, H, D, k = 2, 64, 4, 16, 12
    q, kk, w = torch.randn(B, T, H, D), torch.randn(B, T, D), torch.rand(B, T, H)
    pos_ids = torch.cat([torch.arange(40), torch.arange(24)]).expand(B, T)
    doc_start = K.doc_starts_from_position_ids(pos_ids)
    full, _ = K.indexer_topk(q, kk, w, doc_start, k)
    crossed = False
    for rank in range(2):
        p = local_positions(T, 2, rank)
        local, _ = K.indexer_topk(q[:, p], kk, w[:, p], doc_start, k, query_positions=p)
        assert torch.equal(local, full[:, p])
        other = torch.tensor([int(x) for x in local_positions(T, 2, 1 - rank)])
        crossed |= bool(torch.isin(local.long(), other).any())
    assert crossed  # selection reaches keys held by the other CP rank


def test_grouped_gemm_experts_match_loop_with_idle_experts():
    from dsa_train.model.moe import MLP
    from dsa_train.model.grouped_experts import grouped_expert_mlp

    torch.manual_seed(0)
    experts = [MLP(16, 24) for _ in range(4)]
    counts = [3, 0, 5, 2]  # expert 1 idle
    x = torch.randn(sum(counts), 16, requires_grad=True)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    stack = lambda n: torch.stack([getattr(e, n).weight for e in experts])  # noqa: E731
    y = grouped_expert_mlp(x, offs, stack("gate_proj"), stack("up_proj"), stack("down_proj"))
    y.sum().backward()
    grads = [e.down_proj.weight.grad.clone() for e in experts]
    for e in experts:
        e.zero_grad()
    x2 = x.detach().clone().requires_grad_()
    ref, start = [], 0
    for e, n in zip(experts, counts):
        ref.append(e(x2[start : start + n]))
        start += n
    ref = torch.cat(ref)
    ref.sum().backward()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-6)
    for g, e in zip(grads, experts):
        torch.testing.assert_close(g, e.down_proj.weight.grad if e.down_proj.weight.grad is not None
                                   else torch.zeros_like(g), rtol=1e-5, atol=1e-6)
