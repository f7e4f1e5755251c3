"""FP8 e4m3 with 128x128 block scales: edge blocks, ue8m0, against an explicit block loop."""

import torch

from dsa_train.checkpoint.fp8 import dequantize_fp8_blocks, is_quantized_in_reference, quantize_fp8_blocks
from tests.checkpoint_helpers import reference_dequantize


def test_edge_blocks_dequantize_like_a_block_loop():
    w = torch.randn(576, 200) * 0.05  # kv_a_proj_with_mqa-like: 576 = 4.5 blocks, 200 = 1.56 blocks
    q, scale = quantize_fp8_blocks(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (5, 2) and scale.dtype == torch.float32
    assert torch.equal(dequantize_fp8_blocks(q, scale), reference_dequantize(q, scale))


def test_quantization_error_is_within_e4m3_rounding():
    w = torch.randn(300, 130)
    for ue8m0 in (False, True):
        q, scale = quantize_fp8_blocks(w, ue8m0=ue8m0)
        dq = dequantize_fp8_blocks(q, scale)
        step = scale.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :130]
        # e4m3: 3 mantissa bits (relative half-ulp 2^-4); subnormal spacing 2^-9 of the scale
        bound = torch.maximum(w.abs() * 2**-4, step * 2**-10) * 1.0001
        assert bool(((dq - w).abs() <= bound).all())


def test_ue8m0_scales_are_powers_of_two_and_nothing_saturates():
    w = torch.randn(256, 256) * 3
    q, scale = quantize_fp8_blocks(w, ue8m0=True)
    assert torch.equal(torch.log2(scale), torch.log2(scale).round())
    assert float(q.float().abs().max()) <= 448


def test_which_tensors_the_reference_quantizes():
    fp8 = [
        "model.layers.0.self_attn.q_a_proj.weight", "model.layers.3.self_attn.kv_b_proj.weight",
        "model.layers.0.mlp.down_proj.weight", "model.layers.5.mlp.experts.17.up_proj.weight",
        "model.layers.5.mlp.shared_experts.gate_proj.weight", "model.layers.61.self_attn.indexer.wq_b.weight",
        "model.layers.2.self_attn.indexer.wk.weight", "model.layers.2.self_attn.o_proj.weight",
    ]
    not_fp8 = [
        "model.embed_tokens.weight", "lm_head.weight", "model.layers.5.mlp.gate.weight",
        "model.layers.2.self_attn.indexer.weights_proj.weight", "model.layers.2.self_attn.indexer.k_norm.weight",
        "model.layers.61.eh_proj.weight", "model.layers.61.shared_head.head.weight",
        "model.layers.0.self_attn.kv_a_layernorm.weight", "model.layers.0.input_layernorm.weight",
    ]
    assert all(is_quantized_in_reference(n) for n in fp8)
    assert not any(is_quantized_in_reference(n) for n in not_fp8)
