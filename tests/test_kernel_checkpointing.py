"""Every kernel autograd Function (Triton path, interpreter, tiny shapes) under non-reentrant
activation checkpointing: after the checkpointed forward no storage of a tensor made inside the
region survives (a Function that kept its inputs in a closure or on a `ctx` attribute instead of
`save_for_backward` would keep them until its backward: issue 32, ~5.8 GB per layer in the 671B
warm-up), and the gradients equal those of the uncheckpointed run.

How it tells: the region copies its inputs (`x * 1`), records a weak reference to each copy's
storage (`StorageWeakRef`) and passes the copies to the Function; non-reentrant checkpoint drops
what the Function saved, so every copy must be freed once the forward returns. The control test
shows the probe does see a closure that keeps a tensor."""

import gc
import os

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dsa_kernels import doc_starts_from_position_ids  # noqa: E402
from dsa_kernels.ops.dense_attention.function import dense_attention_triton  # noqa: E402
from dsa_kernels.ops.indexer_kl.function import dense_indexer_kl_triton, sparse_indexer_kl_triton  # noqa: E402
from dsa_kernels.ops.sparse_mla.function import sparse_mla_triton  # noqa: E402

DEV = "cuda" if HAS_CUDA else "cpu"


def _copies(probe, *xs):
    """x * 1 for each x (a tensor made inside the region), its storage recorded in `probe`."""
    out = []
    for x in xs:
        c = x * 1 if x.is_floating_point() else x.clone()
        probe.append(StorageWeakRef(c.untyped_storage()))
        out.append(c)
    return out


def _run(region, inputs, use_checkpoint):
    """-> (alive storages after the forward, loss value, gradients of the float inputs)."""
    leaves = [x.detach().clone().requires_grad_(x.is_floating_point() and x.requires_grad) for x in inputs]
    probe = []
    if use_checkpoint:
        loss = checkpoint(region, probe, *leaves, use_reentrant=False)
    else:
        loss = region(probe, *leaves)
    gc.collect()
    alive = sum(not ref.expired() for ref in probe)
    loss.backward()
    grads = [x.grad for x in leaves if x.requires_grad]
    return alive, loss.detach(), grads


def _check(region, inputs):
    alive_plain, loss_plain, grads_plain = _run(region, inputs, False)
    alive_ckpt, loss_ckpt, grads_ckpt = _run(region, inputs, True)
    assert alive_plain > 0, "the probe saw nothing kept without checkpointing: the region saves nothing"
    assert alive_ckpt == 0, f"{alive_ckpt} tensors made inside the checkpointed region survived its forward"
    torch.testing.assert_close(loss_ckpt, loss_plain, rtol=0, atol=0)
    assert len(grads_ckpt) == len(grads_plain) > 0
    for a, b in zip(grads_ckpt, grads_plain):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def _doc_start(B, lengths):
    row = torch.cat([torch.arange(n) for n in lengths])
    return doc_starts_from_position_ids(row.expand(B, -1).contiguous()).to(DEV)


def _causal_indices(B, T, K, n_keys=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    n_keys = n_keys or T
    idx = torch.full((B, T, K), -1, dtype=torch.int32)
    for b in range(B):
        for t in range(T):
            vis = t + (n_keys - T) + 1  # query rows are the last T of n_keys positions
            n = min(K, vis)
            idx[b, t, :n] = torch.randperm(vis, generator=g)[:n].to(torch.int32)
    return idx.to(DEV)


def test_dense_indexer_kl_frees_its_inputs_under_checkpoint():
    torch.manual_seed(0)
    B, T, HI, DI, H, D = 1, 9, 2, 8, 2, 8
    ds = _doc_start(B, [4, 5])
    inputs = [torch.randn(B, T, HI, DI, device=DEV, requires_grad=True), torch.randn(B, T, DI, device=DEV, requires_grad=True),
              torch.rand(B, T, HI, device=DEV, requires_grad=True), torch.randn(B, T, H, D, device=DEV),
              torch.randn(B, T, H, D, device=DEV)]

    def region(probe, qi, ki, wi, qm, km):
        qi, ki, wi, qm, km = _copies(probe, qi, ki, wi, qm, km)
        return dense_indexer_kl_triton(qi, ki, wi, qm, km, D**-0.5, ds)[0]

    _check(region, inputs)


def test_dense_indexer_kl_with_lse_frees_its_inputs_under_checkpoint():
    torch.manual_seed(1)
    B, T, HI, DI, H, D = 1, 7, 2, 8, 2, 8
    ds = _doc_start(B, [7])
    q, k = torch.randn(B, T, H, D, device=DEV), torch.randn(B, T, H, D, device=DEV)
    from dsa_kernels import dense_attention_ref

    _, lse = dense_attention_ref(q, k, torch.randn(B, T, H, 4, device=DEV), D**-0.5, ds)
    inputs = [torch.randn(B, T, HI, DI, device=DEV, requires_grad=True), torch.randn(B, T, DI, device=DEV, requires_grad=True),
              torch.rand(B, T, HI, device=DEV, requires_grad=True), q, k, lse]

    def region(probe, qi, ki, wi, qm, km, lse_m):
        qi, ki, wi, qm, km, lse_m = _copies(probe, qi, ki, wi, qm, km, lse_m)
        return dense_indexer_kl_triton(qi, ki, wi, qm, km, D**-0.5, ds, lse_main=lse_m)[0]

    _check(region, inputs)


def test_sparse_indexer_kl_frees_its_inputs_under_checkpoint():
    torch.manual_seed(2)
    B, T, N, HI, DI, H, D, K = 1, 5, 8, 2, 8, 2, 12, 6  # CP shape: 5 query rows over 8 key rows
    idx = _causal_indices(B, T, K, N)
    q, kv = torch.randn(B, T, H, D, device=DEV), torch.randn(B, N, D, device=DEV)
    from dsa_kernels import sparse_mla_ref

    _, lse = sparse_mla_ref(q, kv, idx, D**-0.5, 8)
    inputs = [torch.randn(B, T, HI, DI, device=DEV, requires_grad=True), torch.randn(B, N, DI, device=DEV, requires_grad=True),
              torch.rand(B, T, HI, device=DEV, requires_grad=True), idx, q, kv, lse]

    def region(probe, qi, ki, wi, ix, qm, kvm, lse_m):
        qi, ki, wi, ix, qm, kvm, lse_m = _copies(probe, qi, ki, wi, ix, qm, kvm, lse_m)
        return sparse_indexer_kl_triton(qi, ki, wi, ix, qm, kvm, lse_m, D**-0.5)[0]

    _check(region, inputs)


def test_sparse_stage_with_the_forward_target_frees_its_inputs_under_checkpoint():
    # the sparse stage's pair (issue 31): the KL keeps the target the attention's forward emitted
    # (through save_for_backward), so the recompute forms it again and nothing outlives the forward
    torch.manual_seed(5)
    B, T, N, HI, DI, H, D, Dv, K = 1, 5, 8, 2, 8, 3, 24, 16, 6
    idx = _causal_indices(B, T, K, N, seed=2)
    inputs = [torch.randn(B, T, HI, DI, device=DEV, requires_grad=True), torch.randn(B, N, DI, device=DEV, requires_grad=True),
              torch.rand(B, T, HI, device=DEV, requires_grad=True), idx,
              torch.randn(B, T, H, D, device=DEV, requires_grad=True), torch.randn(B, N, D, device=DEV, requires_grad=True)]

    def region(probe, qi, ki, wi, ix, q, kv):
        qi, ki, wi, ix, q, kv = _copies(probe, qi, ki, wi, ix, q, kv)
        out, lse, p_sum = sparse_mla_triton(q, kv, ix, D**-0.5, Dv, return_target=True)
        probe.append(StorageWeakRef(p_sum.untyped_storage()))
        kl, _ = sparse_indexer_kl_triton(qi, ki, wi, ix, q.detach(), kv.detach(), lse.detach(), D**-0.5, target=p_sum)
        return (out * out).sum() + kl

    _check(region, inputs)


def test_dense_attention_frees_its_inputs_under_checkpoint():
    torch.manual_seed(3)
    B, T, H, D, Dv = 1, 9, 2, 16, 8
    ds = _doc_start(B, [3, 6])
    inputs = [torch.randn(B, T, H, D, device=DEV, requires_grad=True), torch.randn(B, T, H, D, device=DEV, requires_grad=True),
              torch.randn(B, T, H, Dv, device=DEV, requires_grad=True)]

    def region(probe, q, k, v):
        q, k, v = _copies(probe, q, k, v)
        out, lse = dense_attention_triton(q, k, v, D**-0.5, ds)
        return (out * out).sum() + lse.sum().detach()

    _check(region, inputs)


def test_sparse_mla_frees_its_inputs_under_checkpoint():
    torch.manual_seed(4)
    B, T, N, H, D, Dv, K = 1, 5, 8, 2, 24, 16, 6
    idx = _causal_indices(B, T, K, N, seed=1)
    inputs = [torch.randn(B, T, H, D, device=DEV, requires_grad=True), torch.randn(B, N, D, device=DEV, requires_grad=True), idx]

    def region(probe, q, kv, ix):
        q, kv, ix = _copies(probe, q, kv, ix)
        out, lse = sparse_mla_triton(q, kv, ix, D**-0.5, Dv)
        return (out * out).sum() + lse.sum()

    _check(region, inputs)


class _ClosureKeeps(torch.autograd.Function):
    """What `_FusedKL` did before issue 32: the backward's input kept in a closure on ctx."""

    @staticmethod
    def forward(ctx, x):
        ctx.run = lambda: x.detach() * 2  # noqa: E731 (the closure is the point)
        return (x * x).sum()

    @staticmethod
    def backward(ctx, g):
        return g * ctx.run()


def test_probe_sees_a_closure_that_keeps_a_tensor():
    def region(probe, x):
        (x,) = _copies(probe, x)
        return _ClosureKeeps.apply(x)

    alive, _, _ = _run(region, [torch.randn(4, requires_grad=True)], True)
    assert alive == 1
    with pytest.raises(AssertionError, match="survived"):
        _check(region, [torch.randn(4, requires_grad=True)])


def test_dense_indexer_kl_at_a_query_offset_frees_its_inputs_under_checkpoint():
    torch.manual_seed(5)
    B, T, N, HI, DI, H, D = 1, 4, 9, 2, 8, 2, 8  # CP shape: rows at positions [5, 9) over 9 keys
    ds = _doc_start(B, [3, 6])
    from dsa_kernels import dense_attention_ref

    q_full, k = torch.randn(B, N, H, D, device=DEV), torch.randn(B, N, H, D, device=DEV)
    _, lse = dense_attention_ref(q_full, k, torch.randn(B, N, H, 4, device=DEV), D**-0.5, ds)
    inputs = [torch.randn(B, T, HI, DI, device=DEV, requires_grad=True), torch.randn(B, N, DI, device=DEV, requires_grad=True),
              torch.rand(B, T, HI, device=DEV, requires_grad=True), q_full[:, 5:], k, lse[:, 5:]]

    def region(probe, qi, ki, wi, qm, km, lse_m):
        qi, ki, wi, qm, km, lse_m = _copies(probe, qi, ki, wi, qm, km, lse_m)
        return dense_indexer_kl_triton(qi, ki, wi, qm, km, D**-0.5, ds, lse_main=lse_m, q_offset=5)[0]

    _check(region, inputs)
