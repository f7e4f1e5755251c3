"""Indexer KL: the autograd Functions over the fused Triton kernels (`kernel.py`) and the Triton
entry points (same contracts as the references). The Functions keep what their backward reads only
through `save_for_backward` (tests/test_kernel_checkpointing.py): under non-reentrant activation
checkpointing (`parallel.recompute`) nothing of a layer's KL inputs outlives its forward."""

from __future__ import annotations

import torch

from ..._triton_common import check_indices, compute_dtype, kernel_input
from ..sparse_mla.kernel import slot_counts
from .kernel import (TARGET_CHUNK_ELEMS, dense_kl_buffers, dense_kl_inputs, plan_dense_kl, plan_sparse_kl,
                     plan_sparse_kl_target)

# the launchers below (`_dense_run`, `_sparse_run`, the lse pass) as custom ops: fake tensors (plan --trace) get
# the outputs' shapes; real ones call the launchers directly (`dsa_kernels.custom_ops`)
from ...custom_ops import dense_kl_grads, dense_kl_lse, dense_kl_stats, sparse_kl_grads, sparse_kl_stats


def _grads_out(grads, dkl, dtypes):
    return tuple((g * dkl).to(dt) for g, dt in zip(grads, dtypes))


class _SparseKL(torch.autograd.Function):
    """Eq. 4 on the Triton kernels. Forward returns (kl_sum, kl_uniform_sum) from the kernel's
    statistics pass only; backward runs the kernels again with their gradient pass (statistics,
    then dq_I / dk_I / dw) and scales the result by grad_output. No gradient tensor lives between
    forward and backward; the price is a second statistics pass. Every tensor the backward reads
    is kept through `save_for_backward` (none on `ctx` attributes or in closures), so non-reentrant
    activation checkpointing drops them after the forward and recomputes them for the backward."""

    @staticmethod
    def forward(ctx, q_idx, k_idx, w_idx, indices, q_main, kv_main, lse_main, scale):
        B, T = q_idx.shape[:2]
        # fp32 q/k on the compiled path -> bf16 (the target's dots would be TF32; `compute_dtype`)
        cdt = compute_dtype("sparse_indexer_kl", q_idx, k_idx, q_main, kv_main)
        qi, ki = kernel_input(q_idx.detach(), cdt), kernel_input(k_idx.detach(), cdt)
        wi = w_idx.detach().float().contiguous()
        idx = indices.to(torch.int32).contiguous()
        qm, kvm = kernel_input(q_main.detach(), cdt), kernel_input(kv_main.detach(), cdt)
        lse = lse_main.detach().float().contiguous()
        n_slots = slot_counts(idx) if B * T > 0 else idx.new_zeros((B, T))
        kl, klu = sparse_kl_stats(qi, ki, wi, idx, n_slots, qm, kvm, lse, scale)  # `_sparse_run`, a custom op
        ctx.need = any(ctx.needs_input_grad[:3])
        if ctx.need:
            ctx.save_for_backward(qi, ki, wi, idx, n_slots, qm, kvm, lse)
        ctx.scale = scale
        ctx.dtypes = (q_idx.dtype, k_idx.dtype, w_idx.dtype)
        ctx.mark_non_differentiable(klu)
        return kl, klu

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dkl, _dklu):
        if not ctx.need:
            return (None,) * 8
        grads = sparse_kl_grads(*ctx.saved_tensors, ctx.scale)
        return (*_grads_out(grads, dkl, ctx.dtypes), None, None, None, None, None)


def _sparse_run(qi, ki, wi, idx, n_slots, qm, kvm, lse, scale, need: bool):
    B, T, HI, DI = qi.shape
    K, n_keys, H, dev = idx.shape[-1], ki.shape[1], qm.shape[2], qi.device
    # tokens per launch pair: the [B, C, K] fp32 head-summed target scratch stays <= 256 MB
    chunk = max(1, min(T, TARGET_CHUNK_ELEMS // max(B * K, 1)))
    kl = torch.empty((B, T), dtype=torch.float32, device=dev)
    klu = torch.empty((B, T), dtype=torch.float32, device=dev)
    if need:
        dq = torch.empty((B, T, HI, DI), dtype=torch.float32, device=dev)
        dk = torch.zeros((B, n_keys, DI), dtype=torch.float32, device=dev)  # k_idx's rows
        dw = torch.empty((B, T, HI), dtype=torch.float32, device=dev)
    else:
        dq = dk = dw = kl
    p_sum = torch.empty((B, chunk, K), dtype=torch.float32, device=dev) if B * T > 0 else None
    for t0 in range(0, T if B > 0 else 0, chunk):
        c = min(chunk, T - t0)
        # Sigma_h P once per token (query resident, KV gathered once per head block), then the KL
        plan_sparse_kl_target(qm, kvm, idx, n_slots, lse, p_sum[:, :c], t0, scale).run()
        plan_sparse_kl(qi, ki, wi, idx, n_slots, p_sum[:, :c], t0, H, kl, klu, dq, dk, dw, need).run()
    return kl.sum(), klu.sum(), ((dq, dk, dw) if need else ())


class _DenseKL(torch.autograd.Function):
    """Eq. 3 on the Triton kernels: the statistics pass in forward (which also keeps each row's
    indexer logsumexp and target mass, [B, T] fp32 each), the gradient pass alone in backward (the
    main scores formed once in each), tensors kept only through `save_for_backward`. lse_main
    [B, T, H] (natural log) replaces the dense-lse kernel's pass; None runs that pass (in forward;
    its [B, H, T] table is saved, so backward never runs it again). Outputs: kl_sum, kl_uniform_sum
    and the row statistics (lse_i, p_sum). Given `row_stats` from an earlier forward on the same
    inputs (the recompute of an activation checkpoint), the statistics pass is skipped: the saved
    tensors are the same, the returned sums are zeros (a recompute's outputs are discarded)."""

    @staticmethod
    def forward(ctx, q_idx, k_idx, w_idx, q_main, k_main, doc_start, lse_main, scale, q_offset=0,
                lse_i_in=None, p_sum_in=None):
        B, T = q_idx.shape[:2]
        H = q_main.shape[2]
        # fp32 q/k on the compiled path -> bf16; lse_main -> its log2-domain [B, H, T] table (`dense_kl_inputs`)
        qi, ki, wi, qm, km, ds, lse2 = dense_kl_inputs(q_idx, k_idx, w_idx, q_main, k_main, doc_start, lse_main)
        if lse2 is None:
            lse2 = dense_kl_lse(qm, km, ds, scale)
        if lse_i_in is not None:  # recomputed: the row statistics are known, the sums are not needed
            row_stats = (lse_i_in.detach(), p_sum_in.detach())
            kl = torch.zeros((), dtype=torch.float32, device=q_idx.device)
            klu = torch.zeros_like(kl)
        else:
            kl, klu, *row_stats = dense_kl_stats(qi, ki, wi, qm, km, ds, lse2, scale, q_offset)  # `_dense_run`
        ctx.need = any(ctx.needs_input_grad[:3])
        if ctx.need:  # each row's indexer logsumexp and target mass: the backward needs no statistics pass
            ctx.save_for_backward(qi, ki, wi, qm, km, ds, lse2, *row_stats)
        ctx.scale, ctx.q_offset = scale, q_offset
        ctx.dtypes = (q_idx.dtype, k_idx.dtype, w_idx.dtype)
        lse_i, p_sum = row_stats[0].clone(), row_stats[1].clone()
        ctx.mark_non_differentiable(klu, lse_i, p_sum)
        return kl, klu, lse_i, p_sum

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dkl, _dklu, _dlse_i, _dp_sum):
        if not ctx.need:
            return (None,) * 11
        qi, ki, wi, qm, km, ds, lse2, lse_i, p_sum = ctx.saved_tensors
        grads = dense_kl_grads(qi, ki, wi, qm, km, ds, lse2, ctx.scale, ctx.q_offset, lse_i, p_sum)
        return (*_grads_out(grads, dkl, ctx.dtypes), None, None, None, None, None, None, None, None)


def _dense_run(qi, ki, wi, qm, km, ds, lse2, scale, need: bool, q_offset: int, row_stats):
    """need=False: the statistics pass (KL values; writes row_stats); need=True: the gradient pass
    alone, reading row_stats (the KL values it returns are then not computed: zeros)."""
    B, T = qi.shape[:2]
    kl, klu, (dq, dk, dw) = dense_kl_buffers(qi, ki.shape[1], need, zero=need)
    if B * T > 0:
        plan_dense_kl(qm, km, qi, ki, wi, ds, lse2, kl, klu, dq, dk, dw, scale, need, q_offset, row_stats,
                      stats=not need).run()
    return kl.sum(), klu.sum(), ((dq, dk, dw) if need else ())


def _stats(kl, klu, B, T):
    return {"kl": kl.detach(), "kl_uniform": klu.detach(), "queries": torch.tensor(float(B * T))}


def sparse_indexer_kl_triton(q_idx, k_idx, w_idx, indices, q_main, kv_main, lse_main, scale: float,
                             chunk_size: int | None = None):
    """Same contract as `sparse_indexer_kl_ref` (chunk_size accepted and ignored). The query
    rows (q_idx, w_idx, indices, q_main, lse_main: T of them) may be fewer than the key rows
    (k_idx, kv_main: N), as under context parallelism: a rank's queries over the gathered
    sequence; indices are key rows in [0, N). The gradient of k_idx has k_idx's shape."""
    B, T = q_idx.shape[:2]
    n_keys = k_idx.shape[1]
    if kv_main.shape[1] != n_keys or indices.shape[:2] != (B, T) or q_main.shape[:2] != (B, T):
        raise ValueError(f"sparse_indexer_kl: k_idx {tuple(k_idx.shape)} and kv_main {tuple(kv_main.shape)} must "
                         f"hold the same key rows, and indices {tuple(indices.shape)} / q_main "
                         f"{tuple(q_main.shape)} the query rows of q_idx {tuple(q_idx.shape)}; pass the "
                         f"gathered k_idx and kv_main together")
    check_indices(indices, n_keys, "sparse_indexer_kl")
    kl_sum, klu_sum = _SparseKL.apply(q_idx, k_idx, w_idx, indices, q_main, kv_main, lse_main, float(scale))
    return kl_sum, _stats(kl_sum, klu_sum, B, T)


def dense_indexer_kl_triton(q_idx, k_idx, w_idx, q_main, k_main, scale: float, doc_start,
                            chunk_size: int | None = None, lse_main=None, q_offset: int = 0, row_stats=None):
    """Same contract as `dense_indexer_kl_ref` (chunk_size accepted and ignored).
    k_main [B, N, H or 1, D] (MHA form or the shared MQA key). lse_main [B, T, H] (natural log,
    from dense_attention's forward) replaces the dense-lse kernel's pass when given.
    q_offset: the T query rows (q_idx, w_idx, q_main, lse_main) are at positions [q_offset,
    q_offset + T) of the N key rows (k_idx, k_main, doc_start [B, N]): a context-parallel rank's run
    of queries over the gathered sequence (then lse_main is required). k_idx's gradient has N rows.
    stats["row_stats"] = (lse_i, p_sum) [B, T] fp32: passed back as `row_stats` when the same call
    is recomputed (an activation checkpoint's backward), the statistics pass is not run again and the
    returned sums are zeros."""
    B, T = q_idx.shape[:2]
    N = k_idx.shape[1]
    shifted = q_offset != 0 or N != T
    if (k_main.shape[1] != N or q_main.shape[1] != T or doc_start.shape[-1] != N or q_offset < 0
            or q_offset + T > N or (shifted and lse_main is None)):
        raise ValueError(f"dense_indexer_kl: q_idx {tuple(q_idx.shape)} / q_main {tuple(q_main.shape)} must hold "
                         f"the query rows at positions [{q_offset}, {q_offset + T}) of the key rows of k_idx "
                         f"{tuple(k_idx.shape)}, k_main {tuple(k_main.shape)} and doc_start "
                         f"{tuple(doc_start.shape)}" + ("; queries at an offset need lse_main" if shifted else ""))
    from .fused import dense_indexer_kl_fused, dense_kl_impl

    if dense_kl_impl() != "split":  # DSA_DENSE_KL=fused(-keep): value and gradients in one pass (`fused.py`)
        return dense_indexer_kl_fused(q_idx, k_idx, w_idx, q_main, k_main, scale, doc_start, lse_main, q_offset,
                                      row_stats)
    lse_i, p_sum = row_stats if row_stats is not None else (None, None)
    kl_sum, klu_sum, lse_i, p_sum = _DenseKL.apply(q_idx, k_idx, w_idx, q_main, k_main, doc_start, lse_main,
                                                   float(scale), int(q_offset), lse_i, p_sum)
    return kl_sum, {**_stats(kl_sum, klu_sum, B, T), "row_stats": (lse_i, p_sum)}
