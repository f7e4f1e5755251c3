"""Top-k selection through `torch.topk` on composite int64 keys, keeping the selection contract.

`torch.topk` does not say which of several equal scores it returns; the contract (reference.py)
breaks ties towards the lower key index and never selects a non-finite score. Each score is turned
into one int64 whose signed order is exactly that order, and torch.topk picks the largest k of those:

    key(s)  = the fp32 bits of s as an int32, magnitude bits flipped when negative (s >= 0: bits;
              s < 0: bits ^ 0x7FFFFFFF), so int32 order = float order; -0.0 is first made +0.0 (the
              two tie); non-finite scores (masked keys, +inf, NaN) get INT32_MIN, below every finite key
    comp    = key << 32 | (W - 1 - column)          (the inverted column: the lower index is larger)

Every composite of a row is distinct, so the top k composites are one set, whatever torch.topk's
algorithm, and sorted descending they are the contract's order (scores descending, ties by index).
Decoding inverts both halves: column = W - 1 - low 32 bits; score = the key's float (the map is an
involution on the key); a composite whose key is INT32_MIN is an empty slot (-1, -inf), and those
come last. A bf16 score block is widened to fp32 first (exact), so the selection is that of the
bf16 scores, as the radix select's.

`topk_fix_ties` is a third way to the same answer: torch.topk on the fp32 scores (k + 1 of them),
the k picks ordered by their composites, and only the rows that tie across the k-th score (or pick
+inf / NaN) redone through the composite path.

`composite_keys_torch` is the map in PyTorch (the specification, CPU); on the GPU one Triton pass
(`_composite_keys_kernel`: read the score, write the int64) builds it, a slice of rows at a time so
the int64 block is no larger than the fp32 score block. `topk_composite(scores, topk, key_offset)`
has `topk_from_scores`' contract.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._triton_common import Launch, interp_upcast

INT32_MIN = -(1 << 31)
COMPOSITE_BLOCK = 1024  # scores per program of the key kernel
# rows of the int64 composite block alive at once: at most this many elements (8 B each), i.e. no
# more bytes than the driver's default fp32 score block (1 << 26 elements, 256 MB)
COMPOSITE_BUDGET_ELEMS = 1 << 25


def composite_keys_torch(scores: torch.Tensor, columns: torch.Tensor | None = None,
                         width: int | None = None) -> torch.Tensor:
    """scores [..., W] fp32 / bf16 -> int64 composites [..., W] (module docstring). columns / width:
    the scores' key columns (int, same shape) in a row of `width` keys (default: 0..W-1 of W)."""
    x = scores.float()
    x = torch.where(x == 0, torch.zeros((), dtype=x.dtype, device=x.device), x)  # -0.0 -> +0.0
    bits = x.view(torch.int32)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    key = torch.where(torch.isfinite(x), key, torch.full_like(key, INT32_MIN))
    if columns is None:
        W = scores.shape[-1]
        inv = torch.arange(W - 1, -1, -1, device=scores.device, dtype=torch.int64)
    else:
        inv = (width - 1) - columns.to(torch.int64)
    return (key.to(torch.int64) << 32) | inv


@triton.jit
def _composite_keys_kernel(S, OUT, stride_sr, stride_or, W_LEN, BLOCK: tl.constexpr):
    """One row's BLOCK scores (row = program 0, columns = program 1) -> their int64 composites."""
    r = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < W_LEN
    x = tl.load(S + r * stride_sr + offs, mask=mask, other=0.0).to(tl.float32)
    finite = (x == x) & (x != float("inf")) & (x != float("-inf"))
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)  # -0.0 -> +0.0
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # arithmetic shift: all ones for a negative score
    key = tl.where(finite, key, -2147483648)
    comp = (key.to(tl.int64) << 32) | (W_LEN - 1 - offs).to(tl.int64)
    tl.store(OUT + r * stride_or + offs, comp, mask=mask)


def plan_composite_keys(scores: torch.Tensor, out: torch.Tensor) -> Launch:
    """scores [R, W] (row stride any, unit column stride) -> out [R, W] int64."""
    R, W = scores.shape
    return Launch(_composite_keys_kernel, (R, triton.cdiv(W, COMPOSITE_BLOCK)),
                  dict(S=scores, OUT=out, stride_sr=scores.stride(0), stride_or=out.stride(0), W_LEN=W,
                       BLOCK=COMPOSITE_BLOCK), num_warps=4)


def decode(top: torch.Tensor, width: int, key_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Composites [..., kk] (torch.topk's values) -> (indices int32 with -1, scores fp32 with -inf)."""
    key = (top >> 32).to(torch.int32)
    valid = key != INT32_MIN
    col = (width - 1) - (top & 0xFFFFFFFF)
    idx = torch.where(valid, col + key_offset, torch.full_like(col, -1)).to(torch.int32)
    val = (key ^ ((key >> 31) & 0x7FFFFFFF)).view(torch.float32)
    val = torch.where(valid, val, torch.full_like(val, float("-inf")))
    return idx, val


def topk_composite(scores: torch.Tensor, topk: int, key_offset: int = 0, use_kernel: bool | None = None,
                   budget_elems: int = COMPOSITE_BUDGET_ELEMS) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [B, C, W] fp32 / bf16 (-inf = masked) -> (indices [B, C, topk] int32 with -1, scores
    [B, C, topk] fp32), equal to `topk_from_scores(scores.float(), topk, key_offset)`. use_kernel:
    build the composites with the Triton kernel (default: on CUDA tensors, or under the interpreter);
    rows are processed `budget_elems // W` at a time (at least one)."""
    B, C, W = scores.shape
    kk = min(topk, W)
    if use_kernel is None:
        use_kernel = scores.is_cuda
    rows = scores.reshape(B * C, W)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    step = max(1, budget_elems // max(W, 1))
    idx = torch.full((B * C, topk), -1, dtype=torch.int32, device=scores.device)
    val = torch.full((B * C, topk), float("-inf"), dtype=torch.float32, device=scores.device)
    comp_buf = None
    for r0 in range(0, B * C, step):
        part = rows[r0:r0 + step]
        if use_kernel:
            n = part.shape[0]
            if comp_buf is None:
                comp_buf = torch.empty((min(step, B * C), W), dtype=torch.int64, device=scores.device)
            comp = comp_buf[:n]
            plan_composite_keys(interp_upcast(part), comp).run()
        else:
            comp = composite_keys_torch(part)
        top = torch.topk(comp, kk, dim=-1, largest=True, sorted=True).values
        i, v = decode(top, W, key_offset)
        idx[r0:r0 + step, :kk] = i
        val[r0:r0 + step, :kk] = v
        del comp, top
    return idx.view(B, C, topk), val.view(B, C, topk)


def topk_fix_ties(scores: torch.Tensor, topk: int, key_offset: int = 0,
                  budget_elems: int = COMPOSITE_BUDGET_ELEMS) -> tuple[torch.Tensor, torch.Tensor]:
    """`topk_from_scores`' contract from torch.topk on the scores themselves (fp32, no int64 block):
    torch.topk picks k + 1 per row; where the k-th and (k+1)-th scores differ the k selected keys are
    the only valid set, and ordering them by their composites ([rows, k] int64, one sort) gives the
    reference's order. Rows where they tie across the boundary (which of the equal keys make the cut
    decides the set), or whose picks include +inf / NaN (torch.topk ranks them first; the contract
    never selects them), are redone by `topk_composite` on those rows alone: one host sync per call
    to learn whether there are any. Its speed depends on how many rows tie at the k-th score."""
    B, C, W = scores.shape
    kk = min(topk, W)
    rows = scores.reshape(B * C, W)
    x = rows if rows.dtype == torch.float32 else rows.float()
    idx = torch.full((B * C, topk), -1, dtype=torch.int32, device=scores.device)
    val = torch.full((B * C, topk), float("-inf"), dtype=torch.float32, device=scores.device)
    bad_all = []
    step = max(1, budget_elems // max(W, 1))
    for r0 in range(0, B * C, step):
        part = x[r0:r0 + step]
        v, i = torch.topk(part, min(kk + 1, W), dim=-1, largest=True, sorted=True)
        sel_v, sel_i = v[:, :kk], i[:, :kk]
        # +inf / NaN picked, or a tie across the boundary (only when a (k+1)-th key exists)
        bad = (torch.isnan(sel_v) | (sel_v == float("inf"))).any(-1)
        if kk < W:
            bad |= (v[:, kk] == v[:, kk - 1]) & torch.isfinite(v[:, kk - 1])
        top = torch.sort(composite_keys_torch(sel_v, sel_i, W), dim=-1, descending=True).values
        i2, v2 = decode(top, W, key_offset)
        idx[r0:r0 + step, :kk] = i2
        val[r0:r0 + step, :kk] = v2
        bad_all.append(bad)
    bad = torch.cat(bad_all)
    if bool(bad.any()):  # the one host sync: redo the ambiguous rows exactly
        redo = bad.nonzero().squeeze(1)
        ri, rv = topk_composite(rows[redo].view(1, -1, W), topk, key_offset)
        idx[redo], val[redo] = ri[0], rv[0]
    return idx.view(B, C, topk), val.view(B, C, topk)
