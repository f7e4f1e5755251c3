"""Sparse MLA launches at the 671B shapes, for the compile report: the exact launches the
launchers make there (their own planning functions on meta-device tensors)."""

from __future__ import annotations

import torch

from ...analysis import Work
from ...registry import SHAPES_671B, KernelCase, register
from ..._triton_common import target_capability
from .kernel import (_sparse_mla_bwd_interleaved_kernel, _sparse_mla_bwd_kernel, bwd_config_space,
                     deterministic_layout, fwd_config_space, is_gluon_config, plan_bwd, plan_bwd_config, plan_fwd)

# CP's dense-at-positions calls (model/mla.py `_dense_at_positions`): a chunk of queries over
# every key of the 128K sequence, index lists as wide as the sequence
DENSE_CHUNK_ELEMS = 1 << 24  # model/mla.py's default DENSE_CHUNK_ELEMS


def _tensors(T: int | None = None, K: int | None = None):
    s = SHAPES_671B
    B, N, H, D = s["B"], s["T"], s["H"], s["D"]
    T = N if T is None else T
    K = s["K"] if K is None else K
    meta = dict(device="meta")
    q = torch.empty(B, T, H, D, dtype=torch.bfloat16, **meta)
    kv = torch.empty(B, N, D, dtype=torch.bfloat16, **meta)
    idx = torch.empty(B, T, K, dtype=torch.int32, **meta)
    lse = torch.empty(B, T, H, dtype=torch.float32, **meta)
    return q, kv, idx, lse, D**-0.5, s["D_V"]


def _config(launch) -> str:
    a = launch.args
    keys = [k for k in a if k.startswith("BLOCK_") or k in ("EVEN_H", "VALUE_SPLIT", "SPLIT", "DETERMINISTIC", "DKV_CHUNK")
            or (k == "TARGET" and a[k])]
    stages = f" stages={launch.num_stages}" if launch.num_stages else ""
    return " ".join(f"{k}={a[k]}" for k in keys) + f" warps={launch.num_warps}{stages} grid={launch.grid}"


@register("sparse_mla_fwd")
def _fwd():
    q, kv, idx, lse, scale, d_v = _tensors()
    out = torch.empty(*q.shape[:3], d_v, dtype=q.dtype, device="meta")
    n_slots = torch.empty(idx.shape[:2], dtype=torch.int32, device="meta")
    # every config of the autotuning space for the target architecture (the gate checks each)
    space = fwd_config_space(target_capability(q))
    tuned = [plan_fwd(q, kv, idx, n_slots, out, lse, scale, d_v, cfg) for cfg in space]
    launch = tuned[0]
    T = SHAPES_671B["T"]  # CP dense-at-positions: DENSE_CHUNK_ELEMS // T queries over K = T slots
    q, kv, idx, lse, scale, d_v = _tensors(T=max(1, DENSE_CHUNK_ELEMS // T), K=T)
    out = torch.empty(*q.shape[:3], d_v, dtype=q.dtype, device="meta")
    n_slots = torch.empty(idx.shape[:2], dtype=torch.int32, device="meta")
    dense = plan_fwd(q, kv, idx, n_slots, out, lse, scale, d_v)
    extra = [KernelCase(f"autotune config {cfg[0]} " + _config(t), t, work=fwd_work(t))
             for cfg, t in zip(space[1:], tuned[1:])]
    # the sparse stage with the indexer loss: every Triton config also forms the KL's target (TARGET)
    q, kv, idx, lse, scale, d_v = _tensors()
    out = torch.empty(*q.shape[:3], d_v, dtype=q.dtype, device="meta")
    n_slots = torch.empty(idx.shape[:2], dtype=torch.int32, device="meta")
    p_sum = torch.empty(idx.shape, dtype=torch.float32, device="meta")
    targets = [(cfg, plan_fwd(q, kv, idx, n_slots, out, lse, scale, d_v, cfg, p_sum)) for cfg in space
               if not is_gluon_config(cfg)]
    extra += [KernelCase(f"with the KL target, config {cfg[0]} " + _config(t), t, work=fwd_work(t)) for cfg, t in targets]
    return [KernelCase(_config(launch), launch, work=fwd_work(launch)), *extra,
            KernelCase("CP dense-at-positions " + _config(dense), dense, work=fwd_work(dense))]


def bwd_launches(T: int | None = None, K: int | None = None) -> list[tuple[str, object]]:
    """(label, Launch) of the backward at T queries / K slots (default: the 671B top-k call):
    the atomic launch and the deterministic variant's first (chunk, window) launch."""
    q, kv, idx, lse, scale, d_v = _tensors(T, K)
    B, T, H, D = q.shape
    K = idx.shape[-1]
    dout = torch.empty(*q.shape[:3], d_v, dtype=q.dtype, device="meta")
    delta = torch.empty_like(lse)
    dq = torch.empty_like(q)
    dkv = torch.empty(kv.shape, dtype=torch.float32, device="meta")
    n_slots = torch.empty(idx.shape[:2], dtype=torch.int32, device="meta")
    atomic = plan_bwd(q, kv, idx, n_slots, dout, lse, delta, dq, dkv, scale, d_v)
    # the other configs of the autotuning space for the target architecture (the gate checks each)
    tuned = [(f"autotune config {cfg[0]} ", plan_bwd_config(cfg, q, kv, idx, n_slots, dout, lse, delta, dq, dkv,
                                                            scale, d_v))
             for cfg in bwd_config_space(target_capability(q))[1:]]
    # the deterministic option (under torch.use_deterministic_algorithms): (token chunk, slot
    # window) launches storing into the stage, dq accumulated in fp32 (sparse_mla_bwd_deterministic)
    n_hb, chunk, window = deterministic_layout(B, T, K, H, D, d_v)
    c, w = min(chunk, T), min(window, K)
    stage = torch.empty(n_hb, B, c, w, D, dtype=torch.float32, device="meta")
    dq_acc = torch.empty(B, c, H, D, dtype=torch.float32, device="meta")
    det = plan_bwd(q, kv, idx, n_slots, dout, lse, delta, dq_acc, None, scale, d_v, 0, c, 0, w, stage)
    return [("", atomic), *tuned, (f"deterministic (chunk {c} tokens, window {w} of {K} slots) ", det)]


@register("sparse_mla_bwd")
def _bwd():
    cases = [KernelCase(label + _config(launch), launch, work=_bwd_work_of(launch)) for label, launch in bwd_launches()]
    # CP dense-at-positions: DENSE_CHUNK_ELEMS // T queries over K = T = 128K slots (a real call;
    # the same compiled kernels at a different grid / window), the default and deterministic ones
    T = SHAPES_671B["T"]
    dense = [(label, launch) for label, launch in bwd_launches(T=max(1, DENSE_CHUNK_ELEMS // T), K=T)
             if not label.startswith("autotune")]
    cases += [KernelCase("CP dense-at-positions " + label + _config(launch), launch, work=_bwd_work_of(launch))
              for label, launch in dense]
    return cases


# ---- the analysis column (`dsa_kernels.analysis.Work`): per token, from each launch's block sizes ----

def _slots(launch) -> int:
    """Slots one row walks in this launch: the index list (the backward's window K_HI - K_LO)."""
    a = launch.args
    k = a["IDX"].shape[-1]
    if "K_HI" in a:
        k = a["K_HI"] - a["K_LO"]
    return k


def _pad(n: int, block: int) -> int:
    return -(-n // block) * block


def useful_fwd_flops(H: int, K: int, d_qk: int, d_v: int) -> float:
    """Sparse MLA forward: q.kv over d_qk (576) and p.v over d_v (512) per head and selected key."""
    return 2.0 * H * K * (d_qk + d_v)


def useful_bwd_flops(H: int, K: int, d_qk: int, d_v: int) -> float:
    """Sparse MLA backward as the anchors count it (TileLang's `per_token_flop`): S = q.kv recomputed
    (d_qk), dP = dO.v (d_v), dq = dS kv (d_qk), dkv = dS^T q (d_qk) + P^T dO (d_v)."""
    return 2.0 * H * K * (3 * d_qk + 2 * d_v)


def flashmla_fwd_anchor(H: int, K: int, d_qk: int, d_v: int, e: int = 2) -> dict:
    """FlashMLA's SM90 sparse prefill schedule: one CTA per (token, 64-head block), logits once,
    the value split across two warp groups sharing P, each selected KV row gathered once per block."""
    n_hb = -(-H // 64)
    return dict(name="FlashMLA sparse fwd", issued_flops=useful_fwd_flops(H, K, d_qk, d_v),
                read_bytes=n_hb * K * (d_qk * e + 4) + H * d_qk * e, gather_bytes=n_hb * K * d_qk * e)


def tilelang_bwd_anchor(H: int, K: int, d_qk: int, d_v: int, e: int = 2) -> dict:
    """TileLang's `examples/deepseek_v32/sparse_mla_bwd.py`: one CTA per (token, 64-head block), q
    and dO resident in shared memory, each selected row gathered once per block, dkv by fp32 atomics."""
    n_hb = -(-H // 64)
    return dict(name="TileLang sparse bwd", issued_flops=useful_bwd_flops(H, K, d_qk, d_v),
                read_bytes=n_hb * K * (d_qk * e + 4) + H * (d_qk + d_v) * e + H * 8, gather_bytes=n_hb * K * d_qk * e,
                write_bytes=n_hb * K * d_qk * 4 + H * d_qk * e)


def fwd_work(launch) -> Work:
    a = launch.args
    H, d_v, d_r = a["H"], a["D_V"], a["D_R"]
    e = a["Q"].element_size()
    K = _slots(launch)
    bh, bk, bdv, bdr, split = a["BLOCK_H"], a["BLOCK_K"], a["BLOCK_DV"], a["BLOCK_DR"], a["VALUE_SPLIT"]
    n_hb = -(-H // bh)
    # per program (token, head block[, value part]): the logits over the four latent quarters and
    # the rope part, then p.v over the program's quarters (all four, or two per part)
    issued = n_hb * split * 2.0 * bh * _pad(K, bk) * (bdv + bdr + bdv // split)
    # per program: every selected row's 512 + 64 columns once, its index; q once per program
    row_bytes = (d_v + d_r) * e + 4
    reads = n_hb * split * (K * row_bytes + 4) + split * H * (d_v + d_r) * e
    writes = H * d_v * e + H * 4
    gathered = n_hb * split * K * (d_v + d_r) * e
    useful = useful_fwd_flops(H, K, d_v + d_r, d_v)
    if a.get("TARGET"):
        # the KL target's pass (part 0 of each head block): the rows gathered again and their logits
        # recomputed with the final lse (useful: the target's q_h . kv[s], 2 H D per slot, as
        # indexer_kl's `sparse_target_work` counts it), one fp32 atomic add per slot and head block
        issued += n_hb * 2.0 * bh * _pad(K, bk) * (bdv + bdr)
        reads += n_hb * K * row_bytes
        gathered += n_hb * K * (d_v + d_r) * e
        writes += n_hb * K * a["P_SUM"].element_size()
        useful += 2.0 * H * K * (d_v + d_r)
    return Work(useful, issued, reads, writes, flashmla_fwd_anchor(H, K, d_v + d_r, d_v, e), gathered)


def _bwd_work_of(launch) -> Work:
    """The analysis of a backward launch, by its kernel."""
    from .gluon_bwd import _sparse_mla_bwd_gluon_kernel

    works = {_sparse_mla_bwd_kernel: bwd_work, _sparse_mla_bwd_interleaved_kernel: bwd_interleaved_work,
             _sparse_mla_bwd_gluon_kernel: bwd_gluon_work}
    return works[launch.kernel](launch)


def bwd_gluon_work(launch) -> Work:
    """The Gluon backward (`gluon_bwd._sparse_mla_bwd_gluon_kernel`), per token: per CTA (token, 64
    heads) q and dO read once (resident), lse / delta; per tile the selected rows gathered once and
    their indices; S (576 dims), dP (512), dq (576), dkv^T (576 + 512) over the tile's keys, each once
    (wgmma, no replication); dkv by fp32 atomics once per (head block, slot), dq written once."""
    a = launch.args
    H, d_v, d_r = a["H"], a["D_V"], a["D_R"]
    e = a["Q"].element_size()
    K = _slots(launch)
    bh, bk = a["BLOCK_H"], a["BLOCK_K"]
    n_hb, tiles = -(-H // bh), _pad(K, bk) // bk
    d_qk = d_v + d_r
    issued = n_hb * tiles * 2.0 * bh * bk * (3 * d_qk + 2 * d_v)
    reads = n_hb * (bh * (d_qk + d_v) * e + bh * 8 + tiles * bk * (d_qk * e + 4))
    writes = n_hb * K * d_qk * 4 + H * d_qk * e
    gathered = n_hb * tiles * bk * d_qk * e
    return Work(useful_bwd_flops(H, K, d_qk, d_v), issued, reads, writes,
                tilelang_bwd_anchor(H, K, d_qk, d_v, e), gathered)


def bwd_work(launch) -> Work:
    """The split backward (`_sparse_mla_bwd_kernel`), per token."""
    a = launch.args
    H, d_v, d_r = a["H"], a["D_V"], a["D_R"]
    e = a["Q"].element_size()
    K = _slots(launch)
    bh, bk, bdv, bdr, bd, split = (a["BLOCK_H"], a["BLOCK_K"], a["BLOCK_DV"], a["BLOCK_DR"], a["BLOCK_D"],
                                   a["SPLIT"])
    n_hb, dvs = -(-H // bh), bdv // split
    tiles = _pad(K, bk) // bk
    # per tile and program: S and dP over all latent dims (+ rope for S), dq and dkv over the own
    # columns (part 0 also the rope columns)
    per_tile = bh * bk * (2 * bdv + bdr) + bh * bk * dvs * 3
    rope_part = bh * bk * bdr * 2  # dq_r and dkv_r, part 0 only
    issued = n_hb * (split * tiles * per_tile + tiles * rope_part) * 2.0
    # per tile and program: the 64-channel q and dO pieces again (all latent dims), the gathered
    # rows for S / dP (all dims) and once more the own columns for dq / dkv; q / dO halves once
    tile_reads = (2 * bh * bdv + bk * (bdv + bdr) + bk * dvs) * e + bk * 4
    reads = n_hb * split * (tiles * tile_reads + bh * (2 * dvs + bdr) * e + bh * 8)
    writes = n_hb * (K * (d_v + d_r) * 4) + H * (d_v + d_r) * e  # fp32 atomics into dkv, dq once
    gathered = n_hb * split * tiles * bk * (bdv + bdr + dvs) * e
    return Work(useful_bwd_flops(H, K, d_v + d_r, d_v), issued, reads, writes,
                tilelang_bwd_anchor(H, K, d_v + d_r, d_v, e), gathered)


def bwd_interleaved_work(launch) -> Work:
    """The interleaved backward (`_sparse_mla_bwd_interleaved_kernel`), per token."""
    a = launch.args
    H, d_v, d_r = a["H"], a["D_V"], a["D_R"]
    e = a["Q"].element_size()
    K = _slots(launch)
    bh, bk, bdv, bdr = a["BLOCK_H"], a["BLOCK_K"], a["BLOCK_DV"], a["BLOCK_DR"]
    n_hb, tiles = -(-H // bh), _pad(K, bk) // bk
    # per tile and program (token, head block), q / dO rows interleaved (2 bh rows): [S | dP] over
    # every column piece (the dO rows' rope columns are zeros, multiplied all the same), dkv^T
    # from [dS | P] (2 bh deep) over every piece, dq^T = kv^T dS^T over every piece
    issued = n_hb * tiles * 2.0 * bk * (2 * bh * (bdv + bdr) * 2 + bh * (bdv + bdr))
    # per program: q and dO once (resident; the rope of q), lse / delta; per tile: the gathered rows
    # once and their indices
    reads = n_hb * (bh * (2 * bdv + bdr) * e + bh * 8 + tiles * (bk * (bdv + bdr) * e + bk * 4))
    writes = n_hb * (K * (d_v + d_r) * 4) + H * (d_v + d_r) * e  # fp32 atomics into dkv, dq once
    gathered = n_hb * tiles * bk * (bdv + bdr) * e
    return Work(useful_bwd_flops(H, K, d_v + d_r, d_v), issued, reads, writes,
                tilelang_bwd_anchor(H, K, d_v + d_r, d_v, e), gathered)
