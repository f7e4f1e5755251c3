"""Dense causal attention with packed-document masks (MLA's dense mode, both forms).

Entry point `dense_attention(q, k, v, scale, doc_start, chunk_size=None) -> (out, lse)`:
  MHA form: q [B, T, H, 192], k [B, T, H, 192], v [B, T, H, 128]
  MQA form: q [B, T, H, 576], k [B, T, 1, 576], v [B, T, 1, 512]   (one key/value head)
  doc_start [B, T]: query t sees keys doc_start[t] <= s <= t (`doc_starts_from_cu_seqlens` /
                    `doc_starts_from_position_ids` build it)
  out [B, T, H, Dv] q's dtype; lse [B, T, H] fp32, natural log of the scaled logits' exp-sum
  (never differentiable: the dense KL reuses it as a constant)
Differentiable w.r.t. q, k, v.

Files: `reference.py` (PyTorch, chunked over queries, the specification), `function.py` (the
flash-style autograd Function in PyTorch: forward keeps out + lse, backward recomputes each
query chunk; what the CPU runs under autograd).
"""

from .function import DenseAttentionFunction, dense_attention_bwd_ref
from .reference import dense_attention_chunk, dense_attention_fwd_ref, dense_attention_logits, dense_attention_ref

# No Triton kernel for dense attention yet: the reference everywhere.
dense_attention = dense_attention_ref

__all__ = [
    "DenseAttentionFunction",
    "dense_attention",
    "dense_attention_bwd_ref",
    "dense_attention_chunk",
    "dense_attention_fwd_ref",
    "dense_attention_logits",
    "dense_attention_ref",
]
