"""Host copies of small index tensors, read from the device once per tensor, not once per layer.

The kernels' host code needs a few values of its index inputs to plan a call: the indexer's
query chunks and key windows need the document starts (`doc_start` [B, T]) and, under context
parallelism, the query positions; the library attention needs the packed documents' boundaries
(cu_seqlens) and the longest one. On a GPU each such read waits for the device (a host sync).
The model hands every layer the same `doc_start` (and the same CP positions), so a forward with
L layers -- and the recompute forward after it -- would read the same values L times or more.

`host_values(t)` reads `t` once and keeps the copy for as long as `t` lives (a weak key: the
memo goes with the tensor) and is not changed in place (its version counter is checked);
`derived(t, key, fn)` memoizes what the host code computes from it (`fn(host_copy)`), device
tensors included, under the same rule. A tensor made under `torch.inference_mode()` has no version
counter: it is read at every call, as before. Copies are numpy arrays (int64): what the host code does
with them dispatches no tensor operator and reads nothing more. A fake or meta tensor (the
plan's traces) has no values: it raises, as reading it would.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
from torch.utils.weak import WeakTensorKeyDictionary

# tensor -> (its version when read, host copy, {key: derived value})
_MEMO = WeakTensorKeyDictionary()


def _read(t: torch.Tensor) -> np.ndarray:
    # the one read of t's values (on a GPU: a device-to-host copy that waits for t)
    return t.detach().cpu().numpy().astype(np.int64, copy=True)


def _entry(t: torch.Tensor) -> tuple[int, np.ndarray, dict]:
    if t.is_inference():  # no version counter to see an in-place change by: read at every call
        return (-1, _read(t), {})
    entry = _MEMO.get(t)
    if entry is None or entry[0] != t._version:
        entry = (t._version, _read(t), {})
        _MEMO[t] = entry
    return entry


def host_values(t: torch.Tensor) -> np.ndarray:
    """t's values as an int64 numpy array (do not modify it), read from the device at the first
    call for this tensor (and after an in-place change to it), from the memo after that."""
    return _entry(t)[1]


def derived(t: torch.Tensor, key: Any, fn: Callable[[np.ndarray], Any]) -> Any:
    """`fn(host_values(t))`, computed once per tensor (and version) and `key` (hashable: the other
    inputs `fn` depends on)."""
    _, host, values = _entry(t)
    if key not in values:
        values[key] = fn(host)
    return values[key]


def window_starts(doc_start: torch.Tensor) -> np.ndarray:
    """[T] the first key any query at each position can see: the document start, min over the
    batch (the indexer's chunked key windows cover every row of the batch)."""
    return derived(doc_start, "window_starts", lambda ds: ds.min(axis=0) if ds.shape[0] else ds.sum(axis=0))


def segment_starts(doc_start: np.ndarray) -> np.ndarray:
    """[B, T] document starts (host) -> the flat indices (over B * T rows) where a document starts:
    position 0 of every row and every position whose start is itself."""
    return np.flatnonzero(doc_start == np.arange(doc_start.shape[1])[None, :])
