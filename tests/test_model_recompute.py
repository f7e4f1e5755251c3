"""Model blocks that keep only their inputs for backward give the plain expressions' values and
gradients: RMSNorm (recomputed, bit-equal) and the dense MLP (row-chunked Function)."""

import pytest
import torch
from torch.nn import functional as F

from dsa_train.model import moe
from dsa_train.model.norm import RMSNorm, rms_norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_gradients_bit_equal_to_plain_expression(dtype):
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(24).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(24, generator=g))
    x = torch.randn(3, 7, 24, generator=g).to(dtype).requires_grad_()
    grad = torch.randn(3, 7, 24, generator=g).to(dtype)
    y = norm(x)
    assert type(y.grad_fn).__name__ == "_RecomputedBackward"
    plain = rms_norm(x, norm.weight, norm.eps)
    assert torch.equal(y, plain)
    for a, b in zip(torch.autograd.grad(y, (x, norm.weight), grad), torch.autograd.grad(plain, (x, norm.weight), grad)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype,rows", [(torch.float32, 3), (torch.bfloat16, 3), (torch.bfloat16, 2048)])
def test_row_chunked_mlp_matches_plain_expression(dtype, rows, monkeypatch):
    monkeypatch.setattr(moe._RowChunkedMLP, "ROWS", rows)
    torch.manual_seed(0)
    mlp = moe.MLP(24, 40).to(dtype)
    x = torch.randn(2, 7, 24).to(dtype).requires_grad_()
    grad = torch.randn(2, 7, 24).to(dtype)
    params = (x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    y = mlp(x)
    assert type(y.grad_fn).__name__ == "_RowChunkedMLPBackward"
    plain = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(y, plain, **tol)
    for a, b in zip(torch.autograd.grad(y, params, grad), torch.autograd.grad(plain, params, grad)):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, **tol)
    with torch.no_grad():  # no graph: the plain expression
        assert torch.equal(mlp(x), plain)
