"""The chunked reference ops equal naive full-matrix implementations of eqs. 1-4, edge cases included."""

import pytest
import torch

import dsa_kernels as K
from dsa_kernels.ops.indexer_kl import kl_rows

torch.manual_seed(0)


def full_valid(doc_start):
    B, T = doc_start.shape
    t = torch.arange(T)[:, None]
    s = torch.arange(T)[None, :]
    return (s <= t)[None] & (s >= doc_start[:, :, None])  # [B, T, T]


def naive_index_scores(q, k, w, doc_start):
    logits = torch.einsum("bthd,bsd->bths", q, k)
    scores = torch.einsum("bths,bth->bts", torch.relu(logits), w)
    return scores.masked_fill(~full_valid(doc_start), float("-inf"))


def packed_doc_start(B, T, docs_per_row):
    pos = []
    g = torch.Generator().manual_seed(7)
    for b in range(B):
        cuts = sorted(torch.randperm(T - 1, generator=g)[: docs_per_row[b] - 1].add(1).tolist())
        p = torch.arange(T)
        for c in cuts:
            p[c:] = torch.arange(T - c)
        pos.append(p)
    return K.doc_starts_from_position_ids(torch.stack(pos))


def make_inputs(B=2, T=37, H=3, D=8, docs=(1, 3)):
    q = torch.randn(B, T, H, D)
    k = torch.randn(B, T, D)
    w = torch.randn(B, T, H)
    return q, k, w, packed_doc_start(B, T, docs)


def test_doc_starts_from_position_ids_and_cu_seqlens():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    assert K.doc_starts_from_position_ids(pos).tolist() == [[0, 0, 0, 3, 3, 5, 5, 5, 5]]
    cu = torch.tensor([0, 3, 5, 9])
    assert K.doc_starts_from_cu_seqlens(cu, 9).tolist() == [[0, 0, 0, 3, 3, 5, 5, 5, 5]]
    with pytest.raises(ValueError, match="cu_seqlens"):
        K.doc_starts_from_cu_seqlens(torch.tensor([0, 3, 8]), 9)


@pytest.mark.parametrize("chunk", [1, 5, 16, None])
@pytest.mark.parametrize("topk", [4, 11, 64])
def test_indexer_topk_matches_naive(chunk, topk):
    q, k, w, doc_start = make_inputs()
    idx, val = K.indexer_topk_ref(q, k, w, doc_start, topk, chunk_size=chunk)
    naive = naive_index_scores(q, k, w, doc_start)
    assert idx.shape == (2, 37, topk) and idx.dtype == torch.int32
    valid = full_valid(doc_start)
    for b in range(2):
        for t in range(37):
            n_valid = int(valid[b, t].sum())
            sel = idx[b, t]
            assert int((sel >= 0).sum()) == min(n_valid, topk)
            assert bool((sel[min(n_valid, topk):] == -1).all())  # -1 padding after the valid slots
            chosen = sel[sel >= 0].long()
            assert bool(valid[b, t, chosen].all()), "selected a key outside the causal document window"
            ref_vals = naive[b, t].sort(descending=True).values[: len(chosen)]
            torch.testing.assert_close(naive[b, t, chosen].sort(descending=True).values, ref_vals)
            torch.testing.assert_close(val[b, t, : len(chosen)], naive[b, t, chosen])


def test_topk_ties_break_to_lower_index_and_all_equal_scores():
    scores = torch.tensor([[[1.0, 3.0, 3.0, 3.0, float("-inf"), 0.0]]])
    from dsa_kernels.ops.indexer_topk import topk_from_scores

    idx, val = topk_from_scores(scores, 3)
    assert idx.tolist() == [[[1, 2, 3]]]
    idx, val = topk_from_scores(torch.zeros(1, 1, 6), 4)
    assert idx.tolist() == [[[0, 1, 2, 3]]]
    idx, val = topk_from_scores(torch.full((1, 1, 3), float("-inf")), 2)
    assert idx.tolist() == [[[-1, -1]]]  # no valid key: every slot empty, never token 0


def naive_sparse_mla(q, kv, indices, scale, d_v):
    B, T, H, D = q.shape
    logits = torch.einsum("bthd,bsd->bths", q, kv) * scale
    mask = torch.zeros(B, T, T, dtype=torch.bool)
    for b in range(B):
        for t in range(T):
            sel = indices[b, t][indices[b, t] >= 0].long()
            mask[b, t, sel] = True
    logits = logits.masked_fill(~mask[:, :, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    return torch.einsum("bths,bsd->bthd", probs, kv[..., :d_v])


@pytest.mark.parametrize("chunk", [3, None])
def test_sparse_mla_matches_naive_values_and_grads(chunk):
    q_i, k_i, w_i, doc_start = make_inputs(T=29)
    indices, _ = K.indexer_topk_ref(q_i, k_i, w_i, doc_start, topk=6)
    indices[0, 5] = -1  # a row with every slot empty
    q = torch.randn(2, 29, 4, 12, requires_grad=True)
    kv = torch.randn(2, 29, 12, requires_grad=True)
    out, lse = K.sparse_mla_ref(q, kv, indices, 0.3, 8, chunk_size=chunk)
    ref = naive_sparse_mla(q, kv, indices, 0.3, 8)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert torch.isneginf(lse[0, 5]).all() and bool((out[0, 5] == 0).all())
    g = torch.randn_like(out)
    gq, gkv = torch.autograd.grad(out, (q, kv), g)
    rq, rkv = torch.autograd.grad(ref, (q, kv), g)
    assert torch.isfinite(gq).all() and torch.isfinite(gkv).all()
    torch.testing.assert_close(gq, rq, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gkv, rkv, rtol=1e-5, atol=1e-6)


def naive_dense_target(q_main, k_main, scale, doc_start):
    logits = torch.einsum("bthd,bshd->bths", q_main, k_main.expand(-1, -1, q_main.shape[2], -1)) * scale
    logits = logits.masked_fill(~full_valid(doc_start)[:, :, None, :], float("-inf"))
    return torch.softmax(logits, -1).sum(2) / q_main.shape[2]  # [B, T, S]


@pytest.mark.parametrize("kv_heads", [1, 3])
def test_dense_indexer_kl_matches_naive(kv_heads):
    q_i, k_i, w_i, doc_start = make_inputs(T=31)
    for x in (q_i, k_i, w_i):
        x.requires_grad_(True)
    q_main = torch.randn(2, 31, 3, 10)
    k_main = torch.randn(2, 31, kv_heads, 10)
    kl, stats = K.dense_indexer_kl_ref(q_i, k_i, w_i, q_main, k_main, 0.4, doc_start, chunk_size=7)
    p = naive_dense_target(q_main, k_main, 0.4, doc_start)
    assert torch.allclose(p.sum(-1), torch.ones(2, 31))  # L1-normalized target
    scores = naive_index_scores(q_i, k_i, w_i, doc_start)
    log_q = torch.log_softmax(scores, -1)
    valid = full_valid(doc_start)
    ref = torch.where(valid & (p > 0), p * (torch.log(p) - log_q), torch.zeros_like(p)).sum()
    torch.testing.assert_close(kl, ref, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(kl, (q_i, k_i, w_i))
    ref_grads = torch.autograd.grad(ref, (q_i, k_i, w_i))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)
    ref_uniform = (torch.where(valid & (p > 0), p * torch.log(p), torch.zeros_like(p)).sum(-1)
                   + torch.log(valid.sum(-1).float())).sum()
    torch.testing.assert_close(stats["kl_uniform"], ref_uniform, rtol=1e-5, atol=1e-5)


def test_sparse_indexer_kl_matches_naive():
    q_i, k_i, w_i, doc_start = make_inputs(T=33)
    indices, _ = K.indexer_topk_ref(q_i, k_i, w_i, doc_start, topk=5)
    q_main = torch.randn(2, 33, 4, 12)
    kv = torch.randn(2, 33, 12)
    out, lse = K.sparse_mla_ref(q_main, kv, indices, 0.3, 8)
    for x in (q_i, k_i, w_i):
        x.requires_grad_(True)
    kl, stats = K.sparse_indexer_kl_ref(q_i, k_i, w_i, indices, q_main, kv, lse, 0.3, chunk_size=4)
    # naive: p over S_t from the main sparse attention, KL against softmax of I over S_t
    total = 0.0
    scores_full = naive_index_scores(q_i, k_i, w_i, doc_start)
    for b in range(2):
        for t in range(33):
            sel = indices[b, t][indices[b, t] >= 0].long()
            logits = torch.einsum("hd,kd->hk", q_main[b, t], kv[b, sel]) * 0.3
            p = torch.softmax(logits, -1).sum(0) / 4
            log_q = torch.log_softmax(scores_full[b, t, sel], -1)
            total = total + (p * (torch.log(p) - log_q)).sum()
    torch.testing.assert_close(kl, total, rtol=1e-5, atol=1e-5)
    for g, r in zip(torch.autograd.grad(kl, (q_i, k_i, w_i)), torch.autograd.grad(total, (q_i, k_i, w_i))):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


def test_kl_rows_zero_when_index_distribution_matches():
    p = torch.tensor([[0.5, 0.25, 0.25, 0.0]])
    valid = torch.tensor([[True, True, True, False]])
    kl, klu = kl_rows(p, torch.log(p.clamp_min(1e-30)), valid)
    assert abs(float(kl)) < 1e-6
    assert float(klu) == pytest.approx(0.5 * torch.log(torch.tensor(0.5)).item() + 0.5 * torch.log(torch.tensor(0.25)).item() + torch.log(torch.tensor(3.0)).item())


def test_dense_attention_matches_sdpa_with_document_mask():
    B, T, H = 2, 23, 3
    q, k, v = torch.randn(B, T, H, 8), torch.randn(B, T, H, 8), torch.randn(B, T, H, 5)
    doc_start = packed_doc_start(B, T, (2, 4))
    out, _ = K.dense_attention_ref(q, k, v, 0.35, doc_start, chunk_size=4)
    mask = full_valid(doc_start)[:, None]  # [B, 1, T, T]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=0.35
    ).transpose(1, 2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
