"""Every Triton launcher as a torch custom op with a fake implementation, in one namespace, for the
memory trace (`dsa-train plan --trace`) and the tests. The registry and its rules are
`dsa_kernels.op_registry` (module doc there); each op is registered next to its launcher, in its
op's folder, and importing this module registers them all.

    op (dsa_kernels::...)     registered in                          launcher (real tensors)
    sparse_mla_fwd / _bwd     ops/sparse_mla/custom.py               sparse_mla.kernel
    dense_attention_fwd/_bwd  ops/dense_attention/custom.py          dense_attention.kernel
    dense_kl_lse/_stats/_grads, sparse_kl_stats/_grads(_target)
                              ops/indexer_kl/function.py             indexer_kl.kernel (_dense_run, _sparse_run)
    indexer_topk              ops/indexer_topk/custom.py             indexer_topk.kernel.indexer_topk_triton
    attention_lse             ops/dense_attention/library.py         library._library_or_triton
"""

from __future__ import annotations

from .op_registry import OPS, cuda_path_traced, f32_empty, kernel_op, trace_cuda_path
from .ops.dense_attention.custom import dense_attention_bwd, dense_attention_fwd
from .ops.dense_attention.library import attention_lse_op as attention_lse
from .ops.indexer_kl.function import (dense_kl_grads, dense_kl_lse, dense_kl_stats, sparse_kl_grads,
                                      sparse_kl_grads_target, sparse_kl_stats, sparse_kl_stats_target)
from .ops.indexer_topk.custom import indexer_topk
from .ops.sparse_mla.custom import sparse_mla_bwd, sparse_mla_fwd

__all__ = [
    "OPS", "attention_lse", "cuda_path_traced", "dense_attention_bwd", "dense_attention_fwd", "dense_kl_grads",
    "dense_kl_lse", "dense_kl_stats", "f32_empty", "indexer_topk", "kernel_op", "sparse_kl_grads",
    "sparse_kl_grads_target", "sparse_kl_stats", "sparse_kl_stats_target", "sparse_mla_bwd", "sparse_mla_fwd",
    "trace_cuda_path",
]
