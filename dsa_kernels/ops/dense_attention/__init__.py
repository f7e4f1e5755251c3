"""Dense causal attention with packed-document masks (MLA's dense mode, both forms).

Entry point `dense_attention(q, k, v, scale, doc_start, chunk_size=None) -> (out, lse)`:
  MHA form: q [B, T, H, 192], k [B, T, H, 192], v [B, T, H, 128]
  MQA form: q [B, T, H, 576], k [B, T, 1, 576], v [B, T, 1, 512]   (one key/value head)
  doc_start [B, T]: query t sees keys doc_start[t] <= s <= t (`doc_starts_from_cu_seqlens` /
                    `doc_starts_from_position_ids` build it)
  out [B, T, H, Dv] q's dtype; lse [B, T, H] fp32, natural log of the scaled logits' exp-sum
  (never differentiable: the dense KL reuses it as a constant)
Differentiable w.r.t. q, k, v.

CUDA tensors (or DSA_KERNELS=triton) in the MHA form -> the Triton kernels; the MQA form and CPU
tensors -> the PyTorch path.

Forward only, for a frozen model (the dense warm-up's main attention; `library.py`):
  dense_attention_lse(q, k, v, scale, doc_start) -> (out, lse): MHA form; on CUDA torch's
      memory-efficient attention (packed documents as cumulative sequence lengths, lse returned).
  mla_attention_rows(q, latent, k_rope, w_kv, scale, doc_start, q_offset, nope_dim): a context-
      parallel rank's run of queries over the gathered latent, up-projected block by block (MHA form).

Files: `reference.py` (PyTorch, chunked over queries, the specification), `chunked.py` (the
PyTorch path `dense_attention_ref`: the reference's forward, under autograd the flash-style
`DenseAttentionFunction` whose backward recomputes each query chunk), `kernel.py` (Triton
forward / backward kernels and their launch plans), `function.py` (the autograd Function over
them and `dense_attention_triton`), `specs.py` (the launches the compile report compiles at the
671B shapes).
"""

from ..._triton_common import use_triton as _use_triton
from .chunked import DenseAttentionFunction, dense_attention_bwd_ref, dense_attention_ref
from .function import dense_attention_triton, triton_supports
from .library import attention_lse as dense_attention_lse
from .library import mla_attention_rows
from .reference import dense_attention_chunk, dense_attention_fwd_ref, dense_attention_logits


def dense_attention(q, k, v, scale, doc_start, chunk_size=None):
    """Dispatcher (shapes above)."""
    if triton_supports(q, k, v) and _use_triton(q, k, v):
        return dense_attention_triton(q, k, v, scale, doc_start)
    return dense_attention_ref(q, k, v, scale, doc_start, chunk_size)

__all__ = [
    "DenseAttentionFunction",
    "dense_attention",
    "dense_attention_bwd_ref",
    "dense_attention_chunk",
    "dense_attention_fwd_ref",
    "dense_attention_lse",
    "dense_attention_logits",
    "dense_attention_ref",
    "dense_attention_triton",
    "mla_attention_rows",
]
