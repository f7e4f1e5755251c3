"""Record the top-k selections of one forward and replay them when the same forward runs again.

Activation recompute runs a layer's forward a second time in the backward, on the same inputs and
weights: the indexer's scores and the select would give the same indices again (the select is exact
and deterministic), at the cost of the O(T^2) scores and the select a second time. A `TopkMemo`
keeps them instead: while its `recording` context is active, every `indexer_topk` call computes and
appends its indices ([B, T_q, k] int32: 8 KB per query at k = 2048) to the memo; while its
`replaying` context is active, the calls return the recorded indices in the same order, computing
nothing. The contexts are reusable (a second backward through a retained graph replays again).

Memory budget: the recorded indices of every memo alive at once (one per checkpointed layer, freed
with that layer's autograd graph) stay within `budget_bytes` (default `DEFAULT_BUDGET_BYTES`; the
planner counts the same bound, `dsa_train.plan.estimate`). A selection that would exceed it is not
kept: the recompute computes that one again. Layers run in the same order every step, so the same
layers reuse every step.

A replayed call returns `(indices, None)`: the scores are not kept (they would double the memory,
and the model uses only the indices). Each replayed call must match the recorded one (the shapes of
q, k, w, doc_start and the query positions, and k); a mismatch (a forward that does not repeat
itself) raises one clear error instead of attending over another call's keys.

The memo is the mechanism; `dsa_train.model.recompute.topk_reuse_contexts` wires it into
`torch.utils.checkpoint` (its `context_fn`: recording in the forward, replaying in the recompute).
"""

from __future__ import annotations

import contextvars
import weakref

import torch

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("dsa_topk_memo", default=None)
DEFAULT_BUDGET_BYTES = 1 << 30  # recorded indices alive at once, per process (1 GiB)
_LIVE = [0]  # bytes of indices recorded by memos still alive


def live_bytes() -> int:
    """Bytes of top-k indices held by the memos alive now (all layers' recorded selections)."""
    return _LIVE[0]


def _release(held: list) -> None:
    _LIVE[0] -= held[0]


def _signature(q, k, w, doc_start, topk, query_positions) -> tuple:
    pos = None if query_positions is None else tuple(query_positions.shape)
    return (tuple(q.shape), tuple(k.shape), tuple(w.shape), tuple(doc_start.shape), int(topk), pos, str(q.device))


class _Mode:
    """A reusable context manager that makes `memo` the active one in `mode`."""

    def __init__(self, memo: "TopkMemo", mode: str):
        self.memo, self.mode, self._tokens = memo, mode, []

    def __enter__(self):
        if self.mode == "replay":
            self.memo.position = 0
        self._tokens.append(_ACTIVE.set((self.memo, self.mode)))
        return self.memo

    def __exit__(self, *exc):
        _ACTIVE.reset(self._tokens.pop())
        return False


class TopkMemo:
    """The selections of one forward, in call order (module docstring)."""

    def __init__(self, budget_bytes: int | None = None):
        self.saved: list[tuple[tuple, torch.Tensor | None]] = []  # None: over the budget, not kept
        self.position = 0
        self.budget = DEFAULT_BUDGET_BYTES if budget_bytes is None else budget_bytes
        self.computed = 0  # selections computed (recording, or replaying one that was not kept)
        self.replayed = 0  # selections returned from the memo
        self._held = [0]
        weakref.finalize(self, _release, self._held)  # the bytes leave the live total with the memo

    def _keep(self, indices: torch.Tensor) -> bool:
        n = indices.numel() * indices.element_size()
        if _LIVE[0] + n > self.budget:
            return False
        _LIVE[0] += n
        self._held[0] += n
        return True

    def recording(self) -> _Mode:
        return _Mode(self, "record")

    def replaying(self) -> _Mode:
        return _Mode(self, "replay")

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.saved if t is not None)

    def _replay(self, signature: tuple) -> torch.Tensor | None:
        if self.position >= len(self.saved):
            raise RuntimeError(f"top-k reuse: the recomputed forward made more top-k selections than the forward "
                               f"({len(self.saved)} recorded); the forward must repeat itself under recompute "
                               "(set parallel.recompute=none to rule recompute out)")
        want, indices = self.saved[self.position]
        if want != signature:
            raise RuntimeError(f"top-k reuse: selection {self.position} of the recomputed forward has inputs "
                               f"{signature} but the forward's had {want} (q, k, w, doc_start shapes, k, positions, "
                               "device); the forward must repeat itself under recompute "
                               "(set parallel.recompute=none to rule recompute out)")
        self.position += 1
        self.replayed += 1
        return indices


def active() -> tuple[TopkMemo, str] | None:
    """(memo, "record" | "replay") of the innermost active context, or None."""
    return _ACTIVE.get()


def memoized(compute, q, k, w, doc_start, topk, query_positions):
    """compute() -> (indices, scores), through the active memo (if any)."""
    state = _ACTIVE.get()
    if state is None:
        return compute()
    memo, mode = state
    signature = _signature(q, k, w, doc_start, topk, query_positions)
    if mode == "replay":
        indices = memo._replay(signature)
        if indices is None:  # not kept (over the budget): computed again
            memo.replayed -= 1
            memo.computed += 1
            return compute()
        return indices, None
    indices, scores = compute()
    memo.saved.append((signature, indices if memo._keep(indices) else None))
    memo.computed += 1
    return indices, scores
