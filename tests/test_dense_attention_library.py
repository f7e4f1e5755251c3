"""The frozen main model's attention with its log-sum-exp (dsa_kernels/ops/dense_attention/library.py)
against the reference: packed documents, and the context-parallel shape (a run of queries at
positions [a, a + C) over every visible key, given as the latent and up-projected block by block).
The CUDA path's block splitting runs here with the library op replaced by a reference of its
contract (cumulative sequence lengths, causal from the top left, both lse layouts)."""

import pytest
import torch

from dsa_kernels import dense_attention_ref, doc_starts_from_position_ids
from dsa_kernels.ops.dense_attention import dense_attention_lse, library, mla_attention_rows


def _doc_start(rows):
    return doc_starts_from_position_ids(torch.stack([torch.cat([torch.arange(n) for n in r]) for r in rows]))


def _mla(B, T, H, nope=8, rope=4, R=12, dv=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, nope + rope, generator=g)
    latent = torch.randn(B, T, R, generator=g)
    k_rope = torch.randn(B, T, rope, generator=g)
    w_kv = torch.randn(H * (nope + dv), R, generator=g) / R**0.5
    return q, latent, k_rope, w_kv, nope


def _full_mha(q, latent, k_rope, w_kv, nope, scale, ds):
    k, v = library._up_project(latent, k_rope, w_kv, q.shape[2], nope)
    return dense_attention_ref(q, k, v, scale, ds)


def test_attention_lse_matches_reference_on_packed_documents():
    torch.manual_seed(0)
    ds = _doc_start([[5, 7], [12]])
    q, k, v = torch.randn(2, 12, 3, 8), torch.randn(2, 12, 3, 8), torch.randn(2, 12, 3, 5)
    out, lse = dense_attention_lse(q, k, v, 0.3, ds)
    ref_out, ref_lse = dense_attention_ref(q, k, v, 0.3, ds)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)


@pytest.mark.parametrize("q_offset,C", [(0, 6), (6, 6), (9, 7), (13, 3)])
def test_rows_equal_full_attention_at_their_positions(q_offset, C):
    ds = _doc_start([[4, 9, 3], [16]])
    q, latent, k_rope, w_kv, nope = _mla(2, 16, 3)
    ref_out, ref_lse = _full_mha(q, latent, k_rope, w_kv, nope, 0.25, ds)
    out, lse = mla_attention_rows(q[:, q_offset:q_offset + C], latent, k_rope, w_kv, 0.25, ds, q_offset, nope, key_block=5)
    torch.testing.assert_close(out, ref_out[:, q_offset:q_offset + C], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse[:, q_offset:q_offset + C], rtol=1e-5, atol=1e-5)


def _efficient_contract(layout):
    """A CPU stand-in for aten::_efficient_attention_forward's contract on packed rows."""

    def fake(q, k, v, scale, cu_q, cu_k, max_q, max_k, causal):
        outs, lses = [], []
        for i in range(cu_q.numel() - 1):
            qs, ks = q[0, cu_q[i]:cu_q[i + 1]], k[0, cu_k[i]:cu_k[i + 1]]
            logits = torch.einsum("chd,shd->hcs", qs.float(), ks.float()) * scale
            if causal:  # from the top left
                logits.masked_fill_(torch.ones(len(qs), len(ks), dtype=torch.bool).triu(1), float("-inf"))
            lse = torch.logsumexp(logits, -1)  # [H, c]
            outs.append(torch.einsum("hcs,shd->chd", torch.exp(logits - lse[..., None]), v[0, cu_k[i]:cu_k[i + 1]].float()))
            lses.append(lse)
        if layout == "packed":
            lse = torch.cat(lses, 1)[None]
        else:
            lse = torch.full((len(lses), q.shape[2], max_q + 3), float("nan"))
            for i, x in enumerate(lses):
                lse[i, :, : x.shape[1]] = x
        return torch.cat(outs)[None], library._lse_rows(lse, cu_q, q.shape[1])

    return fake


@pytest.mark.parametrize("layout", ["packed", "per_sequence"])
def test_cuda_block_splitting_with_the_library_contract(monkeypatch, layout):
    monkeypatch.setattr(library, "_efficient", lambda *a: _efficient_contract(layout)(*a))
    ds = _doc_start([[4, 9, 3], [2, 14]])
    q, latent, k_rope, w_kv, nope = _mla(2, 16, 2, seed=1)
    ref_out, ref_lse = _full_mha(q, latent, k_rope, w_kv, nope, 0.3, ds)
    for q_offset, C in [(0, 8), (8, 8), (10, 4)]:
        out, lse = library._rows_efficient(q[:, q_offset:q_offset + C], latent, k_rope, w_kv, 0.3, ds, q_offset, nope, 3)
        torch.testing.assert_close(out, ref_out[:, q_offset:q_offset + C].float(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse, ref_lse[:, q_offset:q_offset + C], rtol=1e-5, atol=1e-5)
    k, v = library._up_project(latent, k_rope, w_kv, 2, nope)
    monkeypatch.setattr(library, "backend_for", lambda q: "efficient")
    out, lse = library._library_or_triton(q, k, v, 0.3, ds)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


def test_merge_of_disjoint_key_sets_and_empty_rows():
    torch.manual_seed(2)
    logits = torch.randn(3, 7)
    v = torch.randn(7, 4)
    lse_a, lse_b = torch.logsumexp(logits[:, :3], -1), torch.logsumexp(logits[:, 3:], -1)
    out_a = torch.softmax(logits[:, :3], -1) @ v[:3]
    out_b = torch.softmax(logits[:, 3:], -1) @ v[3:]
    empty = torch.full((3,), float("-inf"))
    out, lse = library.merge(out_a[:, None], lse_a[:, None], out_b[:, None], lse_b[:, None])
    torch.testing.assert_close(out[:, 0], torch.softmax(logits, -1) @ v)
    torch.testing.assert_close(lse[:, 0], torch.logsumexp(logits, -1))
    out, lse = library.merge(torch.zeros(3, 1, 4), empty[:, None], out_a[:, None], lse_a[:, None])
    torch.testing.assert_close(out[:, 0], out_a)
    out, lse = library.merge(torch.zeros(3, 1, 4), empty[:, None], torch.zeros(3, 1, 4), empty[:, None])
    assert torch.isneginf(lse).all() and (out == 0).all()
