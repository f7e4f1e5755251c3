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
from ...op_registry import f32_empty, kernel_op


def _grads_out(grads, dkl, dtypes):
    return tuple((g * dkl).to(dt) for g, dt in zip(grads, dtypes))


class _SparseKL(torch.autograd.Function):
    """Eq. 4 on the Triton kernels. Forward returns (kl_sum, kl_uniform_sum) from the kernel's
    statistics pass only; backward runs the KL kernel again with its gradient pass (statistics,
    then dq_I / dk_I / dw) and scales the result by grad_output. No gradient tensor lives between
    forward and backward; the price is a second statistics pass. Every tensor the backward reads
    is kept through `save_for_backward` (none on `ctx` attributes or in closures), so non-reentrant
    activation checkpointing drops them after the forward and recomputes them for the backward.

    The target Sigma_h P [B, T, K] fp32: given (`target`, from the sparse MLA forward: issue 31),
    the KL kernel reads it in both passes and it is what the backward keeps (8 KB per token at
    k = 2048) instead of the main q / kv / lse: no KV row is gathered and no main logit formed here.
    None (the separate-gather path): the target kernel forms it per token chunk, in the forward and
    again in the backward (`_sparse_run`)."""

    @staticmethod
    def forward(ctx, q_idx, k_idx, w_idx, indices, q_main, kv_main, lse_main, scale, target=None, heads=None):
        B, T = q_idx.shape[:2]
        # fp32 q/k on the compiled path -> bf16 (the target's dots would be TF32; `compute_dtype`)
        cdt = compute_dtype("sparse_indexer_kl", q_idx, k_idx, q_main, kv_main)
        qi, ki = kernel_input(q_idx.detach(), cdt), kernel_input(k_idx.detach(), cdt)
        wi = w_idx.detach().float().contiguous()
        idx = indices.to(torch.int32).contiguous()
        n_slots = slot_counts(idx) if B * T > 0 else idx.new_zeros((B, T))
        if target is not None:
            main = (target.detach().float().contiguous(),)
        else:
            main = (kernel_input(q_main.detach(), cdt), kernel_input(kv_main.detach(), cdt),
                    lse_main.detach().float().contiguous())
        H = heads or q_main.shape[2]  # the layer's heads (tensor parallelism: more than q_main holds)
        if target is not None:  # `_sparse_run` as a custom op
            kl, klu = sparse_kl_stats_target(qi, ki, wi, idx, n_slots, main[0], H, scale)
        else:
            kl, klu = sparse_kl_stats(qi, ki, wi, idx, n_slots, *main, scale)
        ctx.need = any(ctx.needs_input_grad[:3])
        if ctx.need:
            ctx.save_for_backward(qi, ki, wi, idx, n_slots, *main)
        ctx.scale, ctx.H = scale, H
        ctx.dtypes = (q_idx.dtype, k_idx.dtype, w_idx.dtype)
        ctx.mark_non_differentiable(klu)
        return kl, klu

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dkl, _dklu):
        if not ctx.need:
            return (None,) * 10
        qi, ki, wi, idx, n_slots, *main = ctx.saved_tensors
        if len(main) == 1:  # the attention's target
            grads = sparse_kl_grads_target(qi, ki, wi, idx, n_slots, main[0], ctx.H, ctx.scale)
        else:
            grads = sparse_kl_grads(qi, ki, wi, idx, n_slots, *main, ctx.scale)
        return (*_grads_out(grads, dkl, ctx.dtypes), None, None, None, None, None, None, None)


def _sparse_run(qi, ki, wi, idx, n_slots, main: tuple, H: int, scale, need: bool):
    """main: (p_sum,) the target [B, T, K] fp32 (Sigma_h P), or (qm, kvm, lse) to form it per chunk."""
    B, T, HI, DI = qi.shape
    K, n_keys, dev = idx.shape[-1], ki.shape[1], qi.device
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
    if len(main) == 1:  # the target given: one KL launch over every token
        if B * T > 0:
            plan_sparse_kl(qi, ki, wi, idx, n_slots, main[0], 0, H, kl, klu, dq, dk, dw, need).run()
        return kl.sum(), klu.sum(), ((dq, dk, dw) if need else ())
    qm, kvm, lse = main
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
                             chunk_size: int | None = None, target=None, heads: int | None = None):
    """Same contract as `sparse_indexer_kl_ref` (chunk_size accepted and ignored). The query
    rows (q_idx, w_idx, indices, q_main, lse_main: T of them) may be fewer than the key rows
    (k_idx, kv_main: N), as under context parallelism: a rank's queries over the gathered
    sequence; indices are key rows in [0, N). The gradient of k_idx has k_idx's shape.
    target [B, T, K] fp32: Sigma_h P per slot over all H = q_main.shape[2] heads, from the sparse
    MLA forward (`sparse_mla(..., return_target=True)`); then q_main is read only for H, and kv_main
    / lse_main not at all (no KV gather, no main logits). None: formed here (the separate gather).
    heads (with target only): the layer's H where q_main holds only this rank's heads (tensor
    parallelism; target then sums every rank's heads: `TensorParallelHeads.sum_heads`)."""
    B, T = q_idx.shape[:2]
    n_keys = k_idx.shape[1]
    if heads is not None and target is None:
        raise ValueError(f"sparse_indexer_kl: heads={heads} needs the target summed over that many heads "
                         f"(q_main holds {q_main.shape[2]}); without a target pass every head's q_main and lse_main")
    if heads is not None and heads < q_main.shape[2]:
        raise ValueError(f"sparse_indexer_kl: heads={heads} is fewer than the {q_main.shape[2]} heads q_main holds; "
                         f"pass the layer's head count over every rank, the heads the target sums (or no heads)")
    if target is not None and tuple(target.shape) != tuple(indices.shape):
        raise ValueError(f"sparse_indexer_kl: target {tuple(target.shape)} must be the indices' shape "
                         f"{tuple(indices.shape)} (Sigma_h P per slot, from sparse_mla(..., return_target=True))")
    if kv_main.shape[1] != n_keys or indices.shape[:2] != (B, T) or q_main.shape[:2] != (B, T):
        raise ValueError(f"sparse_indexer_kl: k_idx {tuple(k_idx.shape)} and kv_main {tuple(kv_main.shape)} must "
                         f"hold the same key rows, and indices {tuple(indices.shape)} / q_main "
                         f"{tuple(q_main.shape)} the query rows of q_idx {tuple(q_idx.shape)}; pass the "
                         f"gathered k_idx and kv_main together")
    check_indices(indices, n_keys, "sparse_indexer_kl")
    kl_sum, klu_sum = _SparseKL.apply(q_idx, k_idx, w_idx, indices, q_main, kv_main, lse_main, float(scale), target,
                                      heads)
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


# ----------------------------------------------------------------------------- indexer KL
def _lse_fake(qm, km, ds, scale):
    B, T, H = qm.shape[:3]
    return f32_empty(qm, B, H, T)


@kernel_op("dsa_kernels::dense_kl_lse", fake=_lse_fake)
def dense_kl_lse(qm: torch.Tensor, km: torch.Tensor, ds: torch.Tensor, scale: float) -> torch.Tensor:
    """The dense KL's main-attention log-sum-exp pass -> [B, H, T] fp32 (log2 domain)."""
    from .kernel import plan_dense_lse

    B, T, H = qm.shape[:3]
    lse2 = torch.empty((B, H, T), dtype=torch.float32, device=qm.device)
    if B * T > 0:
        plan_dense_lse(qm, km, ds, lse2, scale).run()
    return lse2


def _dkl_stats_fake(qi, ki, wi, qm, km, ds, lse2, scale, q_offset):
    B, T = qi.shape[:2]
    return f32_empty(qi), f32_empty(qi), f32_empty(qi, B, T), f32_empty(qi, B, T)


def _dkl_stats_workspace(qi, ki, wi, qm, km, ds, lse2, scale, q_offset):
    B, T = qi.shape[:2]
    kl, klu = f32_empty(qi, B, T), f32_empty(qi, B, T)
    del kl, klu


@kernel_op("dsa_kernels::dense_kl_stats", fake=_dkl_stats_fake, workspace=_dkl_stats_workspace)
def dense_kl_stats(qi: torch.Tensor, ki: torch.Tensor, wi: torch.Tensor, qm: torch.Tensor, km: torch.Tensor,
                   ds: torch.Tensor, lse2: torch.Tensor, scale: float, q_offset: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The dense KL's statistics pass -> kl_sum, kl_uniform_sum (0-d fp32) and each row's indexer
    logsumexp and target mass (lse_i, p_sum [B, T] fp32)."""
    B, T = qi.shape[:2]
    row_stats = (torch.empty((B, T), dtype=torch.float32, device=qi.device),
                 torch.empty((B, T), dtype=torch.float32, device=qi.device))
    kl, klu, _ = _dense_run(qi, ki, wi, qm, km, ds, lse2, scale, False, q_offset, row_stats)
    return kl, klu, *row_stats


def _grads_fake(qi, ki, wi, *rest):
    return f32_empty(qi, *qi.shape), f32_empty(ki, *ki.shape), f32_empty(wi, *wi.shape)


def _dkl_grads_workspace(qi, ki, wi, qm, km, ds, lse2, scale, q_offset, lse_i, p_sum):
    B, T = qi.shape[:2]
    kl, klu = f32_empty(qi, B, T), f32_empty(qi, B, T)
    del kl, klu


@kernel_op("dsa_kernels::dense_kl_grads", fake=_grads_fake, workspace=_dkl_grads_workspace)
def dense_kl_grads(qi: torch.Tensor, ki: torch.Tensor, wi: torch.Tensor, qm: torch.Tensor, km: torch.Tensor,
                   ds: torch.Tensor, lse2: torch.Tensor, scale: float, q_offset: int, lse_i: torch.Tensor,
                   p_sum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The dense KL's gradient pass -> dq_I, dk_I, dw (fp32, shapes of qi, ki, wi)."""
    return _dense_run(qi, ki, wi, qm, km, ds, lse2, scale, True, q_offset, (lse_i, p_sum))[2]


def _skl_stats_fake(qi, ki, wi, idx, n_slots, qm, kvm, lse, scale):
    return f32_empty(qi), f32_empty(qi)


def _skl_workspace(qi, ki, wi, idx, n_slots, qm, kvm, lse, scale, *rest):
    from .kernel import TARGET_CHUNK_ELEMS

    B, T = qi.shape[:2]
    K = idx.shape[-1]
    kl, klu = f32_empty(qi, B, T), f32_empty(qi, B, T)
    if B * T > 0:
        p_sum = f32_empty(qi, B, max(1, min(T, TARGET_CHUNK_ELEMS // max(B * K, 1))), K)  # head-summed target
        del p_sum
    del kl, klu


@kernel_op("dsa_kernels::sparse_kl_stats", fake=_skl_stats_fake, workspace=_skl_workspace)
def sparse_kl_stats(qi: torch.Tensor, ki: torch.Tensor, wi: torch.Tensor, idx: torch.Tensor, n_slots: torch.Tensor,
                    qm: torch.Tensor, kvm: torch.Tensor, lse: torch.Tensor, scale: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The sparse KL's statistics pass -> kl_sum, kl_uniform_sum (0-d fp32)."""
    kl, klu, _ = _sparse_run(qi, ki, wi, idx, n_slots, (qm, kvm, lse), qm.shape[2], scale, False)
    return kl, klu


@kernel_op("dsa_kernels::sparse_kl_grads", fake=_grads_fake, workspace=_skl_workspace)
def sparse_kl_grads(qi: torch.Tensor, ki: torch.Tensor, wi: torch.Tensor, idx: torch.Tensor, n_slots: torch.Tensor,
                    qm: torch.Tensor, kvm: torch.Tensor, lse: torch.Tensor, scale: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sparse KL's statistics and gradient passes -> dq_I, dk_I, dw (fp32, shapes of qi, ki, wi)."""
    return _sparse_run(qi, ki, wi, idx, n_slots, (qm, kvm, lse), qm.shape[2], scale, True)[2]




def _skl_target_stats_fake(qi, ki, wi, idx, n_slots, p_sum, H, scale):
    return f32_empty(qi), f32_empty(qi)


def _skl_target_workspace(qi, ki, wi, idx, n_slots, p_sum, H, scale):
    B, T = qi.shape[:2]
    kl, klu = f32_empty(qi, B, T), f32_empty(qi, B, T)
    del kl, klu


@kernel_op("dsa_kernels::sparse_kl_stats_target", fake=_skl_target_stats_fake, workspace=_skl_target_workspace)
def sparse_kl_stats_target(qi: torch.Tensor, ki: torch.Tensor, wi: torch.Tensor, idx: torch.Tensor,
                           n_slots: torch.Tensor, p_sum: torch.Tensor, H: int, scale: float
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The sparse KL's statistics pass on the attention's target p_sum (Sigma_h P per slot, from the
    sparse MLA forward) -> kl_sum, kl_uniform_sum (0-d fp32)."""
    kl, klu, _ = _sparse_run(qi, ki, wi, idx, n_slots, (p_sum,), H, scale, False)
    return kl, klu


@kernel_op("dsa_kernels::sparse_kl_grads_target", fake=_grads_fake, workspace=_skl_target_workspace)
def sparse_kl_grads_target(qi: torch.Tensor, ki: torch.Tensor, wi: torch.Tensor, idx: torch.Tensor,
                           n_slots: torch.Tensor, p_sum: torch.Tensor, H: int, scale: float
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sparse KL's gradient pass on the attention's target -> dq_I, dk_I, dw (fp32)."""
    return _sparse_run(qi, ki, wi, idx, n_slots, (p_sum,), H, scale, True)[2]
