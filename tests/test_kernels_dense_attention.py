"""Dense attention op (dsa_kernels/dense_attention/): the chunked reference, its flash-style autograd
Function and the Triton kernels against a naive full-matrix softmax attention, MLA's MHA form
(per-head keys) and MQA form (one key head), packed documents, odd shapes, fp32 and bf16."""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:  # before triton is first imported: the kernels run in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dsa_kernels as K  # noqa: E402
from dsa_kernels.ops.dense_attention import DenseAttentionFunction, dense_attention_fwd_ref  # noqa: E402

from .test_kernels_reference import full_valid, packed_doc_start  # noqa: E402
from .test_kernels_triton import assert_model_step_triton_matches_ref  # noqa: E402


def naive_attention(q, k, v, scale, doc_start):
    """Full [B, H, T, T] fp32 softmax attention (test oracle only). -> out [B, T, H, Dv], lse [B, T, H]."""
    logits = torch.einsum("bthd,bshd->bhts", q.float(), k.float().expand(-1, -1, q.shape[2], -1)) * scale
    logits = logits.masked_fill(~full_valid(doc_start)[:, None], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.softmax(logits, dim=-1)
    out = torch.einsum("bhts,bshd->bthd", probs, v.float().expand(-1, -1, q.shape[2], -1))
    return out, lse.transpose(1, 2)


def make_qkv(B, T, H, D, Dv, kv_heads, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g).to(dtype)
    k = torch.randn(B, T, kv_heads, D, generator=g).to(dtype)
    v = torch.randn(B, T, kv_heads, Dv, generator=g).to(dtype)
    return q, k, v


@pytest.mark.parametrize("kv_heads", [3, 1])
@pytest.mark.parametrize("chunk", [None, 5])
def test_reference_and_function_match_naive_values_and_grads(kv_heads, chunk):
    B, T, H, D, Dv, scale = 2, 29, 3, 12, 7, 0.3
    q, k, v = make_qkv(B, T, H, D, Dv, kv_heads)
    doc_start = packed_doc_start(B, T, (1, 4))
    grad_out = torch.randn(B, T, H, Dv)

    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = naive_attention(*leaves, scale, doc_start)
    ref_out.backward(grad_out)

    with torch.no_grad():
        fwd_out, fwd_lse = K.dense_attention_ref(q, k, v, scale, doc_start, chunk_size=chunk)
    torch.testing.assert_close(fwd_out, ref_out.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fwd_lse, ref_lse.detach(), rtol=1e-5, atol=1e-5)

    mine = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = K.dense_attention_ref(*mine, scale, doc_start, chunk_size=chunk)
    assert out.grad_fn is not None and not lse.requires_grad
    out.backward(grad_out)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    for got, want in zip(mine, leaves):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5)


def test_function_bf16_grads_close_to_fp32_oracle():
    B, T, H, D, Dv, scale = 1, 33, 2, 16, 8, 0.25
    q, k, v = make_qkv(B, T, H, D, Dv, H, dtype=torch.bfloat16, seed=1)
    doc_start = packed_doc_start(B, T, (3,))
    grad_out = torch.randn(B, T, H, Dv).to(torch.bfloat16)
    leaves = [x.float().requires_grad_() for x in (q, k, v)]
    ref_out, _ = naive_attention(*leaves, scale, doc_start)
    ref_out.backward(grad_out.float())
    mine = [x.clone().requires_grad_() for x in (q, k, v)]
    out, _ = DenseAttentionFunction.apply(*mine, scale, doc_start, 7)
    out.backward(grad_out)
    assert out.dtype == torch.bfloat16 and all(x.grad.dtype == torch.bfloat16 for x in mine)
    torch.testing.assert_close(out.float(), ref_out, rtol=2e-2, atol=2e-2)
    for got, want in zip(mine, leaves):
        torch.testing.assert_close(got.grad.float(), want.grad, rtol=3e-2, atol=3e-2)


def test_forward_only_keeps_no_graph():
    q, k, v = make_qkv(1, 9, 2, 4, 4, 2)
    out, lse = dense_attention_fwd_ref(q.requires_grad_(), k, v, 0.5, torch.zeros(1, 9, dtype=torch.long))
    assert out.grad_fn is None and lse.dtype == torch.float32


@pytest.mark.parametrize("kv_heads", [4, 1])
def test_dense_indexer_kl_from_attention_lse_equals_recomputed(kv_heads):
    """Eq. 3's target built from dense_attention's lse equals the one from a fresh softmax: loss,
    stats and indexer gradients, reference and Triton (interpreter on the CPU)."""
    from dsa_kernels.ops.indexer_kl.function import dense_indexer_kl_triton

    B, T, H, D, HI, DI, scale = 2, 21, 4, 8, 3, 8, 0.35
    q, k, v = make_qkv(B, T, H, D, D, kv_heads, seed=3)
    doc_start = packed_doc_start(B, T, (2, 3))
    g = torch.Generator().manual_seed(4)
    q_idx, k_idx, w_idx = torch.randn(B, T, HI, DI, generator=g), torch.randn(B, T, DI, generator=g), torch.randn(B, T, HI, generator=g)
    _, lse = K.dense_attention_ref(q, k, v, scale, doc_start)
    results = []
    for fn in (K.dense_indexer_kl_ref, dense_indexer_kl_triton):
        for lse_main in (None, lse):
            leaves = [x.clone().requires_grad_() for x in (q_idx, k_idx, w_idx)]
            kl, stats = fn(*leaves, q, k, scale, doc_start, lse_main=lse_main)
            kl.backward()
            results.append((kl.detach(), stats["kl_uniform"], [x.grad for x in leaves]))
    want = results[0]
    for got in results[1:]:
        torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-5)
        for a, b in zip(got[2], want[2]):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


# ----------------------------------------------------------------------------- Triton kernels
from dsa_kernels.ops.dense_attention import dense_attention_triton  # noqa: E402


@pytest.mark.parametrize(
    "B,T,H,D,Dv,docs,dtype",
    [
        (1, 37, 2, 24, 16, (1,), torch.float32),  # odd T, D = 16 + 8 (two head-dim parts)
        (2, 45, 3, 20, 12, (3, 4), torch.float32),  # packed documents, Dv not a power of two
        (1, 40, 2, 48, 32, (5,), torch.bfloat16),  # bf16, D = 32 + 16 (MLA's 128 + 64 in small)
    ],
)
def test_triton_matches_reference_values_and_grads(B, T, H, D, Dv, docs, dtype):
    q, k, v = make_qkv(B, T, H, D, Dv, H, dtype=dtype, seed=5)
    doc_start = packed_doc_start(B, T, docs)
    grad_out = torch.randn(B, T, H, Dv, generator=torch.Generator().manual_seed(6)).to(dtype)
    scale = D**-0.5
    outs = []
    for fn in (K.dense_attention_ref, dense_attention_triton):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out, lse = fn(*leaves, scale, doc_start)
        out.backward(grad_out)
        outs.append((out.detach(), lse, [x.grad for x in leaves]))
    (ref_out, ref_lse, ref_grads), (out, lse, grads) = outs
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert torch.isfinite(out.float()).all() and all(torch.isfinite(g.float()).all() for g in grads)
    torch.testing.assert_close(out.float(), ref_out.float(), **tol)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-4)
    for g, r in zip(grads, ref_grads):
        assert g.dtype == dtype
        torch.testing.assert_close(g.float(), r.float(), **tol)


def test_triton_fully_masked_first_key_block_gives_no_nan():
    """A document starting mid-block: its rows' first key tile (16 keys under the interpreter) is
    fully masked for them; out, lse and grads stay finite and equal the reference."""
    B, T, H, D, Dv = 1, 48, 2, 16, 16
    q, k, v = make_qkv(B, T, H, D, Dv, H, seed=8)
    q[:, 20:] *= 8.0  # large logits: any exp(-inf - (-inf)) or overflow would show
    doc_start = K.doc_starts_from_cu_seqlens(torch.tensor([0, 20, 48]), T)  # second doc starts at 20
    results = []
    for fn in (K.dense_attention_ref, dense_attention_triton):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out, lse = fn(*leaves, D**-0.5, doc_start)
        out.sum().backward()
        results.append((out.detach(), lse, [x.grad for x in leaves]))
    for got, want in zip(results[1][:2] + tuple(results[1][2]), results[0][:2] + tuple(results[0][2])):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


def test_dispatcher_takes_triton_for_mha_form_and_reference_for_mqa(monkeypatch):
    monkeypatch.setenv("DSA_KERNELS", "triton")
    q, k, v = make_qkv(1, 17, 2, 16, 16, 2)
    ds = torch.zeros(1, 17, dtype=torch.long)
    out, _ = K.dense_attention(q.requires_grad_(), k, v, 0.25, ds)
    assert type(out.grad_fn).__name__.startswith("DenseAttentionTritonFunction")
    q1, k1, v1 = make_qkv(1, 17, 2, 16, 16, 1)
    out1, _ = K.dense_attention(q1.requires_grad_(), k1, v1, 0.25, ds)
    assert type(out1.grad_fn).__name__.startswith("DenseAttentionFunction")
    with pytest.raises(ValueError, match="per-head k / v"):
        dense_attention_triton(q1, k1, v1, 0.25, ds)


def test_model_dense_step_through_triton_kernels(monkeypatch):
    """The model's dense path (MHA form, packed documents, LM + eq. 3 loss) through the dispatcher:
    Triton kernels (interpreter) and PyTorch path give the same losses and gradients."""
    names = assert_model_step_triton_matches_ref(monkeypatch, "dense", [13, 7], num_hidden_layers=1,
                                                 num_nextn_predict_layers=0)
    assert any("kv_b_proj" in n for n in names)
