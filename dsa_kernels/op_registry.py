"""The registry of the Triton kernels' entry points as torch custom ops with fake implementations
(`kernel_op`): the memory trace follows the code that runs on CUDA. Each op is registered next to
its launcher, in its op's folder (`ops/<op>/custom.py`, the indexer KL's in `ops/indexer_kl/function.py`,
the library attention's in `ops/dense_attention/library.py`); `dsa_kernels.custom_ops` imports them all.

`dsa-train plan --trace` (dsa_train/plan/trace.py) runs one training step under FakeTensorMode
on the CPU. Inside `trace_cuda_path()` the dispatchers take the path a CUDA run takes, whatever the
fake tensors' device: `use_triton` is true, the frozen warm-up's attention picks torch's
memory-efficient attention (`dense_attention.library.backend_for`), and the input policies are the
compiled path's (`interpreted()` is false: bf16 stays bf16). So the step runs the same autograd
Functions (`SparseMLAFunction`, `DenseAttentionTritonFunction`, `_DenseKL`, `_SparseKL`), which
allocate and `save_for_backward` the same tensors, under the same checkpoints and recomputes, as a
CUDA run. Only the kernel launches cannot run on fake tensors: each launcher below is a
`torch.library.custom_op` whose fake implementation returns empty outputs of the launcher's exact
shapes and dtypes, and offers the launcher's transient working set (what it allocates and frees
inside: dkv's fp32 accumulator, the KL's target scratch, a top-k score block, ...) to the trace's
workspace listener (`dsa_kernels.chunk_ops.workspace_listener`), which adds it as a transient DSA
buffer on top of what is live at the call.

    op (dsa_kernels::...)   launcher (real tensors)                     called from
    sparse_mla_fwd          sparse_mla.kernel.sparse_mla_fwd             SparseMLAFunction.forward
    sparse_mla_bwd          sparse_mla.kernel.sparse_mla_bwd             SparseMLAFunction.backward
    dense_attention_fwd     dense_attention.kernel.plan_fwd              DenseAttentionTritonFunction.forward
    dense_attention_bwd     dense_attention.kernel.plan_bwd              DenseAttentionTritonFunction.backward
    dense_kl_lse            indexer_kl.kernel.plan_dense_lse             _DenseKL.forward (no lse_main)
    dense_kl_stats          indexer_kl.function._dense_run (stats)       _DenseKL.forward
    dense_kl_grads          indexer_kl.function._dense_run (gradients)   _DenseKL.backward
    sparse_kl_stats         indexer_kl.function._sparse_run (stats)      _SparseKL.forward
    sparse_kl_grads         indexer_kl.function._sparse_run (gradients)  _SparseKL.backward
    indexer_topk            indexer_topk.kernel.indexer_topk_triton      indexer_topk (dispatcher)
    attention_lse           dense_attention.library._library_or_triton   attention_lse (frozen warm-up)

As in `chunk_ops`, real tensors call the launcher directly (no custom-op dispatch on the hot path;
the `vector::reserve` failures once seen in the full suite were a second import of these modules,
now fixed: tests/test_custom_ops.py): what runs on real CPU / CUDA tensors is unchanged; the op is entered only when an argument is a fake
tensor. `tests/test_custom_ops.py` checks each fake against the launcher's real outputs (Triton
interpreter, small shapes) and that a traced step saves what the kernel Functions save.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from ._triton_common import _TRACE_CUDA, cuda_path_traced
from .chunk_ops import fake_dispatched_op

__all__ = ["OPS", "cuda_path_traced", "f32_empty", "kernel_op", "trace_cuda_path"]

OPS: dict[str, object] = {}  # qualname -> the registered custom op


@contextlib.contextmanager
def trace_cuda_path():
    """Inside: the dispatchers take the CUDA path (Triton kernels, library attention) for any
    tensors; for the memory trace's fake tensors only (real CPU tensors would launch compiled
    Triton kernels on the host)."""
    token = _TRACE_CUDA.set(True)
    try:
        yield
    finally:
        _TRACE_CUDA.reset(token)


def kernel_op(qualname: str, fake: Callable, workspace: Callable | None = None):
    """Register the decorated launcher as the custom op `qualname`: `fake(*args)` gives its outputs'
    shapes and dtypes; `workspace(*args)`, run under the trace's nested counter, allocates the
    launcher's transient working set (see the module doc)."""

    def deco(fn):
        call = fake_dispatched_op(qualname, fake, workspace)(fn)
        OPS[qualname] = call.op
        return call

    return deco


def f32_empty(x: torch.Tensor, *shape) -> torch.Tensor:
    """An empty fp32 tensor of `shape` on x's device (fake under the trace)."""
    return x.new_empty(shape, dtype=torch.float32)
