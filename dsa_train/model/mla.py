"""Multi-head Latent Attention with DeepSeek Sparse Attention.

    q  = q_b_proj(q_a_layernorm(q_a_proj(x)))           per head [nope | rope]   (or q_proj(x))
    [c | k_rope] = kv_a_proj_with_mqa(x),  c = kv_a_layernorm(c)                 latent [kv_lora_rank]
    [k_nope | v] = kv_b_proj(c)                         per head

Two equivalent forms of the same function on the same key set:
  * MHA: per-head keys [k_nope | k_rope] and values v (what V3.1-Terminus trained with).
  * MQA / absorbed: q_lat = q_nope @ W_UK (kv_lora_rank dims per head), every head attends over
    the shared key [c | k_rope] and value c, and the latent output is mapped by W_UV per head.
    DSA's sparse attention runs in this form: a selected key is loaded once for all heads.

Attention modes:
  * "dense":  causal (and packed-document) attention over every key. The indexer runs only when
              the indexer loss (eq. 3) is asked for.
  * "sparse": the indexer picks top-k keys per query (eq. 2) and the main attention reads only
              those (MQA form). Eq. 4 when the indexer loss is asked for. The indexer's input is
              detached in both modes: it learns only from its KL loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import dsa_kernels as K

from .config import DSAConfig
from .indexer import LightningIndexer
from .norm import RMSNorm
from .rope import apply_rope_half, apply_rope_interleaved


@dataclass
class AttentionRequest:
    """What one forward pass asks of every attention layer."""

    attention: str = "dense"  # "dense" | "sparse"
    indexer_loss: bool = False
    topk: int = 2048
    mla_form: str = "auto"  # "mha" | "mqa" | "auto" (MHA for dense, MQA for sparse)
    recall_queries: torch.Tensor | None = None  # [n] query positions to measure top-k recall at
    return_topk: bool = False


@dataclass
class AttentionAux:
    indexer_kl_sum: torch.Tensor | None = None  # differentiable w.r.t. indexer params
    indexer_kl_uniform_sum: torch.Tensor | None = None
    indexer_queries: float = 0.0
    topk_recall: torch.Tensor | None = None
    topk_indices: torch.Tensor | None = None  # [B, T, k] int32, -1 = empty


class MLA(nn.Module):
    def __init__(self, config: DSAConfig):
        super().__init__()
        self.config = config
        self.num_heads = config.num_attention_heads
        self.nope_dim = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.scale = config.softmax_scale
        qk_dim = self.nope_dim + self.rope_dim
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(config.hidden_size, self.num_heads * qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(config.hidden_size, config.q_lora_rank, bias=config.attention_bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank)
            self.q_b_proj = nn.Linear(config.q_lora_rank, self.num_heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(
            config.hidden_size, self.kv_lora_rank + self.rope_dim, bias=config.attention_bias
        )
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, config.hidden_size, bias=config.attention_bias)
        self.indexer = LightningIndexer(config)
        self._rope = apply_rope_interleaved if config.rope_interleave else apply_rope_half

    # -------------------------------------------------------------- projections
    def _project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        B, T, _ = x.shape
        if self.config.q_lora_rank is None:
            q_latent = x
            q = self.q_proj(x)
        else:
            q_latent = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_latent)
        q = q.view(B, T, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_rope = self._rope(q_rope, cos, sin)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)  # [B, T, kv_lora_rank]
        k_rope = self._rope(k_rope, cos, sin)  # [B, T, rope_dim]
        return q_latent, q_nope, q_rope, latent, k_rope

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK, W_UV: [H, nope_dim, kv_lora_rank], [H, v_dim, kv_lora_rank] (views of kv_b_proj)."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def mha_qkv(self, q_nope, q_rope, latent, k_rope):
        """-> q, k [B, T, H, nope+rope], v [B, T, H, v_dim]."""
        B, T, H = q_nope.shape[:3]
        kv = self.kv_b_proj(latent).view(B, T, H, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope[:, :, None, :].expand(B, T, H, self.rope_dim)], dim=-1)
        return q, k, v

    def mqa_qkv(self, q_nope, q_rope, latent, k_rope):
        """-> q_abs [B, T, H, kv_lora_rank + rope], kv [B, T, kv_lora_rank + rope]."""
        w_uk, _ = self.absorbed_weights()
        q_lat = torch.einsum("bthd,hdc->bthc", q_nope, w_uk)
        return torch.cat([q_lat, q_rope], dim=-1), torch.cat([latent, k_rope], dim=-1)

    def mqa_output(self, out_latent: torch.Tensor) -> torch.Tensor:
        _, w_uv = self.absorbed_weights()
        return torch.einsum("bthc,hdc->bthd", out_latent, w_uv)

    # -------------------------------------------------------------- forward
    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        doc_start: torch.Tensor,
        request: AttentionRequest,
    ) -> tuple[torch.Tensor, AttentionAux]:
        B, T, _ = x.shape
        aux = AttentionAux()
        q_latent, q_nope, q_rope, latent, k_rope = self._project(x, cos, sin)
        sparse = request.attention == "sparse"
        if request.attention not in ("dense", "sparse"):
            raise ValueError(f"attention must be 'dense' or 'sparse', got {request.attention!r}")
        form = request.mla_form if request.mla_form != "auto" else ("mqa" if sparse else "mha")
        if sparse and form != "mqa":
            raise ValueError("sparse attention runs in the MQA (absorbed) form; use mla_form='mqa' or 'auto'")

        need_indexer = sparse or request.indexer_loss
        if need_indexer:
            # Detached input: the indexer learns only from its KL loss (report section 2.1.1).
            q_idx, k_idx, w_idx = self.indexer(x.detach(), q_latent.detach(), cos, sin)

        if form == "mha":
            q, k, v = self.mha_qkv(q_nope, q_rope, latent, k_rope)
            out, lse = K.dense_attention(q, k, v, self.scale, doc_start)  # [B, T, H, v_dim], [B, T, H]
            if request.indexer_loss:  # eq. 3's target from this forward's log-sum-exp
                kl, stats = K.dense_indexer_kl(
                    q_idx, k_idx, w_idx, q.detach(), k.detach(), self.scale, doc_start, lse_main=lse.detach()
                )
                self._record_kl(aux, kl, stats)
        else:
            q_abs, kv = self.mqa_qkv(q_nope, q_rope, latent, k_rope)
            if sparse:
                topk_indices, _ = K.indexer_topk(q_idx.detach(), k_idx.detach(), w_idx.detach(), doc_start, request.topk)
                out_latent, lse = K.sparse_mla(q_abs, kv, topk_indices, self.scale, self.kv_lora_rank)
                if request.indexer_loss:
                    kl, stats = K.sparse_indexer_kl(
                        q_idx, k_idx, w_idx, topk_indices, q_abs.detach(), kv.detach(), lse.detach(), self.scale
                    )
                    self._record_kl(aux, kl, stats)
                if request.recall_queries is not None:
                    aux.topk_recall = K.dense_mass_recall(
                        q_abs.detach(), kv.detach(), topk_indices, self.scale, doc_start, request.recall_queries
                    )
                if request.return_topk:
                    aux.topk_indices = topk_indices
            else:
                out_latent, lse = K.dense_attention(
                    q_abs, kv[:, :, None, :], latent[:, :, None, :], self.scale, doc_start
                )
                if request.indexer_loss:
                    kl, stats = K.dense_indexer_kl(
                        q_idx, k_idx, w_idx, q_abs.detach(), kv.detach()[:, :, None, :], self.scale, doc_start,
                        lse_main=lse.detach(),
                    )
                    self._record_kl(aux, kl, stats)
            out = self.mqa_output(out_latent)  # [B, T, H, v_dim]
        return self.o_proj(out.reshape(B, T, self.num_heads * self.v_dim)), aux

    @staticmethod
    def _record_kl(aux: AttentionAux, kl_sum: torch.Tensor, stats: dict) -> None:
        aux.indexer_kl_sum = kl_sum
        aux.indexer_kl_uniform_sum = stats["kl_uniform"]
        aux.indexer_queries = float(stats["queries"])
