"""Tiny random transformers DeepSeek-V3 / V3.2 checkpoints, written with save_pretrained, for tests."""

from __future__ import annotations

import torch

YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "rope_theta": 10000.0,
}
PLAIN_ROPE = {"rope_type": "default", "rope_theta": 10000.0}

BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    max_position_embeddings=512,
    rope_parameters=YARN,
)


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Give norms, LayerNorm biases and router biases random values (init leaves them 1/0)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith(("layernorm.weight", "norm.weight", "k_norm.weight")):
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
        elif name.endswith(("k_norm.bias",)):
            p.copy_(0.2 * torch.randn(p.shape, generator=g))
        elif name.endswith("e_score_correction_bias"):
            p.copy_(0.05 * torch.randn(p.shape, generator=g))
        elif name.endswith("weight") and p.dim() >= 2 and "weights_proj" not in name:
            p.copy_(0.08 * torch.randn(p.shape, generator=g))
        elif name.endswith("weights_proj.weight"):
            p.copy_(0.5 * torch.randn(p.shape, generator=g))


def make_v3(path, seed: int = 0, **overrides):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV3Config(**{**BASE, **overrides})
    model = DeepseekV3ForCausalLM(cfg).eval()
    randomize_(model, seed)
    model.save_pretrained(path)
    return model


def make_v32(path, seed: int = 0, **overrides):
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    torch.manual_seed(seed)
    kw = {**BASE, "index_topk": 16, "index_n_heads": 16, "index_head_dim": 32, **overrides}
    cfg = DeepseekV32Config(**kw)
    cfg._attn_implementation = "eager"
    model = DeepseekV32ForCausalLM(cfg).eval()
    randomize_(model, seed)
    model.save_pretrained(path)
    return model
