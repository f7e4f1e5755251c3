"""DSA ops: each a PyTorch reference (the specification) and, where written, a Triton kernel.

Import name `dsa_kernels` (the directory is `kernels/`; a top-level `kernels` package would clash
with the PyPI package of that name). The functions exported here are the dispatchers the model
calls; `*_ref` functions are the plain-PyTorch references every kernel is tested against.
"""

from .dense_attention import dense_attention_ref
from .indexer_kl import dense_indexer_kl_ref, dense_mass_recall, sparse_indexer_kl_ref
from .indexer_topk import gather_index_scores, indexer_topk_ref
from .masking import doc_starts_from_cu_seqlens, doc_starts_from_position_ids
from .sparse_mla import sparse_mla_ref

# Dispatchers. Until a Triton kernel is registered for an op, it runs its reference.
indexer_topk = indexer_topk_ref
sparse_mla = sparse_mla_ref
dense_attention = dense_attention_ref
dense_indexer_kl = dense_indexer_kl_ref
sparse_indexer_kl = sparse_indexer_kl_ref

__all__ = [
    "dense_attention",
    "dense_attention_ref",
    "dense_indexer_kl",
    "dense_indexer_kl_ref",
    "dense_mass_recall",
    "doc_starts_from_cu_seqlens",
    "doc_starts_from_position_ids",
    "gather_index_scores",
    "indexer_topk",
    "indexer_topk_ref",
    "sparse_indexer_kl",
    "sparse_indexer_kl_ref",
    "sparse_mla",
    "sparse_mla_ref",
]
