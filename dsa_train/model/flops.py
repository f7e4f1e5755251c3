"""Model FLOPs per token for MFU, indexer included.

Counts multiply-adds as 2 FLOPs, matmuls only (norms, softmax, RoPE and routing are ignored), with
the average causal key count (T+1)/2 per query. Training = forward + backward (backward = 2x
forward) for the parts that receive gradients. Which parts those are is a property of the stage's
kind (`dsa_train.stage.StageKind`), passed in as flags:
  * sparse training ("all"): everything x3, LM head included; the indexer's scores are formed over
    every causal key (the selection) but differentiated only at the k selected ones (eq. 4's KL over
    S_t): forward over (T+1)/2 keys, backward 2x over k_t = min(t+1, k) keys.
  * dense warm-up ("indexer"): the frozen main model runs forward only (x1, no LM head: the
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
    """Forward FLOPs of one layer's attention core and indexer scores, per query token, and the
    backward FLOPs of the indexer scores (`indexer_backward`: 2x the scores its loss differentiates:
    every causal key under eq. 3 (dense), the k_t selected ones under eq. 4 (sparse))."""
    H = cfg.num_attention_heads
    avg_keys = (seq_len + 1) / 2
    keys = avg_keys
    if attention == "sparse":
        k = topk or cfg.index_topk
        # mean over t of min(t + 1, k): k - k (k - 1) / 2T when k <= T, else (T + 1) / 2
        keys = k - k * (k - 1) / (2 * seq_len) if k <= seq_len else avg_keys
        d_qk = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        main = 2 * H * keys * (d_qk + cfg.kv_lora_rank)  # MQA form: scores + latent values
        main += 2 * 2 * H * cfg.qk_nope_head_dim * cfg.kv_lora_rank  # W_UK absorb, W_UV out
    else:
        main = 2 * H * avg_keys * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    per_key = 2 * cfg.index_n_heads * cfg.index_head_dim + 2 * cfg.index_n_heads
    return {"main": main, "indexer": per_key * avg_keys, "indexer_backward": 2 * per_key * keys}


def flops_per_token(
    cfg: DSAConfig,
    seq_len: int,
    attention: str = "sparse",
    topk: int | None = None,
    *,
    main_backward: bool = True,
    lm_head: bool = True,
    kl_recomputes_main_scores: bool = False,
) -> float:
    """Training FLOPs per token (forward + backward) of one step. The indexer's projections always
    run forward + backward (x3), its scores forward over every causal key plus the backward of the
    scores its loss differentiates (all causal keys dense, the k selected sparse); the main model runs forward + backward (x3) with `main_backward`,
    else forward only (x1); `lm_head` adds the LM head to the main model's part;
    `kl_recomputes_main_scores` adds one more pass over the main attention scores (the KL target).
    What a stage runs is said by its kind (`dsa_train.stage.Stage.flops_per_token`); the same count,
    part by part beside what the step issues, is `dsa_train.model.step_flops` (a test holds the two
    equal)."""
    attn = attention_flops_per_token(cfg, seq_len, attention, topk)
    head = 2 * cfg.hidden_size * cfg.vocab_size
    main_fwd, indexer = 0.0, 0.0
    for i in range(cfg.num_hidden_layers):
        params = layer_linear_params(cfg, i)
        main_fwd += 2 * params["main"] + attn["main"]
        indexer += 3 * 2 * params["indexer"] + attn["indexer"] + attn["indexer_backward"]
    main = main_fwd + head if lm_head else main_fwd
    total = (3 if main_backward else 1) * main + indexer
    if kl_recomputes_main_scores:
        total += cfg.num_hidden_layers * attn["main"]
    return total
