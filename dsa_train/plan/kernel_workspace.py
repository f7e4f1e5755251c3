"""The DSA kernels' transient working set on the CUDA path, for the analytic plan (`dsa-train plan`).

    kernel_workspace(model_cfg, stage, sizes, seq_len, micro_batch, dtype, rank=0) -> dict

One layer's attention as the CUDA path runs it (`MLA.forward` / `MLA._forward_frozen`: the same
dispatchers with the same arguments, at this rank's shapes -- T_loc = T / CP local queries over the
CP-gathered keys, H / TP local heads, every head where the model gathers them, k, the indexer's
and MLA's head dims), run forward and backward under FakeTensorMode inside `trace_cuda_path()`.
Every kernel launcher is a custom op whose fake implementation offers its `workspace(*args)` (what
the launcher allocates and frees inside: the top-k's [B, C, T] fp32 score block and radix-select
buffers, the sparse MLA backward's fp32 dkv accumulator, the KL's target scratch, the CP attention
rows' up-projected key block, ...) to the workspace listeners (`dsa_kernels.chunk_ops`); here the
listener is `MemoryTrace.chunk_workspace`, the counter `dsa-train plan --trace` uses, so each op's
figure is the one the trace adds on top of what is live at the call. The plan adds the largest.

Nothing is allocated: fake tensors only (a few hundred fake dispatches, well under a second).
"""

from __future__ import annotations

import torch

from dsa_train.plan.trace import MemoryTrace


class _PerOpWorkspace(MemoryTrace):
    """The trace's counter, remembering each custom op's largest working set."""

    def __init__(self, count_indices: bool = True):
        super().__init__()
        self.by_op: dict[str, int] = {}
        self.count_indices = count_indices  # False: the top-k's indices are the plan's own term

    def _category_of_new(self, func) -> tuple[str, str]:
        category, site = super()._category_of_new(func)
        if not self.count_indices and category == "dsa_buffers" and site.endswith(" outputs"):
            return "activations", ""
        return category, site

    def chunk_workspace(self, key: tuple, run_worst_chunk) -> None:
        super().chunk_workspace(key, run_worst_chunk)
        self.by_op[key[0]] = max(self.by_op.get(key[0], 0), int(self._workspace_cache[key]))


def kernel_workspace(c, stage, sizes, seq_len: int, micro_batch: int, dtype: torch.dtype = torch.bfloat16,
                     rank: int = 0, cuda: bool = True) -> dict:
    """{"op": the custom op with the largest working set, "bytes": its bytes, "ops": {op: bytes} of
    every DSA custom op the layer dispatched (0: none offered)} -- see the module doc. `c` a
    DSAConfig, `stage` a `dsa_train.stage.Stage`, `sizes` the layout (`tensor`, `context`).
    `cuda` False: the same layer on the PyTorch (CPU) path, whose reference kernels allocate their
    query chunks' blocks plainly: "bytes" is then the most the layer's DSA buffers reach as the
    trace counts them (the chunk loops' working sets, what dsa_kernels/ allocates -- for a dense
    stage the dense attention reference's chunks; not the top-k's indices, the plan's per-layer
    term), "ops" each
    chunk-loop op's working set and that maximum as "dsa_kernels/ (PyTorch path)"."""
    import contextlib

    from dsa_kernels.chunk_ops import workspace_listener
    from dsa_kernels.custom_ops import trace_cuda_path
    from torch._subclasses.fake_tensor import FakeTensorMode

    counter = _PerOpWorkspace(count_indices=cuda)
    path = trace_cuda_path() if cuda else contextlib.nullcontext()
    with FakeTensorMode(), counter, workspace_listener(counter.chunk_workspace), path:
        _attention_layer(c, stage, sizes, seq_len, micro_batch, dtype, rank, cuda)
    ops = {name: counter.by_op.get(name, 0) for name in counter.kernel_ops}
    if not cuda:
        ops[CPU_PATH_OP] = counter.category_max().get("dsa_buffers", 0)
    op = max(ops, key=ops.get) if ops else ""
    return {"op": op, "bytes": ops.get(op, 0), "ops": ops}


CPU_PATH_OP = "dsa_kernels/ (PyTorch path)"  # kernel_workspace(cuda=False)'s layer total


def _attention_layer(c, stage, sizes, T: int, B: int, dtype, rank: int, cuda: bool = True) -> None:
    """One attention layer's DSA calls, forward and backward (see `kernel_workspace`)."""
    import dsa_kernels as K

    from dsa_train.model.mla import DENSE_CHUNK_ELEMS, cp_runs, visible_key_indices
    from dsa_train.parallel.context import local_positions

    cp, tp = sizes.context, sizes.tensor
    T_loc = T // cp
    H, Hl = c.num_attention_heads, c.num_attention_heads // tp
    HI, DI = c.index_n_heads, c.index_head_dim
    R, rope, nope, dv = c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim
    D = R + rope
    scale = c.softmax_scale
    main_trains = stage.kind.main_backward
    indexer_loss = stage.uses_indexer_loss
    f32 = torch.float32

    def x(*shape, dt=dtype, grad=False):
        return torch.empty(*shape, dtype=dt, requires_grad=grad)

    doc_start = torch.zeros(B, T, dtype=torch.long)
    positions = local_positions(T, cp, rank) if cp > 1 else None

    def indexer(n):  # q_I, k_I (gathered under CP), w_I of n local queries: the KL's trainable inputs
        return x(B, n, HI, DI, grad=True), x(B, T, DI, grad=True), x(B, n, HI, dt=f32, grad=True)

    losses = []
    if stage.sparse:  # MLA.forward, sparse: top-k, sparse MLA (MQA form), the sparse KL (eq. 4)
        qi, ki, wi = indexer(T_loc)
        with torch.no_grad():
            idx = K.indexer_topk(qi.detach(), ki.detach(), wi.detach(), doc_start, stage.topk_for(c),
                                 query_positions=positions, scoring=stage.index_scores)[0]
        q_abs, kv_all = x(B, T_loc, Hl, D, grad=main_trains), x(B, T, D, grad=main_trains)
        # the KL's target from the attention's forward: the local heads' sums (all-reduced under TP)
        out, lse, *p_sum = K.sparse_mla(q_abs, kv_all, idx, scale, R, return_target=indexer_loss)
        if main_trains:
            losses.append(out.float().sum())
        if indexer_loss and p_sum and p_sum[0] is not None:
            kl, _ = K.sparse_indexer_kl(qi, ki, wi, idx, q_abs.detach(), kv_all.detach(), lse.detach(), scale,
                                        target=p_sum[0], heads=H)
            losses.append(kl)
        elif indexer_loss:  # the chunked (CPU) path: the target from every head's q and lse, gathered
            kl, _ = K.sparse_indexer_kl(qi, ki, wi, idx, x(B, T_loc, H, D), kv_all.detach(), x(B, T_loc, H, dt=f32),
                                        scale)
            losses.append(kl)
    elif not main_trains:  # MLA._forward_frozen: the dense warm-up (library attention, the dense KL)
        from dsa_kernels.ops.dense_attention import dense_attention_lse, mla_attention_rows
        from dsa_kernels.ops.indexer_kl.function import dense_indexer_kl_triton

        if cp == 1:
            with torch.no_grad():
                dense_attention_lse(x(B, T, Hl, nope + rope), x(B, T, Hl, nope + rope), x(B, T, Hl, dv), scale,
                                    doc_start)
            if indexer_loss:  # as `MLA._frozen_kl`: the dispatcher picks the reference on the PyTorch path
                qi, ki, wi = indexer(T)
                kl, _ = K.dense_indexer_kl(qi, ki, wi, x(B, T, H, nope + rope), x(B, T, H, nope + rope), scale,
                                           doc_start, lse_main=x(B, T, H, dt=f32))
                losses.append(kl)
        else:
            handle = _CPHandle(cp, rank, positions)
            kv_all = x(B, T, D)
            latent_all, k_rope_all = kv_all.split([R, rope], dim=-1)
            w_kv = x(Hl * (nope + dv), R)
            q = x(B, T_loc, Hl, nope + rope)
            qi, ki, wi = indexer(T_loc)
            q_main = x(B, T_loc, H, D)
            for j0, a, n in cp_runs(handle, T):
                with torch.no_grad():
                    mla_attention_rows(q[:, j0:j0 + n], latent_all, k_rope_all, w_kv, scale, doc_start, a, nope)
                if indexer_loss and cuda:
                    kl, _ = dense_indexer_kl_triton(qi[:, j0:j0 + n], ki, wi[:, j0:j0 + n], q_main[:, j0:j0 + n],
                                                    kv_all[:, :, None, :], scale, doc_start,
                                                    lse_main=x(B, n, H, dt=f32), q_offset=a)
                    losses.append(kl)
            if indexer_loss and not cuda:  # as `MLA._frozen_kl` on the PyTorch path: every local query at once
                from dsa_train.model.mla import kl_at_positions

                kl, _ = kl_at_positions(scale, qi, ki, wi, q_main, x(B, T_loc, H, dt=f32), kv_all, doc_start, positions)
                losses.append(kl)
    elif cp == 1:  # MLA.forward, dense and trained: the MHA form's Triton attention, the dense KL (eq. 3)
        q, k = x(B, T, Hl, nope + rope, grad=True), x(B, T, Hl, nope + rope, grad=True)
        out, lse = K.dense_attention(q, k, x(B, T, Hl, dv, grad=True), scale, doc_start)
        losses.append(out.float().sum())
        if indexer_loss:
            qi, ki, wi = indexer(T)
            kl, _ = K.dense_indexer_kl(qi, ki, wi, x(B, T, H, nope + rope), x(B, T, H, nope + rope), scale, doc_start,
                                       lse_main=x(B, T, H, dt=f32))
            losses.append(kl)
    else:  # MLA._dense_at_positions: the sparse kernels over every visible key, one query chunk at a time
        C = min(T_loc, max(1, DENSE_CHUNK_ELEMS // max(T * B, 1)))
        idx = visible_key_indices(doc_start, positions[:C])
        kv_all = x(B, T, D, grad=True)
        out, lse = K.sparse_mla(x(B, C, Hl, D, grad=True), kv_all, idx, scale, R)
        losses.append(out.float().sum())
        if indexer_loss:
            qi, ki, wi = indexer(C)
            kl, _ = K.sparse_indexer_kl(qi, ki, wi, idx, x(B, C, H, D), kv_all.detach(), x(B, C, H, dt=f32), scale)
            losses.append(kl)
    if losses:
        sum(losses).backward()


class _CPHandle:
    """What `cp_runs` reads of a context-parallel handle."""

    def __init__(self, size: int, rank: int, positions: torch.Tensor):
        self.size, self.rank, self.positions = size, rank, positions
