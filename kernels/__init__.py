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

# Dispatchers: CUDA tensors -> the Triton kernel (`*_triton.py`, imported lazily); CPU tensors ->
# the reference. DSA_KERNELS=triton forces Triton (on the CPU together with TRITON_INTERPRET=1),
# DSA_KERNELS=ref forces the reference (see `_triton_common.use_triton`). Same signatures as the
# references; `chunk_size` only tunes the references (the kernels do not need it).
from ._triton_common import use_triton as _use_triton


def indexer_topk(q, k, w, doc_start, topk, chunk_size=None):
    if _use_triton(q, k, w):
        from .indexer_topk_triton import indexer_topk_triton

        return indexer_topk_triton(q, k, w, doc_start, topk)
    return indexer_topk_ref(q, k, w, doc_start, topk, chunk_size)


def sparse_mla(q, kv, indices, scale, d_v, chunk_size=None):
    if _use_triton(q, kv, indices):
        from .sparse_mla_triton import sparse_mla_triton

        return sparse_mla_triton(q, kv, indices, scale, d_v)
    return sparse_mla_ref(q, kv, indices, scale, d_v, chunk_size)


def dense_indexer_kl(q_idx, k_idx, w_idx, q_main, k_main, scale, doc_start, chunk_size=None):
    if _use_triton(q_idx, k_idx, w_idx, q_main, k_main):
        from .indexer_kl_triton import dense_indexer_kl_triton

        return dense_indexer_kl_triton(q_idx, k_idx, w_idx, q_main, k_main, scale, doc_start)
    return dense_indexer_kl_ref(q_idx, k_idx, w_idx, q_main, k_main, scale, doc_start, chunk_size)


def sparse_indexer_kl(q_idx, k_idx, w_idx, indices, q_main, kv_main, lse_main, scale, chunk_size=None):
    if _use_triton(q_idx, k_idx, w_idx, q_main, kv_main):
        from .indexer_kl_triton import sparse_indexer_kl_triton

        return sparse_indexer_kl_triton(q_idx, k_idx, w_idx, indices, q_main, kv_main, lse_main, scale)
    return sparse_indexer_kl_ref(q_idx, k_idx, w_idx, indices, q_main, kv_main, lse_main, scale, chunk_size)


# No Triton kernel for dense attention yet: the reference everywhere.
dense_attention = dense_attention_ref

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
