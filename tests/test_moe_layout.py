"""The MoE seam in one process: the MLP's row-chunked path is a field the layout sets (not a type
test), and `MoE.set_layout` is the one way a layout changes an MoE layer."""

import torch

from dsa_train.model import MoE, tiny_config
from dsa_train.model.moe import MLP, LocalDispatcher


def test_mlp_path_follows_row_chunked_field():
    torch.manual_seed(0)
    mlp = MLP(16, 32)
    x = torch.randn(5, 16, requires_grad=True)
    chunked = mlp(x)
    assert type(chunked.grad_fn).__name__.startswith("_RowChunkedMLP")
    mlp.row_chunked = False
    plain = mlp(x)
    assert not type(plain.grad_fn).__name__.startswith("_RowChunkedMLP")
    torch.testing.assert_close(chunked, plain)
    with torch.no_grad():  # no graph: the plain expression either way
        mlp.row_chunked = True
        assert mlp(x).grad_fn is None


class HalfDispatcher(LocalDispatcher):
    """Names the second half of the experts local (as expert-parallel rank 1 of 2)."""

    def __init__(self, n_experts: int):
        super().__init__(n_experts)
        self.local_experts = range(n_experts // 2, n_experts)


def test_set_layout_installs_dispatcher_and_keeps_its_experts():
    cfg = tiny_config(vocab_size=64, hidden_size=16, moe_intermediate_size=8, n_routed_experts=4)
    moe = MoE(cfg)
    assert isinstance(moe.dispatcher, LocalDispatcher) and not moe.grouped_gemm and moe.sum_loads is None
    summed = []
    dispatcher = HalfDispatcher(moe.n_experts)
    moe.set_layout(grouped_gemm=True, sum_loads=summed.append, dispatcher=dispatcher)
    assert moe.dispatcher is dispatcher and moe.grouped_gemm
    assert sorted(moe.experts.keys()) == ["2", "3"]
    moe.load_since_update += 1
    moe.update_bias(0.1)
    assert len(summed) == 2  # both load tensors summed over the (fake) replicas before the update


def test_set_layout_without_dispatcher_keeps_every_expert():
    cfg = tiny_config(vocab_size=64, hidden_size=16, moe_intermediate_size=8, n_routed_experts=4)
    moe = MoE(cfg)
    moe.set_layout(grouped_gemm=True)
    assert sorted(moe.experts.keys()) == ["0", "1", "2", "3"] and isinstance(moe.dispatcher, LocalDispatcher)


def test_stacked_weights_under_the_trace_view_only_what_shares_a_storage():
    """Under FakeTensorMode (`dsa-train plan --trace`) storages have no address (data_ptr is 0, with
    a warning torch calls "almost definitely a bug"): evenly strided views of one buffer are still a
    view, separate tensors of the same shape a stacked copy, and no warning is printed."""
    import warnings

    from torch._subclasses.fake_tensor import FakeTensorMode

    from dsa_train.model.grouped_experts import _strided_view

    with FakeTensorMode(), warnings.catch_warnings():
        warnings.simplefilter("error")
        flat = torch.empty(3, 4, 6)
        view = _strided_view([flat[i] for i in range(3)])
        assert view is not None and view.shape == (3, 4, 6) and view.untyped_storage()._cdata == flat.untyped_storage()._cdata
        assert _strided_view([torch.empty(4, 6) for _ in range(3)]) is None


def test_stacked_weights_view_a_flat_buffer_without_copy():
    """Experts laid out one after another in one flat buffer (as DeepSpeed's ZeRO-1/2 flattening
    leaves them: gate, up, down of expert 0, then expert 1, ...) give the grouped GEMM a view, not a
    copy; separate tensors give a stacked copy; values and gradients are torch.stack's either way."""
    from dsa_train.model.grouped_experts import stacked_weights

    torch.manual_seed(0)
    experts = [MLP(6, 4) for _ in range(3)]
    names = ("gate_proj", "up_proj", "down_proj")
    flat = torch.cat([getattr(e, n).weight.detach().reshape(-1) for e in experts for n in names])
    offset = 0
    for e in experts:
        for n in names:
            w = getattr(e, n).weight
            w.data = flat[offset : offset + w.numel()].view_as(w)
            offset += w.numel()
    probe = torch.randn(3, 4, 6)
    for layout in ("flat", "separate"):
        if layout == "separate":
            for e in experts:
                e.gate_proj.weight.data = e.gate_proj.weight.data.clone()
        weights = [e.gate_proj.weight for e in experts]
        stacked = stacked_weights(weights)
        assert (stacked.data_ptr() == weights[0].data_ptr()) == (layout == "flat"), layout
        assert torch.equal(stacked, torch.stack([w.detach() for w in weights]))
        (stacked * probe).sum().backward()
        for i, w in enumerate(weights):
            assert torch.equal(w.grad, probe[i]), layout
            w.grad = None
