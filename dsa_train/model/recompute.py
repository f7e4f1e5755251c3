"""Small elementwise blocks that keep only their inputs for backward.

`recomputed(fn, *inputs)` returns fn(*inputs); under autograd it saves only `inputs` and, in
backward, runs fn again on them with autograd and back-propagates through that: the values and
gradients are those of fn itself (the same operations run), but the intermediates fn would keep
(RMSNorm's fp32 copy of its input) live only during this block's backward.
A lighter `torch.utils.checkpoint` for one-output functions of tensors.

`topk_reuse_contexts` is the `context_fn` the checkpointed layers (`transformer._checkpointed`) pass
to `torch.utils.checkpoint`: the recompute reuses the forward's top-k indices instead of running the
indexer scores and the select again, and `recomputing()` tells the layer's code that it runs again
(what a forward records once, e.g. the MoE's expert loads, is not recorded twice).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

_recompute = threading.local()  # the autograd engine's thread runs the recompute (CUDA: its device thread)


def recomputing() -> bool:
    """True while a checkpointed layer's forward runs again in the backward (`topk_reuse_contexts`)."""
    return getattr(_recompute, "depth", 0) > 0


class _Recomputing:
    """`inner` (a context manager) entered, and `recomputing()` true, for a checkpointed layer's recompute."""

    def __init__(self, inner):
        self.inner = inner

    def __enter__(self):
        entered = self.inner.__enter__()
        _recompute.depth = getattr(_recompute, "depth", 0) + 1
        return entered

    def __exit__(self, *exc):
        _recompute.depth -= 1
        return self.inner.__exit__(*exc)


class _Recomputed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, *inputs):
        ctx.fn = fn
        ctx.save_for_backward(*inputs)
        return fn(*inputs)

    @staticmethod
    def backward(ctx, grad):
        needs = ctx.needs_input_grad[1:]
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_(need) for t, need in zip(ctx.saved_tensors, needs)]
            out = ctx.fn(*inputs)
            wanted = [t for t, need in zip(inputs, needs) if need]
            grads = iter(torch.autograd.grad(out, wanted, grad))
        return (None, *(next(grads) if need else None for need in needs))


def recomputed(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        return _Recomputed.apply(fn, *inputs)
    return fn(*inputs)


def topk_reuse_contexts():
    """`torch.utils.checkpoint`'s `context_fn` for a checkpointed layer: its forward records the
    top-k selections it makes (`dsa_kernels.indexer_topk`), and its recompute in the backward
    replays them instead of scoring and selecting again (the same inputs give the same indices).
    The indices ([B, T_loc, k] int32 per layer) live until the layer's backward has run, beside the
    layer input the checkpoint keeps, within the memo's budget (`memo.DEFAULT_BUDGET_BYTES` for all
    layers together; a layer over it selects again in its recompute); `plan/estimate.py` counts
    the same bound."""
    from dsa_kernels.ops.indexer_topk import TopkMemo

    memo = TopkMemo()
    return memo.recording(), _Recomputing(memo.replaying())
