"""The composite-key top-k path (`dsa_kernels.ops.indexer_topk.composite`: torch.topk on int64 keys
= order-preserving score bits, then the inverted key index), the fix-ties path, and the select's
paths end to end (the repair path's kernel: test_kernels_topk_repair.py) against the reference's selection
contract: ties to the lower key index, non-finite scores never selected, -1 tails for rows with
fewer than k valid keys, packed documents and a context-parallel rank's query positions. The key
kernel runs under the Triton interpreter on the CPU (tiny shapes)."""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dsa_kernels import doc_starts_from_position_ids, indexer_topk_ref  # noqa: E402
from dsa_kernels.ops.indexer_topk import indexer_topk_at_positions_ref, topk_from_scores  # noqa: E402
from dsa_kernels.ops.indexer_topk.composite import (  # noqa: E402
    composite_keys_torch,
    plan_composite_keys,
    topk_composite,
    topk_fix_ties,
)
from dsa_kernels.ops.indexer_topk.kernel import _select_chunk, indexer_topk_triton  # noqa: E402

DEV = "cuda" if HAS_CUDA else "cpu"


def grid_values(shape, lo=-2, hi=2, denom=4, seed=0):
    """Multiples of 1/denom: the scores are exact in fp32, so ties are real ties."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(lo * denom, hi * denom + 1, shape, generator=g).float() / denom).to(DEV)


def doc_start(lengths_per_row):
    rows = [torch.cat([torch.arange(n) for n in lengths]) for lengths in lengths_per_row]
    return doc_starts_from_position_ids(torch.stack(rows)).to(DEV)


def hard_scores():
    """Rows that break a careless selector: ties across the threshold, low-bit differences, -0.0
    beside +0.0, +inf / NaN, a row with no valid key, rows with fewer valid keys than k, negatives."""
    g = torch.Generator().manual_seed(0)
    s = torch.randn(2, 8, 300, generator=g)
    s[0, 0, ::3] = 0.0
    s[0, 0, 1::3] = -0.0
    s[0, 1, 50:] = float("-inf")  # 50 valid keys
    s[0, 2, ::5] = float("nan")
    s[0, 2, ::7] = float("inf")
    s[0, 3] = 1.0  # one value: every key ties
    s[0, 4] = torch.round(s[0, 4] * 2) / 2  # a few values, many ties
    base = torch.ones(300)
    s[0, 5] = torch.where(torch.rand(300, generator=g) < 0.5, torch.nextafter(base, base + 1), base)  # last bit
    s[0, 6] = float("-inf")  # no valid key
    s[0, 7, ::2] = float("nan")
    s[1] = -s[1].abs()  # all negative
    s[1, 3, 200:] = -0.0
    return s


@pytest.mark.parametrize("topk", [1, 17, 64, 299, 300, 400])
def test_composite_topk_equals_the_reference_on_hard_rows(topk):
    s = hard_scores()
    ridx, rval = topk_from_scores(s, topk, key_offset=5)
    for budget in (1 << 25, 700):  # one slice of rows, or three rows at a time
        idx, val = topk_composite(s, topk, 5, use_kernel=False, budget_elems=budget)
        assert torch.equal(idx, ridx) and torch.equal(val, rval), budget
        idx, val = topk_fix_ties(s, topk, 5, budget_elems=budget)
        assert torch.equal(idx, ridx) and torch.equal(val, rval), ("fix-ties", budget)


def test_fix_ties_redoes_only_the_rows_tied_at_the_kth_score(monkeypatch):
    # rows without a tie at the k-th score come from torch.topk on the fp32 scores alone; a tie
    # across the boundary, or a NaN / +inf pick, sends that row (only) through the composite path
    from dsa_kernels.ops.indexer_topk import composite

    g = torch.Generator().manual_seed(2)
    s = torch.randn(1, 6, 200, generator=g)
    s[0, 1, 50:150] = 3.0  # 100 keys tie above all others: a tie across the k-th for k < 100
    s[0, 3, 7] = float("nan")
    s[0, 4, ::2] = 0.0
    s[0, 4, 1::2] = -1.0  # 100 zeros: tied at the k-th for k < 100
    redone = []
    real = composite.topk_composite

    def spy(rows, topk, key_offset=0, **kw):
        redone.append(rows.shape[1])
        return real(rows, topk, key_offset, **kw)

    monkeypatch.setattr(composite, "topk_composite", spy)
    idx, val = topk_fix_ties(s, 20, 0)
    ridx, rval = topk_from_scores(s, 20)
    assert torch.equal(idx, ridx) and torch.equal(val, rval)
    assert redone == [3]  # rows 1, 3, 4
    redone.clear()
    idx, val = topk_fix_ties(s[:, [0, 2, 5]], 20, 0)
    assert redone == [] and torch.equal(idx, ridx[:, [0, 2, 5]])


def test_composite_key_order_is_score_then_lower_index():
    s = torch.tensor([[[0.5, -1.0, 0.5, float("nan"), -0.0, 0.0, float("inf"), -1.0, float("-inf"), 3.0]]])
    comp = composite_keys_torch(s)[0, 0]
    order = torch.argsort(comp, descending=True).tolist()
    # 3.0; the two 0.5 by index; the zeros (-0.0 == +0.0) by index; the two -1.0; then the non-finite
    # keys (one key value, so by index too)
    assert order == [9, 0, 2, 4, 5, 1, 7, 3, 6, 8]
    assert len({int(c) for c in comp}) == comp.numel()  # every composite distinct


def test_composite_kernel_builds_the_same_keys_as_torch():
    s = hard_scores().to(DEV)
    rows = s.reshape(-1, s.shape[-1])
    for src in (rows, rows[:, :257], rows.bfloat16()):  # odd width (a partial block), bf16 scores
        out = torch.empty(src.shape, dtype=torch.int64, device=DEV)
        plan_composite_keys(src.float() if not HAS_CUDA else src, out).run()
        assert torch.equal(out.cpu(), composite_keys_torch(src.cpu()))
    for topk in (9, 64, 400):
        idx, val = topk_composite(s, topk, 3, use_kernel=True, budget_elems=1000)
        ridx, rval = topk_from_scores(s.cpu(), topk, key_offset=3)
        assert torch.equal(idx.cpu(), ridx) and torch.equal(val.cpu(), rval)
    sb = s.bfloat16()
    idx, val = topk_composite(sb, 64, 0, use_kernel=True)
    ridx, rval = topk_from_scores(sb.float().cpu(), 64)
    assert torch.equal(idx.cpu(), ridx) and torch.equal(val.cpu(), rval)


@pytest.mark.parametrize("path", ["composite", "fix-ties", "radix", "repair", "repair-count"])
def test_select_paths_agree_with_the_reference(path):
    s = hard_scores()
    for topk in (1, 64, 300):
        idx, val = _select_chunk(s.to(DEV), 2, topk, path=path)
        ridx, rval = topk_from_scores(s, topk, key_offset=2)
        assert torch.equal(idx.cpu(), ridx) and torch.equal(val.cpu(), rval), (path, topk)
    with pytest.raises(ValueError, match="select path must be one of"):
        _select_chunk(s.to(DEV), 0, 4, path="sort")


def test_composite_path_end_to_end_packed_documents_and_all_tie_rows():
    # grid inputs (exact scores), three packed documents in one row, a second batch row of one
    # document; zero query rows tie every key at 0 and must take the lowest keys of their document
    B, T, H, D, topk = 2, 45, 3, 24, 16
    q, k, w = grid_values((B, T, H, D), seed=1), grid_values((B, T, D), seed=2), grid_values((B, T, H), seed=3)
    q[0, 30] = 0
    q[1, 44] = 0
    ds = doc_start([[19, 7, 19], [45]])
    ridx, rval = indexer_topk_ref(q, k, w, ds, topk)
    for select in ("composite", "fix-ties", "radix", "repair", "repair-count"):
        idx, val = indexer_topk_triton(q, k, w, ds, topk, select=select, chunk_size=11)
        assert torch.equal(idx, ridx) and torch.equal(val, rval), select
    assert (ridx[0, 0, 1:] == -1).all()  # the first token has one key: -1 tail
    want = torch.cat([torch.arange(26, 31), torch.full((topk - 5,), -1)]).to(ridx)  # its document's 5 keys
    assert torch.equal(ridx[0, 30], want)
    assert torch.equal(ridx[1, 44], torch.arange(topk, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="select must be one of"):
        indexer_topk_triton(q, k, w, ds, topk, select="sort")


def test_composite_path_at_context_parallel_positions():
    # a CP rank's queries (zigzag chunks) over the whole sequence, packed documents, bf16 inputs
    from dsa_train.parallel.context import local_positions

    B, T, H, D, topk, cp = 1, 64, 2, 16, 12, 2
    q, k, w = grid_values((B, T, H, D), seed=4), grid_values((B, T, D), seed=5), grid_values((B, T, H), seed=6)
    q, k = q.bfloat16(), k.bfloat16()
    ds = doc_start([[23, 41]])
    p = local_positions(T, cp, 1, device=DEV)
    ridx, rval = indexer_topk_at_positions_ref(q[:, p], k, w[:, p], ds, topk, p)
    for select in ("composite", "fix-ties", "repair", "repair-count"):
        idx, val = indexer_topk_triton(q[:, p], k, w[:, p], ds, topk, query_positions=p, select=select, chunk_size=10)
        assert torch.equal(idx, ridx) and torch.equal(val, rval), select
