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


def composite_keys_torch(scores: torch.Tensor) -> torch.Tensor:
    """scores [..., W] fp32 / bf16 -> int64 composites [..., W] (module docstring)."""
    x = scores.float()
    x = torch.where(x == 0, torch.zeros((), dtype=x.dtype, device=x.device), x)  # -0.0 -> +0.0
    bits = x.view(torch.int32)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    key = torch.where(torch.isfinite(x), key, torch.full_like(key, INT32_MIN))
    W = scores.shape[-1]
    inv = torch.arange(W - 1, -1, -1, device=scores.device, dtype=torch.int64)
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
