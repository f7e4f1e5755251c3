"""The chunked LM cross-entropy (dsa_train.loss.cross_entropy_sum) equals
F.cross_entropy(logits.float(), reduction="sum") in value and gradient, ignored labels included."""

import pytest
import torch
from torch.nn import functional as F

from dsa_train.loss import IGNORE_INDEX, cross_entropy_sum


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows_per_chunk", [1, 4, 1000])
def test_cross_entropy_sum_matches_torch(dtype, rows_per_chunk):
    g = torch.Generator().manual_seed(0)
    V = 37
    logits0 = (3 * torch.randn(2, 13, V, generator=g)).to(dtype)
    labels = torch.randint(0, V, (2, 13), generator=g)
    labels[0, 3] = labels[1, -1] = IGNORE_INDEX
    results = []
    for fn in ("torch", "chunked"):
        logits = logits0.clone().requires_grad_()
        if fn == "torch":
            ce = F.cross_entropy(logits.float().reshape(-1, V), labels.reshape(-1), ignore_index=IGNORE_INDEX,
                                 reduction="sum")
            n = float((labels != IGNORE_INDEX).sum())
        else:
            ce, n = cross_entropy_sum(logits, labels, chunk_elems=rows_per_chunk * V)
        (grad,) = torch.autograd.grad(0.3 * ce, logits)
        results.append((ce, n, grad))
    (ce, n, grad), (c_ce, c_n, c_grad) = results
    assert c_n == n == 24.0 and c_ce.dtype == torch.float32 and c_grad.dtype == dtype
    torch.testing.assert_close(c_ce, ce, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(c_grad, grad, rtol=1e-5, atol=1e-6)
    assert bool((c_grad[0, 3] == 0).all())  # an ignored label gets no gradient


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_leaves_the_logits_as_they_were(dtype):
    """The backward's fp32 row chunk is a copy in every dtype: on fp32 logits (every CPU recipe, the
    smoke profile) `.float()` returned the logits themselves, so the backward wrote softmax - onehot
    into the model's output `logits` in place, and an op that saved them for its own backward (tanh,
    a soft cap) then failed ('modified by an inplace operation')."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 5, 11, generator=g, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, 11, (2, 5), generator=g)
    logits = torch.tanh(h)  # saves its output for its backward
    before = logits.detach().clone()
    ce, _ = cross_entropy_sum(logits, labels, chunk_elems=3 * 11)
    ce.backward()
    assert torch.equal(logits.detach(), before)
    assert h.grad is not None and torch.isfinite(h.grad).all()
