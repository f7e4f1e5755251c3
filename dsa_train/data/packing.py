"""Packing tokenized documents into fixed-length training sequences.

Convention (shared by every loader in ``dsa_train.data``):

1. Each document is framed as ``[bos] + tokens + [eos]`` (each part switchable with
   ``add_bos`` / ``add_eos``) and all framed documents are concatenated into one token
   *stream* ``S [L]``; ``doc_offsets [n_docs + 1]`` marks where each document starts in it.
2. Row ``r`` is the window ``S[r*T : r*T + T + 1]`` of ``T + 1`` tokens (``T = seq_len``):
   ``input_ids = window[:-1]``, ``labels = window[1:]``. Consecutive windows overlap by one
   token, so every next-token pair of the stream is trained exactly once. Tokens after the last
   full window (fewer than ``T`` of them) are dropped; ``num_rows = (L - 1) // T``.
3. ``position_ids[t]`` is the index of token t inside its document, restarting at 0 at every
   document start **and at the start of every row** (a document cut by a row boundary continues
   in the next row from position 0: attention never crosses rows, so for the model the
   continuation is a new segment). This is how the model sees document boundaries: a new
   document starts at t wherever ``position_ids[t] != position_ids[t-1] + 1`` (and at t = 0).
4. ``labels[t] = -100`` (ignored by the loss) where token t is the last token of a document,
   i.e. where ``window[t+1]`` starts the next document: predicting an unrelated document's first
   token from the previous document is noise, and with document-masked attention it is not even
   a well-posed prediction. (With ``add_eos`` the model still learns to emit EOS: the label of
   the token before EOS is EOS.)

Per row the outputs are ``input_ids [T]``, ``labels [T]``, ``position_ids [T]``, all int64.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import torch

IGNORE_INDEX = -100


@dataclass(frozen=True)
class PackingConfig:
    seq_len: int  # T, tokens per training sequence
    add_bos: bool = True
    add_eos: bool = True


def frame_document(token_ids: Sequence[int], bos_id: int | None, eos_id: int | None,
                   add_bos: bool = True, add_eos: bool = True) -> list[int]:
    """``[bos] + token_ids + [eos]`` with each special token optional."""
    from dsa_train.data.tokenizer import TokenizerError

    if add_bos and bos_id is None:
        raise TokenizerError("add_bos=True but the tokenizer has no BOS token: set data.add_bos=false "
                         "or name bos_token in the tokenizer's tokenizer_config.json.")
    if add_eos and eos_id is None:
        raise TokenizerError("add_eos=True but the tokenizer has no EOS token: set data.add_eos=false "
                         "or name eos_token in the tokenizer's tokenizer_config.json.")
    return ([bos_id] if add_bos else []) + list(token_ids) + ([eos_id] if add_eos else [])


def num_rows(stream_len: int, seq_len: int) -> int:
    """Rows of ``seq_len`` inputs a stream of ``stream_len`` tokens gives (windows overlap by 1)."""
    return max(stream_len - 1, 0) // seq_len


def doc_start_mask(doc_offsets: np.ndarray, window_start: int, window_len: int) -> np.ndarray:
    """Bool ``[window_len]``: True where the stream token at ``window_start + i`` starts a doc.

    ``doc_offsets`` is sorted, ``[n_docs + 1]``, with the stream length as its last entry.
    """
    lo = np.searchsorted(doc_offsets, window_start, side="left")
    hi = np.searchsorted(doc_offsets, window_start + window_len, side="left")
    mask = np.zeros(window_len, dtype=bool)
    mask[np.asarray(doc_offsets[lo:hi], dtype=np.int64) - window_start] = True
    return mask


def pack_row(window: np.ndarray, is_doc_start: np.ndarray) -> dict[str, torch.Tensor]:
    """Turn one window of the stream into a training sequence.

    Args:
        window: ``[T + 1]`` token ids, ``S[r*T : r*T + T + 1]``.
        is_doc_start: ``[T + 1]`` bool, True where ``window[i]`` is a document's first token.
    Returns:
        ``input_ids [T]``, ``labels [T]`` (-100 at document ends), ``position_ids [T]``; int64.
    """
    window = np.asarray(window, dtype=np.int64)
    seq_len = window.shape[0] - 1
    input_ids = window[:-1].copy()  # [T]
    labels = window[1:].copy()  # [T]
    labels[is_doc_start[1:]] = IGNORE_INDEX  # token t ends a document: don't predict the next one
    segment_start = is_doc_start[:-1].copy()  # [T]
    segment_start[0] = True  # every row starts a segment, even mid-document
    index = np.arange(seq_len, dtype=np.int64)
    last_start = np.maximum.accumulate(np.where(segment_start, index, 0))  # [T]
    position_ids = index - last_start  # [T]
    return {"input_ids": torch.from_numpy(input_ids), "labels": torch.from_numpy(labels),
            "position_ids": torch.from_numpy(position_ids)}


def concat_documents(token_docs: Iterable[Sequence[int]], bos_id: int | None, eos_id: int | None,
                     add_bos: bool = True, add_eos: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Frame and concatenate documents: stream ``[L]`` int64 and ``doc_offsets [n_docs + 1]``."""
    framed = [frame_document(doc, bos_id, eos_id, add_bos, add_eos) for doc in token_docs]
    lengths = np.array([len(doc) for doc in framed], dtype=np.int64)
    doc_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    stream = np.fromiter((t for doc in framed for t in doc), dtype=np.int64, count=int(lengths.sum()))
    return stream, doc_offsets


def pack_documents(token_docs: Iterable[Sequence[int]], seq_len: int, bos_id: int | None,
                   eos_id: int | None, add_bos: bool = True,
                   add_eos: bool = True) -> list[dict[str, torch.Tensor]]:
    """In-memory packing of tokenized documents into ``num_rows`` sequences (see module doc)."""
    stream, doc_offsets = concat_documents(token_docs, bos_id, eos_id, add_bos, add_eos)
    return [pack_row(stream[r * seq_len: r * seq_len + seq_len + 1],
                     doc_start_mask(doc_offsets, r * seq_len, seq_len + 1))
            for r in range(num_rows(len(stream), seq_len))]


# ---------------------------------------------------------------------------------------------
# Boundary helpers for attention code (document masks, varlen kernels).


def doc_starts_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Index of the first token of each token's document.

    Args:
        position_ids: ``[B, T]`` (or ``[T]``); a document starts at t = 0 and wherever
            ``position_ids[t] != position_ids[t-1] + 1``.
    Returns:
        ``[B, T]`` (same shape) int64: ``doc_start[b, t]`` = first index of t's document, so
        key s is visible to query t iff ``doc_start[b, t] <= s <= t``.
    """
    is_start = torch.ones_like(position_ids, dtype=torch.bool)  # [B, T]
    is_start[..., 1:] = position_ids[..., 1:] != position_ids[..., :-1] + 1
    index = torch.arange(position_ids.shape[-1], device=position_ids.device).expand_as(position_ids)
    starts = torch.where(is_start, index, torch.zeros_like(index))
    return torch.cummax(starts, dim=-1).values


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """``[T]`` position ids -> int32 ``cu_seqlens [n_docs + 1]`` (flash-attn varlen layout)."""
    if position_ids.dim() != 1:
        raise ValueError(f"expected position_ids of shape [T], got {tuple(position_ids.shape)}")
    is_start = torch.ones_like(position_ids, dtype=torch.bool)
    is_start[1:] = position_ids[1:] != position_ids[:-1] + 1
    starts = torch.nonzero(is_start).flatten()
    total = torch.tensor([position_ids.shape[0]], device=position_ids.device)
    return torch.cat([starts, total]).to(torch.int32)


def position_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``cu_seqlens [n_docs + 1]`` (starting at 0) -> ``position_ids [seq_len]`` int64.

    Tokens at or past ``cu_seqlens[-1]`` (padding) continue the last document's positions.
    """
    cu_seqlens = cu_seqlens.to(torch.int64)
    index = torch.arange(seq_len, device=cu_seqlens.device)
    doc = torch.searchsorted(cu_seqlens[:-1].contiguous(), index, right=True) - 1  # [T]
    return index - cu_seqlens[doc.clamp(min=0)]
