"""The indexer top-k driver's chunk pipeline (issue 31, scores + select at 32K): chunk i's select
on a side stream while chunk i + 1's scores run on the caller's stream.

The score kernel is tensor-core bound and the select memory / latency bound, so the two can share
the GPU. `indexer_topk_triton` issues, on the host:

    score 0 | score 1, select 0 | score 2, select 1 | ... | select n-1 | caller waits for the side

- each score launch runs on the caller's (main) stream; an event recorded right after it (before
  the next chunk's scores are issued, `ChunkPipeline.scored`) is what the side stream waits on
  before that chunk's select (`ChunkPipeline.select`);
- the selects run on the side stream, each writing its rows straight into the call's outputs;
- a score block is held (a Python reference) until the select reading it is done: before block
  i + 2 is allocated, the main stream waits on the event after select i, then block i's reference is
  dropped (`ChunkPipeline.before_score`), so the caching allocator can hand the memory to the
  next main-stream allocation safely (everything after it on the main stream runs after the
  select). No `record_stream`, so nothing piles up while the host runs ahead: at most
  `LIVE_SCORE_BLOCKS` = 2 score blocks are alive, the one being scored and the one being selected;
- the host issues chunk i + 1's scores before chunk i's select (`lookahead` 1), so a select that
  reads the device (the fix-ties path's host sync, the autotuner's first-sight verify) does not
  keep the next scores from being queued;
- the caller's stream waits for the side stream before the outputs are returned (`finish`).

The autotuner (`dsa_kernels.autotune.pick`) synchronizes the device before it times anything, so
no timing runs while the other stream has work in flight (and it times only on a shape's first
sight).

The overlap is opt-in until a GPU has measured it (`DSA_INDEXER_OVERLAP=1` or `overlap=True`; see
`overlap_enabled`). With the overlap off (the default, `DSA_INDEXER_OVERLAP=0`, `overlap=False`) the same code runs with the side
stream = the caller's stream and no lookahead: score i, select i, score i + 1, ... with one score
block alive. The CPU (and the Triton interpreter) runs the same code: torch's CPU stream API
(`torch.cpu.Stream`, `record_event`, `wait_event`, `torch.cpu.stream`) does nothing. The kernels
and their inputs are the same either way, so the outputs are bitwise identical with the overlap on
and off (tests/test_indexer_topk_overlap.py; `correctness.indexer_topk.*` on a GPU).
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

from ..._triton_common import env_flag

OVERLAP_ENV = "DSA_INDEXER_OVERLAP"
LIVE_SCORE_BLOCKS = 2  # score blocks alive at once with the overlap on (1 without)


def overlap_enabled(overlap: bool | None = None) -> bool:
    """`overlap` when given, else `DSA_INDEXER_OVERLAP` (1, or 0: the default). Off by default until a
    GPU has measured it: no GPU has run two streams here, and a speed-up is the only reason to hold a
    second score block (gpu-check's speed.indexer_topk times the call both ways, correctness.indexer_topk
    requires bitwise equal outputs); a change like this is opt-in until then, as the Gluon kernels were."""
    if overlap is not None:
        return bool(overlap)
    return env_flag(OVERLAP_ENV, "0", "overlap the select with the next chunk's scores")


def live_score_blocks(n_chunks: int, overlap: bool | None = None) -> int:
    """Score blocks a call with `n_chunks` query chunks keeps alive at once."""
    return min(LIVE_SCORE_BLOCKS, max(n_chunks, 1)) if overlap_enabled(overlap) else 1


def chunk_windows(pos: np.ndarray, ds_at: np.ndarray, chunk: int) -> list[tuple[int, int, int, int]]:
    """Host-side plan of the query chunks: pos [Tq] the global query positions and ds_at [Tq] the
    key window start of each (the first document position, min over the batch), both host arrays
    (`host_values`) -> [(r0, r1, k0, k_end)]: local rows [r0, r1) over keys [k0, k_end). Reads
    no tensor (nothing is read inside the chunk loop)."""
    pos, ds_at = np.asarray(pos, dtype=np.int64), np.asarray(ds_at, dtype=np.int64)
    Tq = pos.shape[0]
    if Tq == 0:
        return []
    n = -(-Tq // chunk)
    hi = np.full(n * chunk, -1, dtype=np.int64)  # padded to whole chunks with values that lose the max / min
    lo = np.full(n * chunk, np.iinfo(np.int64).max, dtype=np.int64)
    hi[:Tq], lo[:Tq] = pos, ds_at
    hi, lo = hi.reshape(n, chunk).max(1) + 1, lo.reshape(n, chunk).min(1)
    return [(i * chunk, min(Tq, (i + 1) * chunk), int(k0), int(k1)) for i, (k0, k1) in enumerate(zip(lo, hi))]


class ChunkPipeline:
    """The two streams of one call on `device` (see the module doc). `overlap` False: the side
    stream is the caller's, no lookahead."""

    def __init__(self, device: torch.device, overlap: bool):
        self.mod = torch.get_device_module(device)
        self.overlap = overlap
        self.main = self.mod.current_stream(device)
        if not overlap:
            self.side = self.main
        elif device.type == "cpu":  # torch.cpu.Stream takes no device (and does nothing)
            self.side = self.mod.Stream()
        else:
            self.side = self.mod.Stream(device=device)
        self.lookahead = 1 if overlap else 0  # chunks scored before the previous one's select is issued
        self._selected: deque = deque()  # (score block, event after its select), oldest first

    def before_score(self) -> None:
        """Before a new score block is allocated: the blocks whose selects were issued are released
        once the main stream waits for those selects (stream order, no host sync)."""
        while self._selected:
            block, done = self._selected.popleft()
            self.main.wait_event(done)
            del block

    def scored(self):
        """Right after a score launch on the main stream: the event its select waits on."""
        return self.main.record_event()

    def select(self, block: torch.Tensor, scored, fn):
        """fn() (the select of `block`) on the side stream, after `scored` (the event recorded right
        after the block's scores: not after the next chunk's, issued since); the block is held
        until that select is done -> fn's result."""
        self.side.wait_event(scored)
        with self.mod.stream(self.side):
            out = fn()
        self._selected.append((block, self.side.record_event()))
        return out

    def finish(self) -> None:
        """The caller's stream waits for every select; the score blocks are released."""
        self.main.wait_stream(self.side)
        self._selected.clear()


def run_chunks(windows, score, select, overlap: bool, device: torch.device) -> None:
    """Drive the pipeline: score(window) -> block on the main stream, select(block, window) on the
    side stream, for each window in order (see the module doc for the issue order)."""
    pipe = ChunkPipeline(device, overlap)
    pending: deque = deque()  # (block, window, event after its scores): scored, select not issued yet

    def issue_select():
        block, w, scored = pending.popleft()
        pipe.select(block, scored, lambda: select(block, w))

    for win in windows:
        pipe.before_score()
        block = score(win)
        pending.append((block, win, pipe.scored()))
        del block
        while len(pending) > pipe.lookahead:
            issue_select()
    while pending:
        issue_select()
    pipe.finish()
