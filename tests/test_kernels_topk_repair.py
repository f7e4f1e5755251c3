"""The repair path of the select (`dsa_kernels.ops.indexer_topk.repair`: torch.topk on the scores,
k + 1 picks, then one Triton kernel fixing ties, runs of equal scores and non-finite picks on the
device) against the reference's contract. The kernel runs under the Triton interpreter on the CPU
(tiny, odd shapes). Besides torch.topk's own picks (which, on the CPU, may happen to return tied
keys in index order), the kernel is fed adversarial picks: the same top scores with the tied keys
in a random order, as a GPU torch.topk is free to return them."""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dsa_kernels.ops.indexer_topk import topk_from_scores  # noqa: E402
from dsa_kernels.ops.indexer_topk.repair import plan_count_ties, plan_topk_repair, topk_repair  # noqa: E402

DEV = "cuda" if HAS_CUDA else "cpu"


def shuffled_picks(rows: torch.Tensor, n: int, seed: int):
    """torch.topk's contract (n largest, sorted descending, NaN first) with the tied keys in a
    random order -> (values [R, n], int64 indices [R, n])."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(rows.shape[1], generator=g).to(rows.device)
    v, o = torch.sort(rows[:, perm], dim=-1, descending=True, stable=True)
    return v[:, :n].contiguous(), perm[o[:, :n]].contiguous()


def path_rows(W: int = 203, seed: int = 0) -> torch.Tensor:
    """One row per way through the kernel at k = 40 (W odd): distinct scores (written as they
    are); a few runs of two or three equal scores (neighbour compares); a run of 12 equal scores
    inside the top k (compare tiles); a tie across the k-th score; all scores equal; -0.0 beside
    +0.0 at the k-th; a NaN pick and a +inf pick (the exact fallback, unsorted tiles); NaN / +inf
    with fewer finite keys than k; fewer valid keys than k; no valid key; negatives."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(14, W, generator=g)
    s[1, :60:2] = s[1, 1:61:2]  # pairs of equal scores (some within the top 40)
    s[1, 100:103] = s[1, 0]  # a run of three
    s[2, 10:22] = 5.0  # a run of 12 in the top k, not at the cut
    s[3] = torch.round(s[3] * 2) / 2  # many ties, across the k-th too
    s[4] = 1.0  # every key ties
    s[5, ::2] = 0.0
    s[5, 1::2] = -0.0
    s[5, :30] = torch.rand(30, generator=g) + 1  # 30 above, then zeros of both signs across the cut
    s[6, 7] = float("nan")
    s[6, 90] = float("inf")
    s[7, ::2] = float("nan")
    s[7, 1::4] = float("inf")  # 50 finite keys at most, 51 non-finite
    s[8, 25:] = float("-inf")  # 25 valid keys
    s[9] = float("-inf")  # none
    s[10] = -s[10].abs()
    s[10, 150:] = s[10, 3]  # a long run of equal negatives across the cut
    s[11, :] = torch.round(s[11] * 64) / 64  # short runs near the top
    s[12, 3:200:4] = float("nan")  # NaN picks, enough finite keys
    s[13, :45] = torch.arange(45, 0, -1).float()  # picks already in order, then a tie at the cut
    s[13, 39:41] = 2.0
    s[13, 120] = 2.0
    return s


@pytest.mark.parametrize("count", [False, True], ids=["next-pick", "counted"])
@pytest.mark.parametrize("topk", [1, 17, 40, 202, 203, 260])
def test_repair_equals_the_reference(topk, count):
    s = path_rows().to(DEV)
    ridx, rval = topk_from_scores(s.cpu()[None], topk, key_offset=7)
    idx, val = topk_repair(s[None], topk, 7, count=count)
    assert torch.equal(idx.cpu(), ridx) and torch.equal(val.cpu(), rval)


@pytest.mark.parametrize("count", [False, True], ids=["next-pick", "counted"])
@pytest.mark.parametrize("topk", [17, 40, 64, 203])
def test_repair_kernel_on_adversarial_picks(topk, count):
    # the kernel alone, fed picks whose tied keys come in a random order (k + 1 of them, or k and
    # the tie counts); outputs start as garbage: every slot must be written
    s = path_rows(seed=1).to(DEV)
    R, W = s.shape
    kk = min(topk, W)
    ridx, rval = topk_from_scores(s.cpu()[None], topk, key_offset=3)
    for seed in range(2):
        counts = None
        if count and kk < W:
            v, i = shuffled_picks(s, kk, seed)
            counts = torch.zeros(R, dtype=torch.int32, device=DEV)
            plan_count_ties(s, v, counts, kk).run()
        else:
            v, i = shuffled_picks(s, min(kk + 1, W), seed)
        idx = torch.full((R, topk), 12345, dtype=torch.int32, device=DEV)
        val = torch.full((R, topk), 7.0, device=DEV)
        plan_topk_repair(s, v, i, idx, val, kk, 3, counts).run()
        assert torch.equal(idx.cpu(), ridx[0]) and torch.equal(val.cpu(), rval[0]), seed


def test_tie_counts_count_the_keys_equal_to_the_kth_pick():
    s = path_rows(W=203, seed=3).to(DEV)
    v, _ = torch.topk(s, 40, dim=-1)
    counts = torch.zeros(s.shape[0], dtype=torch.int32, device=DEV)
    plan_count_ties(s, v, counts, 40).run()
    want = (s == v[:, 39:40]).sum(-1).to(torch.int32)  # -0.0 == +0.0; NaN equals nothing
    assert torch.equal(counts, want) and int(want[4]) == 203 and int(want[12]) == 0  # row 12: a NaN 40th pick


def test_repair_bf16_scores_and_strided_rows():
    s = path_rows(W=131, seed=2).to(DEV)
    sb = s.bfloat16()
    idx, val = topk_repair(sb[None], 24, 0)
    ridx, rval = topk_from_scores(sb.float().cpu()[None], 24)
    assert torch.equal(idx.cpu(), ridx) and torch.equal(val.cpu(), rval)
    wide = torch.full((14, 150), 9.0, device=DEV)
    wide[:, :131] = s
    idx, val = topk_repair(wide[:, :131].reshape(2, 7, 131), 24, 5)  # rows with a stride > W
    ridx, rval = topk_from_scores(s.cpu().reshape(2, 7, 131), 24, key_offset=5)
    assert torch.equal(idx.cpu(), ridx) and torch.equal(val.cpu(), rval)


def test_repair_rejects_picks_of_another_k():
    s = torch.randn(14, 64, device=DEV)
    v, i = torch.topk(s, 9, dim=-1)
    idx = torch.empty((14, 16), dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="picks must be torch.topk's"):
        plan_topk_repair(s, v, i, idx, idx.float(), 16, 0)
    v, i = torch.topk(s, 16, dim=-1)
    with pytest.raises(ValueError, match="need the \\(k\\+1\\)-th pick or the tie counts"):
        plan_topk_repair(s, v, i, idx, idx.float(), 16, 0)


def test_topk_check_fails_on_a_wrong_repair_path(monkeypatch):
    """correctness.indexer_topk runs the repair path forced: one tie broken the wrong way fails it."""
    from dsa_kernels.ops.indexer_topk import repair
    from dsa_train.gpucheck import correctness
    from dsa_train.gpucheck.core import Options

    real = repair.topk_repair

    def one_swapped_tie(scores, topk, key_offset=0, out=None, count=False):
        idx, val = real(scores, topk, key_offset, out, count)
        if idx.shape[1] > 50:
            idx[0, 50, [0, 1]] = idx[0, 50, [1, 0]].clone()  # row 50's first two slots exchanged
        return idx, val

    monkeypatch.setattr(repair, "topk_repair", one_swapped_tie)
    out = correctness.topk_check(64)(Options(device="cpu", small=True))
    assert out.status == "fail", out.summary
    paths = out.metrics["paths"]
    assert paths["grid"]["entry"]["rows_index_mismatch"] == 0
    assert paths["grid"]["repair"]["rows_index_mismatch"] == 1
    assert not paths["paths_equal_random"] and "repair" in out.summary


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_repair_path_has_no_host_sync():
    s = path_rows(W=4099).cuda()[None]
    for count in (False, True):
        topk_repair(s, 2048, 0, count=count)  # compiled outside the check
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            idx, val = topk_repair(s, 2048, 0, count=count)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        ridx, rval = topk_from_scores(s.cpu(), 2048)
        assert torch.equal(idx.cpu(), ridx) and torch.equal(val.cpu(), rval), count
