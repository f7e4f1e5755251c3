"""Model FLOPs per token for MFU, indexer included.

Counts multiply-adds as 2 FLOPs, matmuls only (norms, softmax, RoPE and routing are ignored), with
the average causal key count (T+1)/2 per query. Training = forward + backward (backward = 2x
forward) for the parts that receive gradients:
  * stage "all" (sparse training): everything x3.
  * stage "indexer" (dense warm-up): the frozen main model runs forward only (x1, no LM head: the
    warm-up skips it); the indexer and its KL loss run forward + backward (x3), and the KL target
    recomputes the main attention scores once more (x1).
"""

from __future__ import annotations

from .config import DSAConfig


def _mlp(hidden: int, inter: int) -> int:
    return 3 * hidden * inter


def layer_linear_params(cfg: DSAConfig, layer_idx: int) -> dict[str, int]:
    """Active (per-token) matmul parameters of one layer, split into main and indexer."""
    h, H = cfg.hidden_size, cfg.num_attention_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    if cfg.q_lora_rank:
        q = h * cfg.q_lora_rank + cfg.q_lora_rank * H * qk
    else:
        q = h * H * qk
    kv = h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank * H * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    o = H * cfg.v_head_dim * h
    if cfg.is_moe_layer(layer_idx):
        mlp = _mlp(h, cfg.moe_intermediate_size) * (cfg.num_experts_per_tok + cfg.n_shared_experts)
        mlp += h * cfg.n_routed_experts  # router
    else:
        mlp = _mlp(h, cfg.intermediate_size)
    q_in = cfg.q_lora_rank or h
    indexer = q_in * cfg.index_n_heads * cfg.index_head_dim + h * cfg.index_head_dim + h * cfg.index_n_heads
    return {"main": q + kv + o + mlp, "indexer": indexer}


def attention_flops_per_token(cfg: DSAConfig, seq_len: int, attention: str, topk: int | None = None) -> dict[str, float]:
    """Forward FLOPs of one layer's attention core and indexer scores, per query token."""
    H = cfg.num_attention_heads
    avg_keys = (seq_len + 1) / 2
    if attention == "sparse":
        k = topk or cfg.index_topk
        # mean over t of min(t + 1, k)
        keys = sum(min(t + 1, k) for t in range(seq_len)) / seq_len if seq_len <= 1 << 16 else min(avg_keys, k)
        d_qk = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        main = 2 * H * keys * (d_qk + cfg.kv_lora_rank)  # MQA form: scores + latent values
        main += 2 * 2 * H * cfg.qk_nope_head_dim * cfg.kv_lora_rank  # W_UK absorb, W_UV out
    else:
        main = 2 * H * avg_keys * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    index_scores = 2 * cfg.index_n_heads * cfg.index_head_dim * avg_keys + 2 * cfg.index_n_heads * avg_keys
    return {"main": main, "indexer": index_scores}


def flops_per_token(
    cfg: DSAConfig,
    seq_len: int,
    attention: str = "sparse",
    topk: int | None = None,
    stage_trainable: str = "all",
) -> float:
    """Training FLOPs per token (forward + backward) for a step of the given stage."""
    attn = attention_flops_per_token(cfg, seq_len, attention, topk)
    head = 2 * cfg.hidden_size * cfg.vocab_size
    main_fwd, indexer_fwd = 0.0, 0.0
    for i in range(cfg.num_hidden_layers):
        params = layer_linear_params(cfg, i)
        main_fwd += 2 * params["main"] + attn["main"]
        indexer_fwd += 2 * params["indexer"] + attn["indexer"]
    if stage_trainable == "indexer":
        # main forward, indexer fwd+bwd, and the KL target's second pass over the main scores
        return main_fwd + 3 * indexer_fwd + cfg.num_hidden_layers * attn["main"]
    if stage_trainable != "all":
        raise ValueError(f"stage_trainable must be 'all' or 'indexer', got {stage_trainable!r}")
    # sparse training: indexer input detached, but it is still trained by its own loss
    return 3 * (main_fwd + head) + 3 * indexer_fwd
