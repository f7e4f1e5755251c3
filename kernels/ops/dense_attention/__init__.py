"""Dense causal attention with packed-document masks (MLA's dense mode, both forms).

Entry point `dense_attention(q, k, v, scale, doc_start, chunk_size=None) -> (out, lse)`:
  MHA form: q [B, T, H, 192], k [B, T, H, 192], v [B, T, H, 128]
  MQA form: q [B, T, H, 576], k [B, T, 1, 576], v [B, T, 1, 512]   (one key/value head)
  doc_start [B, T]: query t sees keys doc_start[t] <= s <= t
  out [B, T, H, Dv] q's dtype; lse [B, T, H] fp32

Files: `reference.py` (PyTorch, chunked over queries, the specification). The Triton kernels of
this op (forward/backward, with their `specs.py` registering `dense_attention_fwd` /
`dense_attention_bwd` for the compile report) belong to the dense-attention work of issue 12.
"""

from .reference import dense_attention_logits, dense_attention_ref

# No Triton kernel for dense attention yet: the reference everywhere.
dense_attention = dense_attention_ref

__all__ = ["dense_attention", "dense_attention_logits", "dense_attention_ref"]
