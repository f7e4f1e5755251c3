"""Shapes and inputs of the kernel checks (`kernels.py`): the 671B attention layer's dims, or tiny
ones for the CPU run of the command itself (`--small`), and seeded inputs built on the device.

Inputs are what the model feeds the kernels, not uniform noise: packed documents (three per row,
so several document starts), top-k index lists whose rows near a document start have fewer than
k valid keys (the -1 slots form the row's tail, as `indexer_topk` returns them), one row with no
valid slot, and a context-parallel variant (a rank's queries over the whole sequence's keys).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Dims:
    H: int  # main attention heads
    D: int  # MQA key dim (latent + rope)
    D_V: int  # value dim (the latent)
    H_I: int  # indexer heads
    D_I: int  # indexer head dim
    K: int  # top-k
    H_MHA: int  # dense attention heads (MHA form)
    D_MHA: int  # dense q/k head dim (nope + rope)
    DV_MHA: int  # dense v head dim
    seq_lens: tuple  # T of the correctness checks
    speed_T: int  # T of the timings
    full_rows_max: int  # up to this T every query row is compared; above it a sample of rows
    sample_rows: int  # rows compared above full_rows_max
    dense_doc_max: int  # longest document of the dense checks (bounds the fp32 reference's T^2 work)


DIMS_671B = Dims(H=128, D=576, D_V=512, H_I=64, D_I=128, K=2048, H_MHA=128, D_MHA=192, DV_MHA=128,
                 seq_lens=(4096, 32768, 131072), speed_T=32768, full_rows_max=4096, sample_rows=2048,
                 dense_doc_max=16384)
DIMS_SMALL = Dims(H=8, D=64, D_V=48, H_I=4, D_I=16, K=16, H_MHA=4, D_MHA=24, DV_MHA=16,
                  seq_lens=(64, 128), speed_T=32, full_rows_max=64, sample_rows=24, dense_doc_max=64)


def dims_for(small: bool) -> Dims:
    return DIMS_SMALL if small else DIMS_671B


def doc_lengths(T: int, max_doc: int | None = None) -> list[int]:
    """Three documents of 5/8, 1/4 and 1/8 of the row (or documents of at most max_doc tokens)."""
    if max_doc is not None and max_doc < T:
        return [max_doc] * (T // max_doc) + ([T % max_doc] if T % max_doc else [])
    a, b = T * 5 // 8, T // 4
    return [a, b, T - a - b]


def doc_start_of(lengths: list[int], device) -> torch.Tensor:
    """[1, T] int64: the first position of each token's document."""
    starts = torch.cumsum(torch.tensor([0] + lengths[:-1]), 0)
    return torch.repeat_interleave(starts, torch.tensor(lengths))[None].to(device)


def cp_positions(T: int, device, cp: int = 4, rank: int = 1) -> torch.Tensor:
    """Global positions of context-parallel rank `rank` of `cp` (zigzag: chunks rank and
    2*cp-1-rank of 2*cp), as `dsa_train.parallel.context.local_positions` lays them out."""
    L = T // (2 * cp)
    a = torch.arange(rank * L, (rank + 1) * L)
    b = torch.arange((2 * cp - 1 - rank) * L, (2 * cp - rank) * L)
    return torch.cat([a, b]).to(device)


def compared_rows(Tq: int, dims: Dims, doc_start: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Query rows whose outputs are compared with the fp32 reference: all of them up to
    dims.full_rows_max, else a seeded sample that always holds the first rows of every document
    (fewer than k valid keys), the rows around 65,536 (CUDA's grid y limit) and the last rows."""
    if Tq <= dims.full_rows_max:
        return torch.arange(Tq)
    pos = torch.arange(Tq) if positions is None else positions.cpu()
    ds = doc_start[0].cpu()[pos]
    must = [torch.nonzero(pos == ds).flatten()[:, None] + torch.arange(4)]  # document starts
    must.append(torch.arange(Tq - 8, Tq))
    must.append(torch.nonzero((pos >= 65530) & (pos < 65542)).flatten())
    g = torch.Generator().manual_seed(Tq)
    rest = torch.randperm(Tq, generator=g)[: dims.sample_rows]
    rows = torch.cat([m.flatten() for m in must] + [rest]).clamp(0, Tq - 1)
    return torch.unique(rows)  # sorted


def topk_lists(doc_start: torch.Tensor, positions: torch.Tensor, K: int, seed: int, empty_rows=(0,)) -> torch.Tensor:
    """Index lists as the indexer returns them, for queries at global `positions` [Tq]:
    [1, Tq, K] int32, each row's valid keys (doc_start <= s <= t) distinct, in random order, -1 as
    the tail when fewer than K keys are visible; rows `empty_rows` (local) have no valid slot.
    Rows with more than K visible keys take one key per stratum of K equal strata (distinct keys
    spread over the whole window, so far and near keys are both read)."""
    dev = positions.device
    g = torch.Generator(device=dev).manual_seed(seed)
    pos = positions.to(torch.int64)
    ds = doc_start[0].to(dev)[pos]  # [Tq]
    n = pos - ds + 1  # visible keys per row
    j = torch.arange(K, device=dev, dtype=torch.float32)
    u = torch.rand(pos.shape[0], K, generator=g, device=dev)
    width = n.double()[:, None] / K  # >= 1 where n >= K: strata [a_j, b_j) of integers, disjoint, non-empty
    a = torch.floor(j.double() * width).long()
    b = torch.floor((j.double() + 1) * width).long()
    stratified = ds[:, None] + a + torch.floor(u.double() * (b - a)).long()
    dense = ds[:, None] + j.long()[None]  # n < K: every visible key, then -1
    idx = torch.where((n >= K)[:, None], stratified, torch.where(j.long()[None] < n[:, None], dense, -1))
    # random order of the valid slots (top-k returns them by score, not by position); -1 stays the tail
    keys = torch.where(idx >= 0, torch.rand(idx.shape, generator=g, device=dev), torch.full_like(u, 2.0))
    idx = torch.gather(idx, 1, torch.argsort(keys, dim=1))
    for r in empty_rows:
        idx[r] = -1
    return idx[None].to(torch.int32)


def randn(shape, device, seed: int, dtype=torch.bfloat16, std: float = 1.0) -> torch.Tensor:
    """Seeded normal values generated on the device, in `dtype` (no fp32 copy at 128K)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(shape, generator=g, device=device, dtype=dtype)
    return x.mul_(std) if std != 1.0 else x


def grid(shape, device, seed: int, dtype=torch.bfloat16, lo: int = -2, hi: int = 2, denom: int = 4) -> torch.Tensor:
    """Values on a grid of multiples of 1/denom in [lo, hi]: exact in bf16, and the index scores
    built from them are exact in fp32 whatever the summation order (so kernel and reference
    scores are bit-equal and top-k selections, ties included, compare exactly)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randint(lo * denom, hi * denom + 1, shape, generator=g, device=device)
    return (x.to(torch.float32) / denom).to(dtype)


def valid_pairs(doc_start: torch.Tensor, positions: torch.Tensor, K: int | None) -> int:
    """Number of (query, key) pairs attended: sum over rows of min(K, visible keys) (K=None: all
    visible keys, dense attention)."""
    pos = positions.to(torch.int64).cpu()
    n = pos - doc_start[0].cpu()[pos] + 1
    return int((n if K is None else n.clamp(max=K)).sum())
