"""`dsa-train make-tiny-checkpoint`: a tiny random checkpoint in the DeepSeek-V3.1-Terminus layout.

Same layout as the 671B release, shrunk: `model_type: deepseek_v3`, `DeepseekV3ForCausalLM`,
FP8 e4m3 weights with 128x128 `weight_scale_inv` blocks (ue8m0: power-of-two scales) for the
tensors the release stores in FP8, bf16 elsewhere (fp32 router bias), the MTP module as
`model.layers.{num_hidden_layers}` (eh_proj, enorm, hnorm, shared_head, embed_tokens, attention,
MoE), a sharded index, `quantization_config` with `scale_fmt: ue8m0`, no indexer (a dense
checkpoint), and the bundled tokenizer (vocab 4096). Hidden size 192 and the other dims are
deliberately not multiples of 128, so partial edge blocks are exercised.

config.json also carries `index_n_heads` / `index_head_dim` / `index_topk` sized for this tiny
model: the indexer that dsa_train initializes when it converts the checkpoint to DSA.
"""

from __future__ import annotations

import os

import torch

from ..model.config import DSAConfig
from ..model.transformer import DSAForCausalLM
from .export import (BUNDLED_TOKENIZER_DIR, TINY_KIND, ExportOptions, ExportResult, natural_key, quantization_config,
                     write_hf_dir)
from .match import is_indexer_tensor

TINY_SHARD_BYTES = 3 * 10**6

TINY_TERMINUS = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 192,
    "initializer_range": 0.02,
    "intermediate_size": 320,
    "kv_lora_rank": 64,
    "max_position_embeddings": 4096,
    "moe_intermediate_size": 96,
    "moe_layer_freq": 1,
    "n_group": 2,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_key_value_heads": 4,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 160,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 4.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 1024,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "v_head_dim": 32,
    "vocab_size": 4096,
    # the DSA indexer dsa_train gives this model when converting it (not read by transformers)
    "index_n_heads": 16,  # few heads make exact ReLU ties (score 0) common at the top-k boundary
    "index_head_dim": 32,
    "index_topk": 64,
}


def tiny_terminus_config_json(dense_mlp: bool = False, **overrides) -> dict:
    cfg = {**TINY_TERMINUS, **overrides}
    if dense_mlp:
        cfg["first_k_dense_replace"] = cfg["num_hidden_layers"]  # every main layer a dense MLP
    cfg["quantization_config"] = quantization_config(ExportOptions(ue8m0=True))
    return cfg


@torch.no_grad()
def random_weights(config: DSAConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random weights of the model; norms and router biases perturbed (not 1 / 0) so they matter."""
    torch.manual_seed(seed)
    model = DSAForCausalLM(config)
    g = torch.Generator().manual_seed(seed + 1)
    state = model.state_dict()
    for name, t in state.items():
        if name.endswith("norm.weight"):
            t.copy_(1.0 + 0.1 * torch.randn(t.shape, generator=g))
        elif name.endswith("e_score_correction_bias"):
            t.copy_(0.05 * torch.randn(t.shape, generator=g))
        elif t.dim() == 2 and not name.endswith("embed_tokens.weight"):
            t.copy_(config.initializer_range * torch.randn(t.shape, generator=g))
    return state


def make_tiny_checkpoint(out: str | os.PathLike, seed: int = 0, dense_mlp: bool = False, **overrides) -> ExportResult:
    """Write the checkpoint; `overrides` replace config.json fields (sizes) for tests."""
    config_json = tiny_terminus_config_json(dense_mlp, **overrides)
    state = random_weights(DSAConfig.from_hf_dict(config_json), seed)
    names = sorted((n for n in state if not is_indexer_tensor(n)), key=natural_key)
    options = ExportOptions(dtype=torch.bfloat16, ue8m0=True, max_shard_bytes=TINY_SHARD_BYTES)
    made_from = f"random weights, seed {seed}" + (", dense MLPs" if dense_mlp else "")
    return write_hf_dir(out, config_json, ((n, state[n]) for n in names), options, BUNDLED_TOKENIZER_DIR,
                        written_by="dsa-train make-tiny-checkpoint", made_from=made_from, kind=TINY_KIND)
