"""The indexer's head weights w = weights_proj(x) in fp32 (DeepSeek-V3.2's `weights_proj(x.float())`):
bitwise the plain expression forward and backward, without keeping an fp32 copy of x for the backward
(`dsa_train.model.indexer._LinearInFp32`; 4 bytes per hidden unit and token per layer at 671B)."""

import pytest
import torch
from torch.nn import functional as F

from dsa_train.model.indexer import _LinearInFp32


@pytest.mark.parametrize("x_dtype, w_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                              (torch.bfloat16, torch.float32)])
def test_bitwise_the_plain_expression(x_dtype, w_dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 7, 32, generator=g).to(x_dtype).requires_grad_()
    w = torch.randn(8, 32, generator=g).to(w_dtype).requires_grad_()
    dy = torch.randn(2, 7, 8, generator=g)
    ref = F.linear(x.float(), w.float())
    out = _LinearInFp32.apply(x, w)
    assert out.dtype == torch.float32 and torch.equal(out, ref)
    for a, b in zip(torch.autograd.grad(out, [x, w], dy), torch.autograd.grad(ref, [x, w], dy)):
        assert a.dtype == b.dtype and torch.equal(a, b)


def _saved_fp32_inputs(x_shape, fn) -> int:
    """fp32 tensors of x's size the autograd graph keeps for the backward (any view of it)."""
    found = []

    def pack(t):
        if t.dtype == torch.float32 and t.numel() == torch.Size(x_shape).numel():
            found.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return len(found)


def test_no_fp32_copy_of_x_is_kept():
    from dsa_train.model.config import DSAConfig
    from dsa_train.model.indexer import LightningIndexer

    cfg = DSAConfig(hidden_size=64, q_lora_rank=32, index_n_heads=4, index_head_dim=16, qk_rope_head_dim=8,
                    num_hidden_layers=1)
    indexer = LightningIndexer(cfg).to(torch.bfloat16)
    x = torch.randn(1, 5, 64, dtype=torch.bfloat16)
    q_latent = torch.randn(1, 5, 32, dtype=torch.bfloat16)
    cos, sin = torch.ones(1, 5, 4), torch.zeros(1, 5, 4)
    assert _saved_fp32_inputs((1, 5, 64), lambda: indexer(x, q_latent, cos, sin)) == 0
    # the plain expression does keep one (what this Function removes)
    assert _saved_fp32_inputs((1, 5, 64), lambda: F.linear(x.float(), indexer.weights_proj.weight.float())) == 1
