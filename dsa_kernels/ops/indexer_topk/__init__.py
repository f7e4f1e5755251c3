"""Lightning indexer scores (report eq. 1) and top-k token selection (eq. 2).

    I[t, s] = sum_j w[t, j] * ReLU(q_I[t, j] . k_I[s])      for doc_start[t] <= s <= t
    S_t     = top-k_s I[t, s]

Entry point `indexer_topk(q, k, w, doc_start, topk, chunk_size=None) -> (indices, scores)`:
  q         [B, T, H_I, D_I]  indexer queries (H_I = 64, D_I = 128 in the 671B model)
  k         [B, T, D_I]       the one indexer key head
  w         [B, T, H_I]       fp32 head weights, H_I^-1/2 * D_I^-1/2 folded in
  doc_start [B, T]            first position of each token's packed document
  indices   [B, T, topk] int32, -1 = empty slot (rows with fewer than topk valid keys);
  scores    [B, T, topk] fp32, sorted descending, -inf at empty slots. Ties go to the lower
  key index; non-finite scores are never selected. No gradient (selection only).

Scoring (`scoring=`): "bf16" (default; q_I / k_I as given, fp32 products: the reference), "fp8"
or "fp8_ue8m0" (e4m3 q_I / k_I with per-token scales, as DeepSeek-V3.2's FP8 inference scores;
`fp8.py`). The selection is made on those scores; nothing here has a gradient.

Files: `reference.py` (PyTorch, the specification), `fp8.py` (the FP8 scores' PyTorch forms),
`kernel.py` (Triton score and radix-select kernels, their launch plans and the chunked driver),
`pipeline.py` (the driver's chunk pipeline: each chunk's select on a side stream beside the next
chunk's scores, opt-in until measured on a GPU: `DSA_INDEXER_OVERLAP=1`),
`op.py` (the reference's top-k at query positions registered as one torch op,
`dsa_kernels::indexer_topk_at_positions`, with a fake implementation for the memory trace),
`specs.py` (the launches the compile report compiles at the 671B shapes), `composite.py` (the
select as torch.topk on composite int64 keys, and the fix-ties path), `repair.py` (torch.topk on
the scores and one Triton repair kernel: the contract with no host sync), `memo.py` (record / replay of the selections for activation recompute). No autograd
Function: selection has no gradient.
"""

from ..._triton_common import use_triton as _use_triton
from . import memo as _memo
from .fp8 import (SCORINGS, fp8_emulated, index_scores_fp8_block, index_scores_fp8_ref, quantize_index_inputs,
                  scoring_mode)
from .memo import TopkMemo
from .op import indexer_topk_at_positions_op
from .reference import (
    FP8_GROUP,
    gather_index_scores,
    index_scores_block,
    index_scores_ref,
    indexer_topk_at_positions_ref,
    indexer_topk_ref,
    quantize_fp8_groups,
    topk_from_scores,
)


def indexer_topk(q, k, w, doc_start, topk, chunk_size=None, query_positions=None, scoring="bf16"):
    """CUDA tensors (or DSA_KERNELS=triton) -> the Triton kernels; otherwise the reference
    (with an FP8 `scoring`: on q / k quantized and dequantized exactly, `fp8.fp8_emulated`).
    query_positions [Tq]: q and w hold only the queries at these global positions of the
    sequence that k and doc_start describe (a context-parallel rank's share); None: all of them.
    Inside a `TopkMemo` context (`memo.py`; activation recompute) the selection is recorded, or
    replayed without computing anything (then the scores are None)."""
    fp8, ue8m0 = scoring_mode(scoring)
    return _memo.memoized(lambda: _indexer_topk(q, k, w, doc_start, topk, chunk_size, query_positions, fp8, ue8m0),
                          q, k, w, doc_start, topk, query_positions)


def _indexer_topk(q, k, w, doc_start, topk, chunk_size, query_positions, fp8=False, ue8m0=False):
    if _use_triton(q, k, w):
        from .custom import indexer_topk as indexer_topk_op  # `indexer_topk_triton` as a custom op

        return indexer_topk_op(q, k, w, doc_start, topk, chunk_size or 0, query_positions, fp8, ue8m0)
    if fp8:  # inference's FP8 scores up to fp32 rounding order (`fp8.py`)
        q, k = fp8_emulated(q, ue8m0), fp8_emulated(k, ue8m0)
    if query_positions is not None:  # the chunked reference as one torch op (`op.py`: one fake
        # dispatch instead of thousands under the memory trace's FakeTensorMode)
        return indexer_topk_at_positions_op(q, k, w, doc_start, topk, query_positions, chunk_size or 0)
    return indexer_topk_ref(q, k, w, doc_start, topk, chunk_size)


__all__ = ["FP8_GROUP", "SCORINGS", "TopkMemo", "fp8_emulated", "gather_index_scores", "index_scores_block",
           "index_scores_fp8_block", "index_scores_fp8_ref", "index_scores_ref", "indexer_topk",
           "indexer_topk_at_positions_op", "indexer_topk_at_positions_ref", "indexer_topk_ref", "quantize_fp8_groups",
           "quantize_index_inputs", "scoring_mode", "topk_from_scores"]
