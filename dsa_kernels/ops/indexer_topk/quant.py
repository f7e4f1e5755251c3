"""FP8 quantization of the indexer's q_I / k_I in one pass (issue 31 item 5, FP8 index scores).

`quantize_fp8_groups` (reference.py, the specification) spells DeepSeek-V3.2's `act_quant` in
PyTorch: an fp32 copy, |x|, the group amax, the scale, x / scale, the clamp, the e4m3 cast -- seven
elementwise passes over x, each reading and writing fp32 (about 312 KB per token for q_I at 64 heads
x 128, bf16 in). `_fp8_quant_kernel` reads x once and writes the e4m3 values and the scales: 24 KB
per token. One program per BLOCK_ROWS rows of [rows, D]; per row and 128-channel group:

    amax  = max(max |x|, 1e-4)                     (NaN propagates, as torch's amax)
    scale = amax / 448                             (IEEE division: div_rn; ue8m0: the next power of two)
    q     = e4m3(clamp(x / scale, -448, 448))      (div_rn; rounded to nearest even in fp32, bits by hand)

bitwise `quantize_fp8_groups` (tests/test_indexer_fp8_quant.py, the interpreter; gpu-check's
`correctness.index_scores_fp8` compares the compiled kernel's scores). `quantize_rows_triton(x, ue8m0)`
takes x [..., D] (any leading shape, last dim contiguous) -> (e4m3 [..., D], fp32 [..., G]).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._triton_common import Launch
from .reference import FP8_AMAX_FLOOR, FP8_GROUP, FP8_MAX

QUANT_ROWS = 16  # rows per program


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _round_e4m3(v):
    """fp32 v (|v| <= 448 or NaN) -> the nearest e4m3 value, ties to even, still fp32: scaled by the
    e4m3 spacing at v's exponent (a power of two: exact), rounded with the 1.5 x 2^23 trick (exact
    RNE below 2^22), scaled back. The cast to float8e4nv is then exact, whatever its own rounding
    (the interpreter's carries no mantissa overflow into the exponent: 124.6 -> 64, not 128)."""
    e = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.where(e < -6, -6, e)  # e4m3's subnormals: spacing 2^-9 below 2^-6
    inv = ((127 - (e - 3)) << 23).to(tl.float32, bitcast=True)  # 2^-(e - 3)
    sp = ((127 + (e - 3)) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3)
    magic = 12582912.0  # 1.5 x 2^23
    r = ((v * inv + magic) - magic) * sp
    return tl.where(r == 0.0, v * 0.0, r)  # a value rounded to zero keeps its sign (-0.0), as the cast


@triton.jit
def _e4m3_bits(r):
    """An e4m3 value held in fp32 (from `_round_e4m3`; NaN allowed) -> its float8_e4m3fn bits (int32
    0..255): sign, 4 exponent bits (bias 7; 0 = subnormal, 2^-9 steps), 3 mantissa bits; NaN 0x7F
    with its sign. Written by hand, so no converter's rounding or NaN rule (the interpreter's, ptx's)
    is involved."""
    b = r.to(tl.int32, bitcast=True)
    sign = (b >> 24) & 0x80
    e = ((b >> 23) & 0xFF) - 127
    normal = ((e + 7) << 3) | ((b >> 20) & 0x7)
    sub = (tl.abs(r) * 512.0).to(tl.int32)  # 0 .. 7 steps of 2^-9 (exact)
    mag = tl.where(e >= -6, normal, sub)
    mag = tl.where(r != r, 0x7F, mag)
    return sign | mag


@triton.jit
def _fp8_quant_kernel(X, Q, S, n_rows, D, G, stride_x, stride_q, stride_s, AMAX_FLOOR, QMAX,
                      UE8M0: tl.constexpr, GROUP: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < n_rows
    cols = tl.arange(0, GROUP)
    for g in range(0, G):
        c = g * GROUP + cols
        mask = row_ok[:, None] & (c < D)[None, :]
        x = tl.load(X + rows[:, None] * stride_x + c[None, :], mask=mask, other=0.0).to(tl.float32)
        amax = tl.reduce(tl.abs(x), 1, _max_nan)
        amax = tl.where(amax < AMAX_FLOOR, AMAX_FLOOR, amax)  # clamp_min, NaN kept
        scale = tl.math.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32))
        if UE8M0:  # the next power of two at or above (V3.2's fast_round_scale), from the bits
            bits = scale.to(tl.int32, bitcast=True)
            exp = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
            pow2 = ((exp + 127) << 23).to(tl.float32, bitcast=True)
            scale = tl.where(exp > 127, float("inf"), pow2)
        v = tl.math.div_rn(x, scale[:, None])
        v = tl.where(v > QMAX, QMAX, tl.where(v < -QMAX, -QMAX, v))  # clamp, NaN kept
        tl.store(Q + rows[:, None] * stride_q + c[None, :], _e4m3_bits(_round_e4m3(v)).to(tl.uint8), mask=mask)
        tl.store(S + rows * stride_s + g, scale, mask=row_ok)


def plan_fp8_quant(x2: torch.Tensor, q2: torch.Tensor, s2: torch.Tensor, ue8m0: bool) -> Launch:
    """x2 [R, D] (unit column stride), q2 [R, D] uint8 (the e4m3 tensor's bits), s2 [R, G] fp32."""
    R, D = x2.shape
    G = s2.shape[1]
    return Launch(_fp8_quant_kernel, (triton.cdiv(R, QUANT_ROWS),),
                  dict(X=x2, Q=q2, S=s2, n_rows=R, D=D, G=G, stride_x=x2.stride(0), stride_q=q2.stride(0),
                       stride_s=s2.stride(0), AMAX_FLOOR=FP8_AMAX_FLOOR, QMAX=FP8_MAX, UE8M0=ue8m0,
                       GROUP=FP8_GROUP, BLOCK_ROWS=QUANT_ROWS), num_warps=4)


def quantize_rows_triton(x: torch.Tensor, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_fp8_groups(x, 128, ue8m0)` in one Triton pass: x [..., D] bf16 / fp16 / fp32 ->
    (e4m3 [..., D], fp32 scales [..., ceil(D / 128)])."""
    D = x.shape[-1]
    G = -(-D // FP8_GROUP)
    x2 = x.reshape(-1, D)
    if D and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((*x.shape[:-1], G), dtype=torch.float32, device=x.device)
    if x2.shape[0] and D:  # the kernel writes the e4m3 bits (`_e4m3_bits`)
        plan_fp8_quant(x2, q.view(torch.uint8).view(-1, D), s.view(-1, G), ue8m0).run()
    return q, s
