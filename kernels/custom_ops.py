"""The Triton kernels' entry points as torch custom ops with fake implementations: the memory trace
follows the code that runs on CUDA.

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

As in `chunk_ops`, real tensors call the launcher directly (not through torch's custom-op
dispatcher, which failed now and then in the full suite with a C++ `vector::reserve` error): what
runs on real CPU / CUDA tensors is unchanged; the op is entered only when an argument is a fake
tensor. `tests/test_custom_ops.py` checks each fake against the launcher's real outputs (Triton
interpreter, small shapes) and that a traced step saves what the kernel Functions save.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensor

from ._triton_common import _TRACE_CUDA, cuda_path_traced
from .chunk_ops import _WORKSPACE_LISTENERS, _signature

__all__ = ["OPS", "cuda_path_traced", "kernel_op", "trace_cuda_path"]

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
        op = torch.library.custom_op(qualname, mutates_args=())(fn)

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
        OPS[qualname] = op
        return call

    return deco


def _f32(x: torch.Tensor, *shape) -> torch.Tensor:
    return x.new_empty(shape, dtype=torch.float32)


# ----------------------------------------------------------------------------- sparse MLA
def _smla_fwd_fake(q, kv, indices, n_slots, scale, d_v):
    B, T, H, _ = q.shape
    return q.new_empty((B, T, H, d_v)), _f32(q, B, T, H)


@kernel_op("dsa_kernels::sparse_mla_fwd", fake=_smla_fwd_fake)
def sparse_mla_fwd(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, n_slots: torch.Tensor, scale: float,
                   d_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """out [B, T, H, d_v] (q's dtype), lse [B, T, H] fp32."""
    from .ops.sparse_mla.kernel import sparse_mla_fwd as launch

    return launch(q, kv, indices, n_slots, scale, d_v)


def _smla_bwd_fake(q, kv, indices, n_slots, out, lse, dout, dlse, scale, d_v):
    return torch.empty_like(q), torch.empty_like(kv)


def _smla_bwd_workspace(q, kv, indices, n_slots, out, lse, dout, dlse, scale, d_v):
    from .ops.sparse_mla.kernel import DELTA_CHUNK_ELEMS

    B, T, H, D = q.shape
    delta = _f32(q, B, T, H)  # rowsum(dO * O) - dlse
    prod = _f32(q, min(T, max(1, DELTA_CHUNK_ELEMS // max(B * H * out.shape[-1], 1))) * B * H * out.shape[-1])
    del prod
    acc = _f32(kv, *kv.shape)  # dkv's fp32 accumulator
    del delta, acc


@kernel_op("dsa_kernels::sparse_mla_bwd", fake=_smla_bwd_fake, workspace=_smla_bwd_workspace)
def sparse_mla_bwd(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, n_slots: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None, scale: float, d_v: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """dq (q's shape and dtype), dkv (kv's)."""
    from .ops.sparse_mla.kernel import sparse_mla_bwd as launch

    return launch(q, kv, indices, n_slots, out, lse, dout, dlse, scale, d_v)


# ----------------------------------------------------------------------------- dense attention (MHA form)
def _da_fwd_fake(q, k, v, doc_start, scale):
    B, T, H, _ = q.shape
    return q.new_empty((B, T, H, v.shape[-1])), _f32(q, B, T, H)


@kernel_op("dsa_kernels::dense_attention_fwd", fake=_da_fwd_fake)
def dense_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_start: torch.Tensor, scale: float
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k, v in the compute dtype (contiguous), doc_start int32 -> out [B, T, H, Dv] (q's dtype), lse fp32."""
    from .ops.dense_attention.kernel import plan_fwd

    B, T, H, _ = q.shape
    out = torch.empty(B, T, H, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(B, T, H, dtype=torch.float32, device=q.device)
    if B * T * H > 0:
        plan_fwd(q, k, v, doc_start, out, lse, scale).run()
    return out, lse


def _da_bwd_fake(q, k, v, out, lse, dout, doc_start, doc_end, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _da_bwd_workspace(q, k, v, out, lse, dout, doc_start, doc_end, scale):
    from .ops.dense_attention.kernel import DELTA_CHUNK_ELEMS

    B, T, H, Dv = out.shape
    delta = _f32(q, B, T, H)
    prod = _f32(q, min(T, max(1, DELTA_CHUNK_ELEMS // max(B * H * Dv, 1))) * B * H * Dv)
    del delta, prod


@kernel_op("dsa_kernels::dense_attention_bwd", fake=_da_bwd_fake, workspace=_da_bwd_workspace)
def dense_attention_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                        dout: torch.Tensor, doc_start: torch.Tensor, doc_end: torch.Tensor, scale: float
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv in q's / k's / v's shape and dtype (dout contiguous, in q's dtype)."""
    from dsa_kernels._triton_common import row_dot

    from .ops.dense_attention.kernel import DELTA_CHUNK_ELEMS
    from .ops.dense_attention.kernel import plan_bwd

    delta = row_dot(dout, out, DELTA_CHUNK_ELEMS)  # [B, T, H] = rowsum(dO * O), fp32
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if q.numel() > 0:
        for launch in plan_bwd(q, k, v, dout, lse, delta, doc_start, doc_end, dq, dk, dv, scale):
            launch.run()
    return dq, dk, dv


# ----------------------------------------------------------------------------- indexer KL
def _lse_fake(qm, km, ds, scale):
    B, T, H = qm.shape[:3]
    return _f32(qm, B, H, T)


@kernel_op("dsa_kernels::dense_kl_lse", fake=_lse_fake)
def dense_kl_lse(qm: torch.Tensor, km: torch.Tensor, ds: torch.Tensor, scale: float) -> torch.Tensor:
    """The dense KL's main-attention log-sum-exp pass -> [B, H, T] fp32 (log2 domain)."""
    from .ops.indexer_kl.kernel import plan_dense_lse

    B, T, H = qm.shape[:3]
    lse2 = torch.empty((B, H, T), dtype=torch.float32, device=qm.device)
    if B * T > 0:
        plan_dense_lse(qm, km, ds, lse2, scale).run()
    return lse2


def _dkl_stats_fake(qi, ki, wi, qm, km, ds, lse2, scale, q_offset):
    B, T = qi.shape[:2]
    return _f32(qi), _f32(qi), _f32(qi, B, T), _f32(qi, B, T)


def _dkl_stats_workspace(qi, ki, wi, qm, km, ds, lse2, scale, q_offset):
    B, T = qi.shape[:2]
    kl, klu = _f32(qi, B, T), _f32(qi, B, T)
    del kl, klu


@kernel_op("dsa_kernels::dense_kl_stats", fake=_dkl_stats_fake, workspace=_dkl_stats_workspace)
def dense_kl_stats(qi: torch.Tensor, ki: torch.Tensor, wi: torch.Tensor, qm: torch.Tensor, km: torch.Tensor,
                   ds: torch.Tensor, lse2: torch.Tensor, scale: float, q_offset: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The dense KL's statistics pass -> kl_sum, kl_uniform_sum (0-d fp32) and each row's indexer
    logsumexp and target mass (lse_i, p_sum [B, T] fp32)."""
    from .ops.indexer_kl.function import _dense_run

    B, T = qi.shape[:2]
    row_stats = (torch.empty((B, T), dtype=torch.float32, device=qi.device),
                 torch.empty((B, T), dtype=torch.float32, device=qi.device))
    kl, klu, _ = _dense_run(qi, ki, wi, qm, km, ds, lse2, scale, False, q_offset, row_stats)
    return kl, klu, *row_stats


def _grads_fake(qi, ki, wi, *rest):
    return _f32(qi, *qi.shape), _f32(ki, *ki.shape), _f32(wi, *wi.shape)


def _dkl_grads_workspace(qi, ki, wi, qm, km, ds, lse2, scale, q_offset, lse_i, p_sum):
    B, T = qi.shape[:2]
    kl, klu = _f32(qi, B, T), _f32(qi, B, T)
    del kl, klu


@kernel_op("dsa_kernels::dense_kl_grads", fake=_grads_fake, workspace=_dkl_grads_workspace)
def dense_kl_grads(qi: torch.Tensor, ki: torch.Tensor, wi: torch.Tensor, qm: torch.Tensor, km: torch.Tensor,
                   ds: torch.Tensor, lse2: torch.Tensor, scale: float, q_offset: int, lse_i: torch.Tensor,
                   p_sum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The dense KL's gradient pass -> dq_I, dk_I, dw (fp32, shapes of qi, ki, wi)."""
    from .ops.indexer_kl.function import _dense_run

    return _dense_run(qi, ki, wi, qm, km, ds, lse2, scale, True, q_offset, (lse_i, p_sum))[2]


def _skl_stats_fake(qi, ki, wi, idx, n_slots, qm, kvm, lse, scale):
    return _f32(qi), _f32(qi)


def _skl_workspace(qi, ki, wi, idx, n_slots, qm, kvm, lse, scale, *rest):
    from .ops.indexer_kl.kernel import TARGET_CHUNK_ELEMS

    B, T = qi.shape[:2]
    K = idx.shape[-1]
    kl, klu = _f32(qi, B, T), _f32(qi, B, T)
    if B * T > 0:
        p_sum = _f32(qi, B, max(1, min(T, TARGET_CHUNK_ELEMS // max(B * K, 1))), K)  # head-summed target
        del p_sum
    del kl, klu


@kernel_op("dsa_kernels::sparse_kl_stats", fake=_skl_stats_fake, workspace=_skl_workspace)
def sparse_kl_stats(qi: torch.Tensor, ki: torch.Tensor, wi: torch.Tensor, idx: torch.Tensor, n_slots: torch.Tensor,
                    qm: torch.Tensor, kvm: torch.Tensor, lse: torch.Tensor, scale: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The sparse KL's statistics pass -> kl_sum, kl_uniform_sum (0-d fp32)."""
    from .ops.indexer_kl.function import _sparse_run

    kl, klu, _ = _sparse_run(qi, ki, wi, idx, n_slots, qm, kvm, lse, scale, False)
    return kl, klu


@kernel_op("dsa_kernels::sparse_kl_grads", fake=_grads_fake, workspace=_skl_workspace)
def sparse_kl_grads(qi: torch.Tensor, ki: torch.Tensor, wi: torch.Tensor, idx: torch.Tensor, n_slots: torch.Tensor,
                    qm: torch.Tensor, kvm: torch.Tensor, lse: torch.Tensor, scale: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sparse KL's statistics and gradient passes -> dq_I, dk_I, dw (fp32, shapes of qi, ki, wi)."""
    from .ops.indexer_kl.function import _sparse_run

    return _sparse_run(qi, ki, wi, idx, n_slots, qm, kvm, lse, scale, True)[2]


# ----------------------------------------------------------------------------- indexer top-k
def _topk_fake(q, k, w, doc_start, topk, chunk_size, query_positions, fp8=False, ue8m0=False):
    B, Tq = q.shape[:2]
    return q.new_empty((B, Tq, topk), dtype=torch.int32), _f32(q, B, Tq, topk)


def _topk_workspace(q, k, w, doc_start, topk, chunk_size, query_positions, fp8=False, ue8m0=False):
    """One query chunk's [B, C, T] fp32 score block and the select's candidate buffers."""
    from .ops.indexer_topk.kernel import CANDIDATE_CAP, DEFAULT_SCORE_BUDGET

    B, Tq = q.shape[:2]
    T = k.shape[1]
    C = chunk_size or max(1, min(Tq, DEFAULT_SCORE_BUDGET // max(B * T, 1)))
    scores = _f32(q, B, C, T)
    cand = (q.new_empty((B, C, CANDIDATE_CAP), dtype=torch.int32), _f32(q, B, C, CANDIDATE_CAP))
    sel = (q.new_empty((B, C, topk), dtype=torch.int32), _f32(q, B, C, topk))
    del scores, cand, sel


@kernel_op("dsa_kernels::indexer_topk", fake=_topk_fake, workspace=_topk_workspace)
def indexer_topk(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, doc_start: torch.Tensor, topk: int,
                 chunk_size: int, query_positions: torch.Tensor | None, fp8: bool = False,
                 ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """indices [B, Tq, topk] int32, scores fp32 (chunk_size 0: the launcher's default; fp8 / ue8m0:
    the FP8 index scores of inference, `ops/indexer_topk/fp8.py`)."""
    from .ops.indexer_topk.kernel import indexer_topk_triton

    return indexer_topk_triton(q, k, w, doc_start, topk, chunk_size or None, query_positions=query_positions,
                               fp8=fp8, ue8m0=ue8m0)


# ----------------------------------------------------------------------------- library attention with lse
def _attn_lse_fake(q, k, v, scale, doc_start):
    B, T, H, _ = q.shape
    return q.new_empty((B, T, H, v.shape[-1])), _f32(q, B, T, H)


def _attn_lse_workspace(q, k, v, scale, doc_start):
    """The packed (flattened, contiguous) copy of v -- a view of kv_b_proj's output -- and the
    op's own output and lse before they are reshaped."""
    B, T, H, Dv = v.shape
    flat_v = v.new_empty((1, B * T, H, Dv))
    out = q.new_empty((1, B * T, H, Dv))
    lse = _f32(q, B, H, T)
    del flat_v, out, lse


@kernel_op("dsa_kernels::attention_lse", fake=_attn_lse_fake, workspace=_attn_lse_workspace)
def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, doc_start: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA: torch's memory-efficient attention over the packed documents (Triton if it raises)."""
    from .ops.dense_attention.library import _library_or_triton

    return _library_or_triton(q, k, v, scale, doc_start)
