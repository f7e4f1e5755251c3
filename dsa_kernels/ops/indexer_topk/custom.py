"""The indexer top-k launcher (`kernel.py`) as a custom op (`dsa_kernels.op_registry`: fake outputs
for `dsa-train plan --trace`; real tensors call the launcher directly)."""

from __future__ import annotations

import torch

from ...op_registry import f32_empty, kernel_op


# ----------------------------------------------------------------------------- indexer top-k
def _topk_fake(q, k, w, doc_start, topk, chunk_size, query_positions, fp8=False, ue8m0=False):
    B, Tq = q.shape[:2]
    return q.new_empty((B, Tq, topk), dtype=torch.int32), f32_empty(q, B, Tq, topk)


def _topk_workspace(q, k, w, doc_start, topk, chunk_size, query_positions, fp8=False, ue8m0=False):
    """What `indexer_topk_triton` keeps alive besides its outputs, at the largest chunk: the query
    chunks' [B, C, T] fp32 score blocks (two with the overlap on and more than one chunk: the one
    being selected and the next one being scored, `pipeline.live_score_blocks`), the radix select's
    candidate buffers, its prefilled selection and the stable sort's order, (B > 1 with several
    chunks: the outputs' row slices are strided) a contiguous copy of the selection, and with FP8
    scoring the e4m3 q_I / k_I and their scales."""
    from .kernel import CANDIDATE_CAP, DEFAULT_SCORE_BUDGET
    from .pipeline import live_score_blocks

    B, Tq = q.shape[:2]
    T = k.shape[1]
    C = chunk_size or max(1, min(Tq, DEFAULT_SCORE_BUDGET // max(B * T, 1)))
    n_chunks = -(-Tq // C)
    scores = [f32_empty(q, B, C, T) for _ in range(live_score_blocks(n_chunks))]
    cand = (q.new_empty((B, C, CANDIDATE_CAP), dtype=torch.int32), f32_empty(q, B, C, CANDIDATE_CAP))
    sel = (q.new_empty((B, C, topk), dtype=torch.int32), f32_empty(q, B, C, topk),
           q.new_empty((B, C, topk), dtype=torch.int64))
    copy = (q.new_empty((B, C, topk), dtype=torch.int32), f32_empty(q, B, C, topk)) if B > 1 and n_chunks > 1 else ()
    # FP8 scoring: q_I / k_I in e4m3 and their scales (`quant.quantize_rows_triton`), alive through the call
    G = -(-q.shape[-1] // 128)
    quant = (q.new_empty(q.shape, dtype=torch.float8_e4m3fn), f32_empty(q, *q.shape[:-1], G),
             k.new_empty(k.shape, dtype=torch.float8_e4m3fn), f32_empty(k, *k.shape[:-1], G)) if fp8 else ()
    del scores, cand, sel, copy, quant


@kernel_op("dsa_kernels::indexer_topk", fake=_topk_fake, workspace=_topk_workspace)
def indexer_topk(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, doc_start: torch.Tensor, topk: int,
                 chunk_size: int, query_positions: torch.Tensor | None, fp8: bool = False,
                 ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """indices [B, Tq, topk] int32, scores fp32 (chunk_size 0: the launcher's default; fp8 / ue8m0:
    the FP8 index scores of inference, `ops/indexer_topk/fp8.py`)."""
    from .kernel import indexer_topk_triton

    return indexer_topk_triton(q, k, w, doc_start, topk, chunk_size or None, query_positions=query_positions,
                               fp8=fp8, ue8m0=ue8m0)
