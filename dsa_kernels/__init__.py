"""DSA ops, one folder per op under `ops/` (flash-linear-attention's `fla/ops/<op>/` layout):

    indexer_topk/     lightning-indexer scores + top-k selection (eqs. 1-2)
    sparse_mla/       sparse MLA attention over the selected keys, MQA form (eq. 2)
    indexer_kl/       dense (eq. 3) and sparse (eq. 4) indexer KL losses
    dense_attention/  dense causal attention with packed-document masks (MLA's dense mode)

Each folder has `reference.py` (the PyTorch specification), the Triton kernels with their
launch plans, the autograd Function where the op has a gradient, an entry point in its
`__init__.py` (shapes documented there) and a `specs.py` registering its launches at the 671B
shapes for `dsa-train kernels report` (`registry.py`, `compile_report.py`).

The directory is named as the package imports (`dsa_kernels`): a top-level `kernels/` directory
clashed with the PyPI package of that name (transformers imports `kernels` to probe for it, which
from a clone loaded this package a second time and re-registered its custom ops). The entry points exported here are the dispatchers the model
calls: CUDA tensors -> the Triton kernel (imported lazily, so importing `dsa_kernels` never
imports triton); CPU tensors -> the reference. DSA_KERNELS=triton forces Triton (on the CPU
together with TRITON_INTERPRET=1), DSA_KERNELS=ref forces the reference (`_triton_common`).
`*_ref` functions are the plain-PyTorch references every kernel is tested against.
"""

from .ops.dense_attention import dense_attention, dense_attention_ref
from .ops.indexer_kl import (
    dense_indexer_kl,
    dense_indexer_kl_ref,
    dense_mass_recall,
    sparse_indexer_kl,
    sparse_indexer_kl_ref,
)
from .ops.indexer_topk import gather_index_scores, indexer_topk, indexer_topk_ref
from .masking import doc_starts_from_cu_seqlens, doc_starts_from_position_ids
from .ops.sparse_mla import sparse_mla, sparse_mla_ref

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
