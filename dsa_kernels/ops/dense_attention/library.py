"""Dense attention forward with its log-sum-exp from a library kernel: the frozen main model's
attention in the dense warm-up (no gradient; the indexer's KL target reads the lse).

    out[t, h] = sum_{doc_start[t] <= s <= t} softmax_s(scale q[t, h] . k[s, h]) v[s, h]
    lse[t, h] = log sum_s exp(scale q[t, h] . k[s, h])            (natural log, fp32)

Entry points (forward only; call them under no_grad or on tensors that need no gradient):
  attention_lse(q, k, v, scale, doc_start) -> (out, lse)
      q, k [B, T, H, Dqk], v [B, T, H, Dv] (MHA form; Dv may differ from Dqk), doc_start [B, T].
  mla_attention_rows(q, latent, k_rope, w_kv, scale, doc_start, q_offset, nope_dim, key_block)
      The context-parallel shape: q [B, C, H, nope + rope] are the queries at global positions
      [q_offset, q_offset + C) (one contiguous run of a CP rank's tokens), over every visible key of
      the sequence, given as the gathered latent [B, N, R] and k_rope [B, N, rope]. The keys are
      up-projected here (w_kv = kv_b_proj.weight [H * (nope + v), R]) one block of `key_block`
      positions at a time, so no [B, N, H, *] tensor ever exists; each block's (out, lse) is merged
      into the running result (`merge`). The MHA form: ~82 KFLOP per (query, key) pair at the 671B
      dims against 278.5 in the absorbed form the sparse kernel runs.

Backends: on CUDA, torch's memory-efficient attention (`aten::_efficient_attention_forward`:
cumulative sequence lengths for packed documents, causal from the top left, different q/k and v
head dims, log-sum-exp returned); if the op raises (an unsupported build or shape) the Triton dense
attention kernel takes over (one warning). On the CPU (and under FakeTensorMode, through a custom
op with a fake implementation) the PyTorch reference. `DSA_DENSE_ATTENTION=triton|reference`
forces a backend on CUDA (gpu-check compares them).
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import torch

from ...chunk_ops import chunk_loop_op
from ...host_values import derived, segment_starts
from ...op_registry import f32_empty, kernel_op
from ..._triton_common import cuda_path_traced, kernel_mode
from .reference import dense_attention_fwd_ref

NEG_INF = float("-inf")
LOGITS_BUDGET = 1 << 24  # fp32 logits elements per block of the CPU path's math
_WARNED: set = set()
LAST_BACKEND = ["reference"]  # the backend `attention_lse` ran last (gpu-check reports it)


def backend_for(q: torch.Tensor) -> str:
    """"efficient" (CUDA: torch's memory-efficient attention), "triton" (CUDA, or the CPU under
    DSA_KERNELS=triton with the interpreter) or "reference". DSA_KERNELS=ref -> the reference."""
    forced = os.environ.get("DSA_DENSE_ATTENTION", "").strip().lower()
    if forced and forced not in ("triton", "reference", "efficient"):
        raise ValueError(f"DSA_DENSE_ATTENTION={forced!r}: use efficient, triton or reference (or unset it)")
    mode = kernel_mode()
    if mode == "ref" or forced == "reference":
        return "reference"
    if q.is_cuda or cuda_path_traced():  # or the memory trace of the CUDA path (`dsa_kernels.custom_ops`)
        return forced or "efficient"
    return "triton" if mode == "triton" else "reference"


# ----------------------------------------------------------------------------- merging partial results
def merge(out_a, lse_a, out_b, lse_b):
    """Two attentions of the same queries over disjoint key sets -> the attention over their union.
    out [.., H, Dv] fp32, lse [.., H] fp32 (-inf: no key)."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    wa = torch.exp(lse_a - safe).nan_to_num_(0.0)
    wb = torch.exp(lse_b - safe).nan_to_num_(0.0)
    return out_a * wa[..., None] + out_b * wb[..., None], lse


# ----------------------------------------------------------------------------- CUDA: memory-efficient attention
def doc_segments(doc_start: torch.Tensor, q_offset: int = 0, length: int | None = None) -> tuple[torch.Tensor, int]:
    """[B, T] document starts -> cu_seqlens int32 [n + 1] (on doc_start's device) of the documents
    of the flattened B * C rows of positions [a, a + C) (a = q_offset; C = length, default T - a;
    documents clipped at a), and the longest one's length. Planned from doc_start's host copy
    (`host_values`: one read per doc_start tensor, so per forward rather than per layer); cu is made
    on the device by `nonzero_static` at the size the host copy gives (no host read) and is kept
    with the copy, so the later layers of the forward reuse it."""
    B, T = doc_start.shape
    a = int(q_offset)
    C = T - a if length is None else int(length)

    def count(ds_host):  # -> (documents, the longest one's length)
        ds = np.maximum(ds_host[:, a:a + C] - a, 0)
        cu = np.append(segment_starts(ds), B * C)
        return cu.shape[0] - 1, int(np.diff(cu).max()) if B * C > 0 else 0

    n, max_len = derived(doc_start, ("segments", a, C), count)

    def device_cu(_):
        ds = (doc_start[:, a:a + C] - a).clamp_min(0)
        pos = torch.arange(C, device=doc_start.device)
        starts = torch.nonzero_static((ds == pos).flatten(), size=n).flatten()
        return torch.cat([starts, starts.new_full((1,), B * C)]).to(torch.int32)

    return derived(doc_start, ("segments_cu", a, C), device_cu), max_len


def first_document_rows(doc_start: torch.Tensor, q_offset: int, length: int) -> list[tuple[int, int]]:
    """Per batch row: (where the document holding position a = q_offset starts, how many of the
    queries [a, a + length) belong to it: a prefix), from doc_start's host copy (`host_values`)."""
    a = int(q_offset)

    def rows(ds_host):
        first = ds_host[:, a]
        n_rows = (ds_host[:, a:a + int(length)] == first[:, None]).sum(1)
        return [(int(s0), int(n)) for s0, n in zip(first, n_rows)]

    return derived(doc_start, ("first_document_rows", a, int(length)), rows)


def _pair(n: int, device) -> torch.Tensor:
    """int32 [0, n] on `device`, without a host-to-device copy (which waits for the stream)."""
    return torch.arange(2, dtype=torch.int32, device=device) * n


def _lse_rows(lse: torch.Tensor, cu: torch.Tensor, total: int) -> torch.Tensor:
    """The op's log-sum-exp -> [total, H]: per sequence [n, H, >= max_len] (indexed by the local
    row) or packed [1, H, >= total]; both layouts are accepted (they agree for one sequence)."""
    n = cu.numel() - 1
    if lse.shape[0] == 1:
        return lse[0, :, :total].transpose(0, 1)
    rows = torch.arange(total, device=lse.device)
    seq = torch.searchsorted(cu[1:].long(), rows, right=True)
    if lse.shape[0] != n:
        raise RuntimeError(f"_efficient_attention_forward returned lse {tuple(lse.shape)} for {n} sequences")
    return lse[seq, :, rows - cu[seq].long()]


def _efficient(q, k, v, scale, cu_q, cu_k, max_q, max_k, causal: bool):
    """q [1, Mq, H, D], k [1, Mk, H, D], v [1, Mk, H, Dv] packed rows -> out [Mq, H, Dv] (q's dtype),
    lse [Mq, H] fp32."""
    out, lse = torch.ops.aten._efficient_attention_forward(
        q, k, v, None, cu_q, cu_k, max_q, max_k, 0.0, 1 if causal else 0, True, scale=scale)[:2]
    return out[0], _lse_rows(lse.float(), cu_q, q.shape[1])


def _library_or_triton(q, k, v, scale, doc_start):
    """CUDA: memory-efficient attention over the packed documents; Triton if that op raises."""
    B, T, H, _ = q.shape
    if backend_for(q) == "efficient":
        try:
            cu, max_len = doc_segments(doc_start)
            flat = [x.reshape(1, B * T, H, x.shape[-1]).contiguous() for x in (q, k, v)]
            out, lse = _efficient(*flat, scale, cu, cu, max_len, max_len, True)
            LAST_BACKEND[0] = "efficient"
            return out.view(B, T, H, -1).to(q.dtype), lse.view(B, T, H)
        except RuntimeError as err:  # e.g. a build without the op, or a shape it does not take
            if "efficient" not in _WARNED:
                _WARNED.add("efficient")
                warnings.warn(f"dense attention: torch's memory-efficient attention failed ({err}); using the "
                              f"Triton kernel (set DSA_DENSE_ATTENTION=triton to skip the attempt)", stacklevel=3)
    from .function import dense_attention_triton

    LAST_BACKEND[0] = "triton"
    return dense_attention_triton(q, k, v, scale, doc_start)


def _attn_lse_fake(q, k, v, scale, doc_start):
    B, T, H, _ = q.shape
    return q.new_empty((B, T, H, v.shape[-1])), f32_empty(q, B, T, H)


def _attn_lse_workspace(q, k, v, scale, doc_start):
    """The packed (flattened, contiguous) copy of v -- a view of kv_b_proj's output -- and the
    op's own output and lse before they are reshaped."""
    B, T, H, Dv = v.shape
    flat_v = v.new_empty((1, B * T, H, Dv))
    out = q.new_empty((1, B * T, H, Dv))
    lse = f32_empty(q, B, H, T)
    del flat_v, out, lse


@kernel_op("dsa_kernels::attention_lse", fake=_attn_lse_fake, workspace=_attn_lse_workspace)
def attention_lse_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, doc_start: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA: torch's memory-efficient attention over the packed documents (Triton if it raises)."""
    return _library_or_triton(q, k, v, scale, doc_start)


def attention_lse(q, k, v, scale: float, doc_start):
    """Causal packed-document attention forward, MHA form (see the module doc) -> (out [B, T, H, Dv]
    in q's dtype, lse [B, T, H] fp32). No gradient."""
    from .function import triton_supports

    with torch.no_grad():
        if backend_for(q) == "reference" or not triton_supports(q, k, v):
            LAST_BACKEND[0] = "reference"
            return dense_attention_fwd_ref(q, k, v, scale, doc_start)
        return attention_lse_op(q, k, v, float(scale), doc_start)  # `_library_or_triton` as a custom op


# ----------------------------------------------------------------------------- context-parallel rows
def _up_project(latent, k_rope, w_kv, H, nope):
    """Keys and values of the MHA form from the latent: k [B, S, H, nope + rope], v [B, S, H, Dv]."""
    B, S, _ = latent.shape
    kv = torch.nn.functional.linear(latent, w_kv).view(B, S, H, -1)
    k_nope, v = kv[..., :nope], kv[..., nope:]
    k = torch.cat([k_nope, k_rope[:, :, None, :].expand(B, S, H, k_rope.shape[-1])], dim=-1)
    return k, v


def _block_math(q, k, v, scale, valid):
    """Reference block: q [B, C, H, D], k [B, S, H, D], v [B, S, H, Dv], valid [B, C, S] ->
    out [B, C, H, Dv] fp32, lse [B, C, H] fp32 (-inf where no key is valid)."""
    logits = torch.einsum("bchd,bshd->bhcs", q.float(), k.float()) * scale
    logits.masked_fill_(~valid[:, None], NEG_INF)
    lse = torch.logsumexp(logits, dim=-1)  # [B, H, C]
    probs = torch.exp(logits - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    out = torch.einsum("bhcs,bshd->bchd", probs, v.float())
    return out, lse.transpose(1, 2)


def _rows_reference(q, latent, k_rope, w_kv, scale, doc_start, q_offset, nope, key_block):
    B, C, H, _ = q.shape
    a, b = q_offset, q_offset + C
    dv = w_kv.shape[0] // H - nope
    out = torch.zeros(B, C, H, dv, dtype=torch.float32, device=q.device)
    lse = torch.full((B, C, H), NEG_INF, dtype=torch.float32, device=q.device)
    t = torch.arange(a, b, device=q.device)
    ds = doc_start[:, a:b]
    step = max(1, min(key_block, LOGITS_BUDGET // max(B * H * C, 1)))
    for k0 in range(0, b, step):
        k1 = min(b, k0 + step)
        k, v = _up_project(latent[:, k0:k1], k_rope[:, k0:k1], w_kv, H, nope)
        s = torch.arange(k0, k1, device=q.device)
        valid = (s[None, None, :] <= t[None, :, None]) & (s[None, None, :] >= ds[:, :, None])
        o_blk, l_blk = _block_math(q, k, v, scale, valid)
        out, lse = merge(out, lse, o_blk, l_blk)
    return out, lse


def _rows_efficient(q, latent, k_rope, w_kv, scale, doc_start, q_offset, nope, key_block):
    """CUDA: the diagonal block (keys [a, b), causal, documents clipped at a) as packed causal
    attention, then the keys before a, which only the run's first document can see (its queries
    see all of them: no mask), one key block at a time."""
    B, C, H, _ = q.shape
    a, b = q_offset, q_offset + C
    k, v = _up_project(latent[:, a:b], k_rope[:, a:b], w_kv, H, nope)
    cu, max_len = doc_segments(doc_start, a, C)
    flat = [x.reshape(1, B * C, H, x.shape[-1]).contiguous() for x in (q, k, v)]
    out, lse = _efficient(*flat, scale, cu, cu, max_len, max_len, True)
    out, lse = out.view(B, C, H, -1).float(), lse.view(B, C, H)
    del k, v, flat
    if a == 0:
        return out, lse
    for row, (s0, n) in enumerate(first_document_rows(doc_start, a, C)):
        if s0 >= a or n == 0:
            continue
        qr = q[row:row + 1, :n].contiguous()
        for k0 in range(s0, a, key_block):
            k1 = min(a, k0 + key_block)
            kb, vb = (x.contiguous() for x in _up_project(latent[row:row + 1, k0:k1], k_rope[row:row + 1, k0:k1], w_kv, H, nope))
            cu_q = _pair(n, q.device)  # [0, n]: made on the device (torch.tensor would copy from the host)
            cu_k = _pair(k1 - k0, q.device)
            o_blk, l_blk = _efficient(qr, kb, vb, scale, cu_q, cu_k, n, k1 - k0, False)
            out[row, :n], lse[row, :n] = merge(out[row, :n], lse[row, :n], o_blk.float(), l_blk)
    return out, lse


def _rows_outputs(q, latent, k_rope, w_kv, scale, doc_start, q_offset, nope_dim, key_block):
    B, C, H, _ = q.shape
    dv = w_kv.shape[0] // H - nope_dim
    return (q.new_empty((B, C, H, dv), dtype=torch.float32), q.new_empty((B, C, H), dtype=torch.float32))


def _rows_worst_block(q, latent, k_rope, w_kv, scale, doc_start, q_offset, nope_dim, key_block):
    """The working set of one key block: its up-projected keys and values (the CUDA path's
    transient; the fused library kernel forms no logits)."""
    C, H = q.shape[1], q.shape[2]
    S = min(key_block, q_offset + C)
    with torch.no_grad():
        _up_project(latent[:, :S], k_rope[:, :S], w_kv, H, nope_dim)


def _rows_up_projection_flops(q, latent, k_rope, w_kv, scale, doc_start, q_offset, nope_dim, key_block) -> int:
    """The matmul FLOPs of a call on the CUDA path (`_rows_efficient`) where each row is one
    document (its most): every key before the run's end up-projected once (kv_b: [R] -> [H (nope + v)]),
    2 B (q_offset + C) R H (nope + v); the attention itself is the library kernel's (not a matmul
    the trace counts)."""
    B, C = q.shape[0], q.shape[1]
    return 2 * B * (int(q_offset) + C) * latent.shape[-1] * w_kv.shape[0]


@chunk_loop_op("dsa_kernels::mla_attention_rows", fake=_rows_outputs, worst_chunk=_rows_worst_block,
               flops=_rows_up_projection_flops)
def mla_attention_rows_op(q: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor, w_kv: torch.Tensor, scale: float,
                          doc_start: torch.Tensor, q_offset: int, nope_dim: int, key_block: int
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """out [B, C, H, Dv] fp32, lse [B, C, H] fp32 (see `mla_attention_rows`)."""
    if backend_for(q) == "efficient":
        try:
            return _rows_efficient(q, latent, k_rope, w_kv, scale, doc_start, q_offset, nope_dim, key_block)
        except RuntimeError as err:
            if "efficient_rows" not in _WARNED:
                _WARNED.add("efficient_rows")
                warnings.warn(f"dense attention rows: torch's memory-efficient attention failed ({err}); using the "
                              f"PyTorch reference", stacklevel=2)
    return _rows_reference(q, latent, k_rope, w_kv, scale, doc_start, q_offset, nope_dim, key_block)


KEY_BLOCK = int(os.environ.get("DSA_CP_KEY_BLOCK", 8192))  # key positions up-projected at once (CP rows)


def mla_attention_rows(q, latent, k_rope, w_kv, scale: float, doc_start, q_offset: int, nope_dim: int,
                       key_block: int | None = None):
    """See the module doc -> (out [B, C, H, Dv] in q's dtype, lse [B, C, H] fp32). No gradient."""
    C, H = q.shape[1], q.shape[2]
    if latent.shape[1] < q_offset + C or k_rope.shape[1] < q_offset + C or w_kv.shape[0] % H:
        raise ValueError(f"mla_attention_rows: queries at [{q_offset}, {q_offset + C}) need latent / k_rope rows "
                         f"up to {q_offset + C} (got {tuple(latent.shape)}, {tuple(k_rope.shape)}) and w_kv rows a "
                         f"multiple of H = {H} (got {tuple(w_kv.shape)})")
    with torch.no_grad():
        out, lse = mla_attention_rows_op(q.contiguous(), latent, k_rope, w_kv, float(scale), doc_start,
                                         int(q_offset), int(nope_dim), int(key_block or KEY_BLOCK))
    return out.to(q.dtype), lse
