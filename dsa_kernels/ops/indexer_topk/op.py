"""Top-k at given query positions (context parallelism) as one torch op: `dsa_kernels::indexer_topk_at_positions`.

The op runs `indexer_topk_at_positions_ref` (the chunked reference, unchanged) on real tensors.
Under FakeTensorMode it returns empty outputs of the real shapes ([B, Tq, topk] int32 indices,
fp32 scores) without walking the chunks, and offers the reference's own per-chunk body
(`topk_in_window`) on its largest chunk -- `positions_chunk_size` queries against the whole key
row [0, T) -- to the memory trace as the op's transient working set (`dsa_kernels.chunk_ops`).
"""

from __future__ import annotations

import torch

from ...chunk_ops import chunk_loop_op
from .reference import indexer_topk_at_positions_ref, positions_chunk_size, topk_in_window


def _outputs(q, k, w, doc_start, topk, query_positions, chunk_size):
    B, Tq = q.shape[:2]
    return (q.new_empty((B, Tq, topk), dtype=torch.int32), q.new_empty((B, Tq, topk), dtype=torch.float32))


def _worst_chunk(q, k, w, doc_start, topk, query_positions, chunk_size):
    C = min(positions_chunk_size(q, k, chunk_size or None), q.shape[1])
    with torch.no_grad():
        topk_in_window(q[:, :C], k, w[:, :C], doc_start, query_positions[:C], 0, k.shape[1], topk)


@chunk_loop_op("dsa_kernels::indexer_topk_at_positions", fake=_outputs, worst_chunk=_worst_chunk)
def indexer_topk_at_positions_op(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, doc_start: torch.Tensor,
                                 topk: int, query_positions: torch.Tensor, chunk_size: int
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`indexer_topk_at_positions_ref` (chunk_size 0 = its default)."""
    return indexer_topk_at_positions_ref(q, k, w, doc_start, topk, query_positions, chunk_size or None)
