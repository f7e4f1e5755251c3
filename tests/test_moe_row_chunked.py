"""The dense / shared-expert MLP's row-chunked Function (`dsa_train.model.moe._RowChunkedMLP`): its
gradients equal autograd's on the plain expression; over several row blocks the weight gradients are
fp32 sums of the blocks' bf16 GEMMs, rounded once; with one block they are the block's GEMMs, with no
fp32 weight-sized accumulator allocated (the dense layer's backward working set at 671B: 3 x 528 MB).
Blocks: ROWS = 4 here, hidden 16, so the backward takes one block up to 4 + 12 x 16 / (9 x 2) = 14 rows
in bf16 (4 + 5 = 9 in fp32), ROWS-row blocks beyond."""

import pytest
import torch
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from dsa_train.model.moe import _RowChunkedMLP


def _inputs(rows: int, hidden: int, inter: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(rows * 7 + hidden)
    x = torch.randn(rows, hidden, generator=g).to(dtype).requires_grad_()
    ws = [(torch.randn(*shape, generator=g) / shape[1] ** 0.5).to(dtype).requires_grad_()
          for shape in ((inter, hidden), (inter, hidden), (hidden, inter))]
    dy = torch.randn(rows, hidden, generator=g).to(dtype)
    return x, ws, dy


def _plain(x, w_gate, w_up, w_down):
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


@pytest.mark.parametrize("rows", [0, 1, 5, 9, 10, 13])  # fp32: one block up to 9 rows, then 3 or 4 blocks
def test_row_blocks_match_autograd_fp32(rows, monkeypatch):
    monkeypatch.setattr(_RowChunkedMLP, "ROWS", 4)
    x, ws, dy = _inputs(rows, 16, 24, torch.float32)
    ref = torch.autograd.grad(_plain(x, *ws), [x, *ws], dy)
    got = torch.autograd.grad(_RowChunkedMLP.apply(x, *ws), [x, *ws], dy)
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


def _block_grads(x, ws, dy, rows_per_block):
    """The weight gradients as the Function forms them over blocks: fp32 sums of bf16 block GEMMs."""
    w_gate, w_up, w_down = ws
    sums = [torch.zeros(w.shape, dtype=torch.float32) for w in ws]
    for r0 in range(0, x.shape[0], rows_per_block):
        xr, dyr = x[r0:r0 + rows_per_block].detach(), dy[r0:r0 + rows_per_block]
        gate, up = F.linear(xr, w_gate.detach()), F.linear(xr, w_up.detach())
        act = F.silu(gate)
        d_prod = dyr @ w_down.detach()
        d_gate = torch.ops.aten.silu_backward(d_prod * up, gate)
        for i, g in enumerate((d_gate.t() @ xr, (d_prod * act).t() @ xr, dyr.t() @ (act * up))):
            sums[i] += g.float()
    return [s.to(x.dtype) for s in sums]


@pytest.mark.parametrize("rows, rows_per_block", [(6, 6), (14, 14), (15, 4), (30, 4)])
def test_bf16_weight_gradients_bitwise(rows, rows_per_block, monkeypatch):
    monkeypatch.setattr(_RowChunkedMLP, "ROWS", 4)
    assert _RowChunkedMLP.backward_rows_per_block(rows, 16, 2) == rows_per_block
    x, ws, dy = _inputs(rows, 16, 24, torch.bfloat16)
    got = torch.autograd.grad(_RowChunkedMLP.apply(x, *ws), ws, dy)
    for g, r in zip(got, _block_grads(x, ws, dy, rows_per_block)):
        assert g.dtype == torch.bfloat16 and torch.equal(g, r)


class _Allocations(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.fp32_shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage()._cdata for a in args if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else [out]:  # new fp32 storages (not in-place results)
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.untyped_storage()._cdata not in inputs:
                self.fp32_shapes.append(tuple(t.shape))
        return out


@pytest.mark.parametrize("rows, blocks", [(14, 1), (15, 4)])
def test_fp32_accumulators_only_with_several_blocks(rows, blocks, monkeypatch):
    """bf16 weights: one block allocates no fp32 tensor at all; several allocate the three weight-sized
    accumulators and no fp32 copy of a block's gradient (they are added in place)."""
    monkeypatch.setattr(_RowChunkedMLP, "ROWS", 4)
    assert -(-rows // _RowChunkedMLP.backward_rows_per_block(rows, 16, 2)) == blocks
    x, ws, dy = _inputs(rows, 16, 24, torch.bfloat16)
    y = _RowChunkedMLP.apply(x, *ws)
    with _Allocations() as seen:
        torch.autograd.grad(y, [x, *ws], dy)
    weight_shapes = sorted(tuple(w.shape) for w in ws)
    if blocks == 1:
        assert seen.fp32_shapes == []
    else:
        assert sorted(seen.fp32_shapes) == weight_shapes, seen.fp32_shapes


@pytest.mark.parametrize("rows, rows_per_block, hidden, inter", [
    (40, 4, 16, 96), (16, 4, 16, 96), (12, 64, 16, 96),
    (4096, 2048, 7168, 18432),  # 671B's dense MLP, 4K tokens per rank (the sparse recipe under CP 32)
])
def test_plan_bounds_the_traced_backward_working_set(rows, rows_per_block, hidden, inter, monkeypatch):
    """`dsa-train plan`'s MLP backward working set bounds what the trace measures for that backward
    (fake tensors, the trace's own counter), within 25%."""
    import types

    from torch._subclasses.fake_tensor import FakeTensorMode

    from dsa_train.model.config import DSAConfig
    from dsa_train.plan.estimate import mlp_backward_working_set
    from dsa_train.plan.trace import MemoryTrace

    monkeypatch.setattr(_RowChunkedMLP, "ROWS", rows_per_block)
    with FakeTensorMode():
        x = torch.empty(rows, hidden, dtype=torch.bfloat16, requires_grad=True)
        ws = [torch.empty(*s, dtype=torch.bfloat16, requires_grad=True)
              for s in ((inter, hidden), (inter, hidden), (hidden, inter))]
        y = _RowChunkedMLP.apply(x, *ws)
        dy = torch.empty_like(y)
        with MemoryTrace() as trace:
            torch.autograd.grad(y, [x, *ws], dy)
    c = DSAConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2, first_k_dense_replace=2,
                  n_routed_experts=0, n_shared_experts=0)
    planned = mlp_backward_working_set(c, types.SimpleNamespace(tensor=1), rows, 2, main_trains=True)
    assert trace.peak_total <= planned <= 1.25 * trace.peak_total, (trace.peak_total, planned)
