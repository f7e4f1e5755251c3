"""Query-chunk loops as single torch ops (torch.library custom ops with a fake implementation).

The PyTorch paths of the DSA ops walk the query axis in chunks so that no [T, T] (or T x K x D)
block ever exists. Run for real that costs nothing extra; under FakeTensorMode
(`dsa-train plan --trace`, dsa_train/plan/trace.py) every op of every chunk is one fake
dispatch (~0.6 ms on a 2-core CPU), and at the 671B shapes under context parallelism the top-k
alone is ~2000 chunks per layer (> 200 s per layer). A loop registered here is one op:

    @chunk_loop_op("dsa_kernels::indexer_topk_at_positions", fake=outputs, worst_chunk=one_chunk)
    def indexer_topk_at_positions_op(q: Tensor, ..., chunk_size: int) -> tuple[Tensor, Tensor]:
        return indexer_topk_at_positions_ref(...)          # the one implementation, run for real

  * for real tensors the decorated function (the chunk loop itself, unchanged) is called directly,
    not through the op: through torch's custom-op dispatcher the real calls failed now and then in
    the full suite with a C++ `ValueError: vector::reserve` (37 tests of one fresh-clone run,
    none when run alone; the cause, found later, was a second import of these modules under the
    name `kernels` that re-registered the ops: tests/test_packaging.py), and the op is entered only
    when an argument is a fake tensor (no dispatch cost on real tensors);
  * under FakeTensorMode it runs `fake(*args)` (empty outputs with the real shapes and dtypes),
    then offers `worst_chunk(*args)` -- the loop's own code on its largest chunk (the most
    queries against the widest key window) -- to the workspace listeners, with a key of the
    arguments' shapes so that a listener runs it once per distinct call. The memory trace
    runs it under its counter and adds that chunk's peak as a transient DSA buffer on top of
    what is live at the call (the real loop holds one chunk's blocks at a time). Without a
    listener the body is not run.

Type annotations on the decorated function are torch.library's schema (Tensor, int, float,
`Tensor | None` ...). The decorated function must not be differentiable itself: call it inside
an autograd Function (forward / backward) or under no_grad.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensor

_WORKSPACE_LISTENERS: list[Callable[[tuple, Callable[[], object]], None]] = []
# qualname -> flops(*args): the matmul FLOPs an op issues inside (the memory trace's matmul count,
# `MemoryTrace.matmul_flops`, sees no aten op inside a custom op; those with matmuls declare them)
MATMUL_FLOPS: dict[str, Callable[..., int]] = {}


@contextlib.contextmanager
def workspace_listener(listener: Callable[[tuple, Callable[[], object]], None]):
    """While active, each chunk-loop op run under FakeTensorMode calls `listener(key, run_worst_chunk)`;
    `key` (the op's name, its tensors' shapes / dtypes and its other arguments) is the same for
    calls whose working set is the same."""
    _WORKSPACE_LISTENERS.append(listener)
    try:
        yield
    finally:
        _WORKSPACE_LISTENERS.remove(listener)


def _signature(a):
    if isinstance(a, torch.Tensor):
        return (tuple(a.shape), a.dtype, a.device.type)
    return a


def fake_dispatched_op(qualname: str, fake: Callable, workspace: Callable | None = None,
                       flops: Callable[..., int] | None = None):
    """Register the decorated function as the custom op `qualname`, entered only with fake tensors
    (real ones call the function itself): `fake(*args)` gives its outputs; `workspace(*args)`, if
    given, is offered to the trace's workspace listeners as the op's transient working set;
    `flops(*args)`, if given, is the matmul FLOPs of a call (`MATMUL_FLOPS`)."""

    def deco(fn):
        op = torch.library.custom_op(qualname, mutates_args=())(fn)
        if flops is not None:
            MATMUL_FLOPS[qualname] = flops

        @op.register_fake
        def _fake(*args, **kwargs):
            out = fake(*args, **kwargs)
            if workspace is not None and _WORKSPACE_LISTENERS:
                key = (qualname, *(_signature(a) for a in (*args, *kwargs.values())))
                for listener in list(_WORKSPACE_LISTENERS):
                    listener(key, lambda: workspace(*args, **kwargs))
            return out

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if any(isinstance(a, FakeTensor) for a in (*args, *kwargs.values())):
                return op(*args, **kwargs)
            return fn(*args, **kwargs)

        call.op = op
        return call

    return deco


def chunk_loop_op(qualname: str, fake: Callable, worst_chunk: Callable, flops: Callable[..., int] | None = None):
    """Register the decorated chunk loop as the custom op `qualname` (see the module doc): its
    working set is its worst chunk's; `flops`: its matmul FLOPs (`fake_dispatched_op`)."""
    return fake_dispatched_op(qualname, fake, worst_chunk, flops)
