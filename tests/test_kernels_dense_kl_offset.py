"""The dense indexer KL (eq. 3) Triton kernel for a run of queries at a position offset over more
keys (a context-parallel rank's run over the gathered sequence), against the PyTorch reference of
the same thing: the sparse KL over every visible key (`visible_key_indices`, what the CPU path
runs), packed documents, MQA and MHA forms; values and the gradients of q_I, k_I (all N key rows)
and w."""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dsa_kernels import dense_attention_ref, doc_starts_from_position_ids, sparse_indexer_kl_ref  # noqa: E402
from dsa_kernels.ops.indexer_kl.function import dense_indexer_kl_triton  # noqa: E402
from dsa_train.model.mla import visible_key_indices  # noqa: E402

DEV = "cuda" if HAS_CUDA else "cpu"


@pytest.mark.parametrize("q_offset,T,form", [(6, 5, "mqa"), (0, 7, "mqa"), (9, 4, "mha")])
def test_dense_kl_at_an_offset_equals_the_visible_key_reference(q_offset, T, form):
    torch.manual_seed(q_offset)
    B, N, HI, DI, H, D = 2, 13, 2, 8, 3, 12
    rows = [torch.cat([torch.arange(4), torch.arange(9)]), torch.cat([torch.arange(8), torch.arange(5)])]
    ds = doc_starts_from_position_ids(torch.stack(rows)).to(DEV)
    pos = torch.arange(q_offset, q_offset + T, device=DEV)
    scale = D**-0.5
    q_full = torch.randn(B, N, H, D, device=DEV)
    kv = torch.randn(B, N, D, device=DEV)
    k_main = kv[:, :, None, :] if form == "mqa" else torch.randn(B, N, H, D, device=DEV)
    _, lse_full = dense_attention_ref(q_full, k_main, torch.randn(B, N, k_main.shape[2], 4, device=DEV), scale, ds)
    qm, lse = q_full[:, q_offset:q_offset + T], lse_full[:, q_offset:q_offset + T]
    qi = torch.randn(B, T, HI, DI, device=DEV)
    ki = torch.randn(B, N, DI, device=DEV)
    wi = torch.rand(B, T, HI, device=DEV)
    got_in = [x.clone().requires_grad_() for x in (qi, ki, wi)]
    kl, stats = dense_indexer_kl_triton(*got_in, qm, k_main, scale, ds, lse_main=lse, q_offset=q_offset)
    got = torch.autograd.grad(kl, got_in)
    ref_in = [x.clone().requires_grad_() for x in (qi, ki, wi)]
    idx = visible_key_indices(ds, pos)
    if form == "mqa":
        rkl, rstats = sparse_indexer_kl_ref(*ref_in, idx, qm, kv, lse, scale)
    else:  # MHA: per-head keys (the sparse reference takes one shared key): the same terms written out
        from dsa_kernels.ops.indexer_kl.reference import kl_rows
        from dsa_kernels.ops.indexer_topk.reference import gather_index_scores

        logits = torch.einsum("bthd,bshd->bhts", qm.float(), k_main.float()) * scale
        valid = (idx >= 0)
        full_valid = torch.zeros(B, T, N, dtype=torch.bool, device=DEV)
        full_valid.scatter_(2, idx.clamp(min=0).long(), valid)
        probs = torch.exp(logits - lse.transpose(1, 2)[..., None]) * full_valid[:, None]
        p = probs.sum(1) / H  # [B, T, N]
        scores = gather_index_scores(ref_in[0], ref_in[1], ref_in[2], torch.arange(N, device=DEV).expand(B, T, N))
        k, ku = kl_rows(p, scores, full_valid)
        rkl, rstats = k.sum(), {"kl_uniform": ku.sum().detach()}
    ref = torch.autograd.grad(rkl, ref_in)
    torch.testing.assert_close(kl, rkl, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats["kl_uniform"], rstats["kl_uniform"], rtol=1e-5, atol=1e-5)
    for g, r in zip(got, ref):
        assert g.shape == r.shape
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


def test_an_offset_without_lse_or_beyond_the_keys_fails_clearly():
    B, N, T = 1, 8, 3
    args = (torch.randn(B, T, 2, 8), torch.randn(B, N, 8), torch.rand(B, T, 2), torch.randn(B, T, 2, 8),
            torch.randn(B, N, 1, 8), 0.3, torch.zeros(B, N, dtype=torch.long))
    with pytest.raises(ValueError, match="need lse_main"):
        dense_indexer_kl_triton(*args, q_offset=5)
    with pytest.raises(ValueError, match=r"positions \[6, 9\)"):
        dense_indexer_kl_triton(*args, lse_main=torch.zeros(B, T, 2), q_offset=6)
