"""Dense attention op (kernels/dense_attention/): the chunked reference, its flash-style autograd
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
