"""The FP8 quantization kernel (`ops/indexer_topk/quant.py`, `_fp8_quant_kernel`) against its
specification `quantize_fp8_groups` (DeepSeek-V3.2's act_quant): bitwise equal e4m3 values and
fp32 scales, under the interpreter, at odd widths (one partial group, several groups), bf16 / fp16 /
fp32 inputs, fp32 and ue8m0 scales, strided rows, and the values where rounding is decided: exact
ties between e4m3 neighbours (to even), carries into the next binade (124.6 -> 128), subnormals,
signed zeros, clamping at 448, an all-zero group (the amax floor), NaN."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dsa_kernels.ops.indexer_topk.quant import quantize_rows_triton  # noqa: E402
from dsa_kernels.ops.indexer_topk.reference import quantize_fp8_groups  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _same(x, ue8m0):
    q, s = quantize_rows_triton(x, ue8m0)
    rq, rs = quantize_fp8_groups(x, 128, ue8m0)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and s.shape == rs.shape
    torch.testing.assert_close(s, rs, rtol=0, atol=0, equal_nan=True)
    qf, rqf = q.float(), rq.float()
    assert torch.equal(torch.isnan(qf), torch.isnan(rqf))
    ok = ~torch.isnan(rqf)
    assert torch.equal(q.view(torch.uint8)[ok], rq.view(torch.uint8)[ok])  # signed zeros included


@pytest.mark.parametrize("D", [32, 128, 200, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_random_rows_over_many_magnitudes(D, dtype, ue8m0):
    g = torch.Generator().manual_seed(D)
    top = 4.0 if dtype == torch.float16 else 1e4
    x = torch.randn(2, 19, D, generator=g) * torch.logspace(-5, 0, 19)[None, :, None] * top
    _same(x.to(dtype).to(DEV), ue8m0)


@pytest.mark.parametrize("ue8m0", [False, True])
def test_the_values_where_rounding_is_decided(ue8m0):
    # a row whose amax is 448: scale 1 (a power of two: ue8m0 keeps it), so x / scale is x itself
    spec = [448.0, 1.0625, 1.1875, -1.0625, 240.0, 232.0, 124.6, -127.5, 0.5 * 2**-9, 1.5 * 2**-9,
            2.5 * 2**-9, -0.25 * 2**-9, 2**-6 * 1.0625, -0.0, 0.0, 3e-8, -3e-8, 447.9, 440.0]
    row = torch.zeros(128)
    row[: len(spec)] = torch.tensor(spec)
    x = torch.stack([row, torch.zeros(128), row * 3, -row * 1e-3])  # clamped, the floor, a scale below 1
    x[3, 5] = float("nan")  # NaN: its group's amax and every value NaN, as in torch
    _same(x.to(DEV), ue8m0)


def test_strided_rows_and_empty_inputs():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 2, 128, generator=g).to(torch.bfloat16)[:, 1]  # rows 2 apart
    assert not x.is_contiguous()
    _same(x.to(DEV), False)
    q, s = quantize_rows_triton(torch.empty(0, 4, 128, dtype=torch.bfloat16, device=DEV))
    assert q.shape == (0, 4, 128) and s.shape == (0, 4, 1)


@pytest.mark.parametrize("ue8m0", [False, True])
def test_infinite_and_extreme_values(ue8m0):
    # +-inf: the group's scale inf, its finite values 0 and its infinities NaN (inf / inf), as in torch;
    # fp32 denormals (the amax floor); values near fp32's maximum (a finite scale, ue8m0's largest powers)
    row = torch.zeros(4, 128)
    row[0, :3] = torch.tensor([float("inf"), 1.0, -2.0])
    row[1, :2] = torch.tensor([-float("inf"), 3.0])
    row[2] = 1e-41
    row[3] = torch.linspace(-3e38, 3e38, 128)
    _same(row.to(DEV), ue8m0)
