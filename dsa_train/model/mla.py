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

import contextlib
import os
from dataclasses import dataclass

import torch
from torch import nn

import dsa_kernels as K
from dsa_kernels._triton_common import use_triton
from dsa_kernels.ops.dense_attention import dense_attention_lse, mla_attention_rows

from .config import DSAConfig
from .indexer import LightningIndexer
from .norm import RMSNorm
from .rope import apply_rope_half, apply_rope_interleaved


class AllHeads:
    """Head placement of an MLA layer that holds every attention head (one process). Tensor
    parallelism replaces it from outside (`dsa_train.parallel.tensor.TensorParallelHeads`)."""

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        """A tensor read by every local head (latent KV): its gradient sums over head shards."""
        return x

    def gather(self, x: torch.Tensor, dim: int = 2) -> torch.Tensor:
        """Values of every head of the layer (no gradient), from this process's heads along `dim`."""
        return x

    def sum_heads(self, x: torch.Tensor) -> torch.Tensor:
        """A sum over every head of the layer (no gradient), from this process's heads' partial sum."""
        return x

    def replicated(self):
        """A context for work every process holding some of the layer's heads must do with the same
        bits (the indexer's top-k): one process has nothing to agree on."""
        return contextlib.nullcontext()


def sparse_kl(layer, q_idx, k_idx_all, w_idx, topk_indices, q_abs, kv_all, lse, p_sum: list):
    """Eq. 4 for one MLA layer. p_sum [target or None] from `sparse_mla(..., return_target=True)`:
    a target is the local heads' Sigma_h P, summed over the heads' shards by `layer.heads.sum_heads`
    (tensor parallelism: one all-reduce of [B, T, K] fp32, no q [B, T, H, 576] or lse gathered);
    None (the chunked path): the KL forms the target from every head's q and lse, gathered."""
    target = p_sum[0] if p_sum else None
    if target is not None:
        return K.sparse_indexer_kl(q_idx, k_idx_all, w_idx, topk_indices, q_abs.detach(), kv_all.detach(), lse.detach(),
                                   layer.scale, target=layer.heads.sum_heads(target), heads=layer.num_heads)
    return K.sparse_indexer_kl(q_idx, k_idx_all, w_idx, topk_indices, layer.heads.gather(q_abs.detach()),
                               kv_all.detach(), layer.heads.gather(lse.detach()), layer.scale)


@dataclass
class AttentionRequest:
    """What one forward pass asks of every attention layer."""

    attention: str = "dense"  # "dense" | "sparse"
    indexer_loss: bool = False
    topk: int = 2048
    # scores the top-k is selected on: "bf16" | "fp8" | "fp8_ue8m0"
    # (dsa_kernels.ops.indexer_topk.SCORINGS; model/indexer.py)
    index_scores: str = "bf16"
    mla_form: str = "auto"  # "mha" | "mqa" | "auto" (MHA for dense, MQA for sparse)
    recall_queries: torch.Tensor | None = None  # [n] global query positions to measure top-k recall at
    return_topk: bool = False
    # Context parallelism: this rank holds only some of the sequence's queries. The handle knows
    # their global positions (`positions` [T_loc]) and gathers per-token tensors of the whole
    # sequence (`gather`: [B, T_loc, ...] -> [B, T, ...], autograd). None: the whole sequence.
    context: object | None = None
    # Every parameter but the indexer's is frozen (the dense warm-up): the main model runs without
    # autograd and is never recomputed; only the indexer and its KL carry a graph (`MLA._forward_frozen`).
    main_frozen: bool = False


@dataclass
class AttentionAux:
    indexer_kl_sum: torch.Tensor | None = None  # differentiable w.r.t. indexer params
    indexer_kl_uniform_sum: torch.Tensor | None = None
    indexer_queries: float = 0.0
    topk_recall_sum: torch.Tensor | None = None  # summed over the sampled queries this rank holds
    topk_recall_count: float | torch.Tensor = 0.0  # a device count under context parallelism
    topk_indices: torch.Tensor | None = None  # [B, T, k] int32, -1 = empty


class MLA(nn.Module):
    """One MLA layer. Its forward holds no parallelism of its own: it runs whatever heads its
    projections hold (`view(B, T, -1, ...)`), reads the other heads' values through `self.heads`
    (tensor parallelism, set from outside) and the rest of the sequence through
    `request.context` (context parallelism, an argument)."""

    def __init__(self, config: DSAConfig):
        super().__init__()
        self.config = config
        self.num_heads = config.num_attention_heads  # of the whole layer
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
        self.heads = AllHeads()
        self._rope = apply_rope_interleaved if config.rope_interleave else apply_rope_half

    # -------------------------------------------------------------- projections
    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, T, hidden] -> (q_latent, q_nope [B, T, H, nope], q_rope [B, T, H, rope] (roped),
        latent [B, T, kv_lora_rank], k_rope [B, T, rope] (roped))."""
        B, T, _ = x.shape
        if self.config.q_lora_rank is None:
            q_latent = x
            q = self.q_proj(x)
        else:
            q_latent = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_latent)
        q = q.view(B, T, -1, self.nope_dim + self.rope_dim)  # [B, T, local heads, nope + rope]
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_rope = self._rope(q_rope, cos, sin)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)  # [B, T, kv_lora_rank]
        k_rope = self._rope(k_rope, cos, sin)  # [B, T, rope_dim]
        return q_latent, q_nope, q_rope, self.heads.shared(latent), self.heads.shared(k_rope)

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK, W_UV: [H, nope_dim, kv_lora_rank], [H, v_dim, kv_lora_rank] (views of kv_b_proj;
        H = the heads this layer holds)."""
        w = self.kv_b_proj.weight.view(-1, self.nope_dim + self.v_dim, self.kv_lora_rank)
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
        recompute_indexer: bool = False,
    ) -> tuple[torch.Tensor, AttentionAux]:
        """x [B, T_loc, hidden] (T_loc = T without context parallelism); cos/sin of the same
        tokens; doc_start [B, T] of the whole sequence. recompute_indexer: with a frozen main
        model (`request.main_frozen`), the indexer and its KL run again in the backward (the
        layer's `parallel.recompute`) instead of keeping their inputs."""
        if request.main_frozen and request.attention == "dense" and request.mla_form in ("auto", "mha"):
            return self._forward_frozen(x, cos, sin, doc_start, request, recompute_indexer)
        B, T_loc, _ = x.shape
        aux = AttentionAux()
        cp = request.context
        q_latent, q_nope, q_rope, latent, k_rope = self.project(x, cos, sin)
        sparse = request.attention == "sparse"
        if request.attention not in ("dense", "sparse"):
            raise ValueError(f"attention must be 'dense' or 'sparse', got {request.attention!r}")
        # context parallelism exchanges only the MQA form's shared 576-dim key [latent | k_rope]
        form = request.mla_form if request.mla_form != "auto" else ("mqa" if sparse or cp is not None else "mha")
        if (sparse or cp is not None) and form != "mqa":
            raise ValueError("sparse and context-parallel attention run in the MQA (absorbed) form; "
                             "use mla_form='mqa' or 'auto'")

        if sparse or request.indexer_loss:
            # Detached input: the indexer learns only from its KL loss (report section 2.1.1).
            q_idx, k_idx, w_idx = self.indexer(x.detach(), q_latent.detach(), cos, sin)
            k_idx_all = k_idx if cp is None else cp.gather(k_idx)  # [B, T, d_I]

        if form == "mha":
            q, k, v = self.mha_qkv(q_nope, q_rope, latent, k_rope)
            out, lse = K.dense_attention(q, k, v, self.scale, doc_start)  # [B, T, H, v_dim], [B, T, H]
            if request.indexer_loss:  # eq. 3's target from this forward's log-sum-exp (every head's)
                kl, stats = K.dense_indexer_kl(
                    q_idx, k_idx, w_idx, self.heads.gather(q.detach()), self.heads.gather(k.detach()), self.scale,
                    doc_start, lse_main=self.heads.gather(lse.detach()),
                )
                record_kl(aux, kl, stats["kl_uniform"], B * T_loc)
            return self.o_proj(out.reshape(B, T_loc, -1)), aux

        q_abs, kv = self.mqa_qkv(q_nope, q_rope, latent, k_rope)
        kv_all = kv if cp is None else cp.gather(kv)  # [B, T, 576]: all attention activations exchanged
        if sparse:
            with self.heads.replicated():  # tensor parallelism: every rank selects the same keys in the same order
                topk_indices = select_topk(q_idx.detach(), k_idx_all.detach(), w_idx.detach(), doc_start, request.topk,
                                           cp, request.index_scores)
            # eq. 4's target Sigma_h P from the attention's own forward (Triton path; the chunked one
            # returns None and its KL forms the target from every head's q and lse)
            out_latent, lse, *p_sum = K.sparse_mla(q_abs, kv_all, topk_indices, self.scale, self.kv_lora_rank,
                                                   return_target=request.indexer_loss)
            if request.indexer_loss:
                kl, stats = sparse_kl(self, q_idx, k_idx_all, w_idx, topk_indices, q_abs, kv_all, lse, p_sum)
                record_kl(aux, kl, stats["kl_uniform"], B * T_loc)
            if request.recall_queries is not None:
                record_topk_recall(aux, self.scale, q_abs.detach(), kv_all.detach(), topk_indices, doc_start, request, cp)
            if request.return_topk:
                aux.topk_indices = topk_indices
        elif cp is None:
            out_latent, lse = K.dense_attention(q_abs, kv[:, :, None, :], latent[:, :, None, :], self.scale, doc_start)
            if request.indexer_loss:
                kl, stats = K.dense_indexer_kl(
                    q_idx, k_idx, w_idx, self.heads.gather(q_abs.detach()), kv.detach()[:, :, None, :], self.scale,
                    doc_start, lse_main=self.heads.gather(lse.detach()),
                )
                record_kl(aux, kl, stats["kl_uniform"], B * T_loc)
        else:
            idx = (q_idx, k_idx_all, w_idx) if request.indexer_loss else (None, None, None)
            out_latent = self._dense_at_positions(aux, request, q_abs, kv_all, *idx, doc_start, cp.positions)
        out = self.mqa_output(out_latent)  # [B, T_loc, H, v_dim]
        return self.o_proj(out.reshape(B, T_loc, -1)), aux

    # -------------------------------------------------------------- the dense warm-up (frozen main model)
    def _forward_frozen(self, x, cos, sin, doc_start, request, recompute_indexer):
        """Dense attention of a frozen main model: no autograd graph, run once (never recomputed),
        MHA form. Without context parallelism a library kernel that returns the log-sum-exp
        (`dense_attention_lse`); under it the rank's runs of queries over the gathered latent,
        up-projected locally block by block (`mla_attention_rows`). With the indexer loss, the
        indexer's forward and the KL (eq. 3) are the only graph; `recompute_indexer` checkpoints
        them from x and the attention's lse (the KL's main-model inputs are then recomputed from x
        in the backward, not kept from the forward)."""
        B, T_loc, _ = x.shape
        aux = AttentionAux()
        cp = request.context
        held = []
        with torch.no_grad():
            q_latent, q_nope, q_rope, latent, k_rope = self.project(x, cos, sin)
            if cp is None:
                q, k, v = self.mha_qkv(q_nope, q_rope, latent, k_rope)
                out, lse = dense_attention_lse(q, k, v, self.scale, doc_start)  # [B, T, H, v_dim], [B, T, H]
                del v
                if request.indexer_loss:
                    held.append((q_latent, self.heads.gather(q), self.heads.gather(k)))
                del q, k
            else:
                q = torch.cat([q_nope, q_rope], dim=-1)  # [B, T_loc, H, nope + rope]
                kv_all = cp.gather(torch.cat([latent, k_rope], dim=-1))  # [B, T, 576]: what CP exchanges
                latent_all, k_rope_all = kv_all.split([self.kv_lora_rank, self.rope_dim], dim=-1)
                outs, lses = [], []
                for j0, a, n in cp_runs(cp, doc_start.shape[1]):
                    o, l_ = mla_attention_rows(q[:, j0 : j0 + n], latent_all, k_rope_all, self.kv_b_proj.weight,
                                               self.scale, doc_start, a, self.nope_dim)
                    outs.append(o)
                    lses.append(l_)
                out, lse = torch.cat(outs, dim=1), torch.cat(lses, dim=1)
                del q, outs, lses
                if request.indexer_loss:
                    q_abs, _ = self.mqa_qkv(q_nope, q_rope, latent, k_rope)
                    held.append((q_latent, self.heads.gather(q_abs), kv_all))
                    del q_abs
                del latent_all, k_rope_all, kv_all
            del q_nope, q_rope, latent, k_rope
            out = self.o_proj(out.reshape(B, T_loc, -1))
        if request.indexer_loss:
            lse_heads = self.heads.gather(lse)
            if recompute_indexer and torch.is_grad_enabled():
                from torch.utils.checkpoint import checkpoint

                # the first run takes `held` and fills the row statistics; the backward's recompute
                # forms the main-model tensors from x and skips the KL's statistics pass
                kl, klu = checkpoint(self._frozen_kl, x, lse_heads, cos, sin, doc_start, request, held, [],
                                     use_reentrant=False)
            else:
                kl, klu = self._frozen_kl(x, lse_heads, cos, sin, doc_start, request, held, [])
            record_kl(aux, kl, klu, B * T_loc)
        return out, aux

    def _frozen_kl_inputs(self, x, cos, sin, request):
        """The KL target's main-model tensors (no graph): q_latent, every head's queries and the keys
        (MHA q, k without context parallelism; the absorbed q and the gathered [latent | k_rope] under it)."""
        cp = request.context
        with torch.no_grad():
            q_latent, q_nope, q_rope, latent, k_rope = self.project(x, cos, sin)
            if cp is None:
                q, k, _ = self.mha_qkv(q_nope, q_rope, latent, k_rope)
                return q_latent, self.heads.gather(q), self.heads.gather(k)
            q_abs, kv = self.mqa_qkv(q_nope, q_rope, latent, k_rope)
            return q_latent, self.heads.gather(q_abs), cp.gather(kv)

    def _frozen_kl(self, x, lse_heads, cos, sin, doc_start, request, held, row_stats):
        """Eq. 3 for this layer's queries -> (kl_sum, kl_uniform_sum). `held` gives the main-model
        tensors the attention's forward already formed (taken once); empty, they are formed from x.
        On the Triton path `row_stats` collects each KL call's row statistics ([B, T] fp32) on the
        first run; a checkpoint's recompute finds them there and skips the KL's statistics pass (its
        sums are then zeros: a recompute's outputs are discarded)."""
        from dsa_kernels.ops.indexer_kl.function import dense_indexer_kl_triton

        q_latent, q_main, k_main = held.pop() if held else self._frozen_kl_inputs(x, cos, sin, request)
        q_idx, k_idx, w_idx = self.indexer(x.detach(), q_latent, cos, sin)
        cp = request.context
        recomputing = len(row_stats) > 0
        if cp is None:
            if not use_triton(q_idx, k_idx, w_idx, q_main, k_main):
                kl, stats = K.dense_indexer_kl(q_idx, k_idx, w_idx, q_main, k_main, self.scale, doc_start,
                                               lse_main=lse_heads)
                return kl, stats["kl_uniform"]
            kl, stats = dense_indexer_kl_triton(q_idx, k_idx, w_idx, q_main, k_main, self.scale, doc_start,
                                                lse_main=lse_heads, row_stats=row_stats[0] if recomputing else None)
            if not recomputing:
                row_stats.append(stats["row_stats"])
            return kl, stats["kl_uniform"]
        k_idx_all = cp.gather(k_idx)
        if not use_triton(q_idx, k_idx_all, w_idx, q_main, k_main):
            return kl_at_positions(self.scale, q_idx, k_idx_all, w_idx, q_main, lse_heads, k_main, doc_start, cp.positions)
        # the dense KL kernel per run of queries at its offset, over the gathered keys (MQA form)
        kl, klu = None, 0.0
        for i, (j0, a, n) in enumerate(cp_runs(cp, doc_start.shape[1])):
            value, stats = dense_indexer_kl_triton(
                q_idx[:, j0 : j0 + n], k_idx_all, w_idx[:, j0 : j0 + n], q_main[:, j0 : j0 + n],
                k_main[:, :, None, :], self.scale, doc_start, lse_main=lse_heads[:, j0 : j0 + n], q_offset=a,
                row_stats=row_stats[i] if recomputing else None)
            if not recomputing:
                row_stats.append(stats["row_stats"])
            kl = value if kl is None else kl + value
            klu = klu + stats["kl_uniform"]
        return kl, klu

    def _dense_at_positions(self, aux, request, q_abs, kv_all, q_idx, k_idx_all, w_idx, doc_start, positions):
        """Dense attention (and eq. 3) for queries at global `positions` [T_loc] over the whole
        sequence's keys kv_all [B, T, 576]: the sparse kernels over every visible key, one query
        chunk at a time. Each chunk's index list [C, keys] is built inside a checkpointed
        function, so neither the forward nor the backward holds more than one chunk's (about
        DENSE_CHUNK_ELEMS indices), never [T_loc, T]. The same function as dense attention."""
        from torch.utils.checkpoint import checkpoint

        Tq, T = q_abs.shape[1], kv_all.shape[1]
        chunk = max(1, DENSE_CHUNK_ELEMS // max(T * q_abs.shape[0], 1))
        q_heads = self.heads.gather(q_abs.detach()) if request.indexer_loss else None
        outs, kl_total, klu_total = [], None, 0.0

        def attend(q_c, kv, pos):
            idx = visible_key_indices(doc_start, pos)
            return K.sparse_mla(q_c, kv, idx, self.scale, self.kv_lora_rank)

        # kv (the gathered latent KV, [B, T, 576]) is an argument, not a closure variable: the
        # checkpoint keeps its function until the backward, and a captured kv_all would keep every
        # layer's gathered KV alive through the forward (found by `dsa-train plan --trace`: 144 MB
        # per layer at 128K, 8.6 GiB over 61 layers in the warm-up); as an argument it is one of the
        # layer's recomputed tensors under `parallel.recompute`.
        def kl(qi, ki, wi, qm, lse, pos, kv):
            idx = visible_key_indices(doc_start, pos)
            value, stats = K.sparse_indexer_kl(qi, ki, wi, idx, qm, kv, lse, self.scale)
            return value, stats["kl_uniform"]

        for q0 in range(0, Tq, chunk):
            pos = positions[q0 : q0 + chunk]
            o, lse = checkpoint(attend, q_abs[:, q0 : q0 + chunk], kv_all, pos, use_reentrant=False)
            outs.append(o)
            if request.indexer_loss:
                value, klu = checkpoint(
                    kl, q_idx[:, q0 : q0 + chunk], k_idx_all, w_idx[:, q0 : q0 + chunk], q_heads[:, q0 : q0 + chunk],
                    self.heads.gather(lse.detach()), pos, kv_all.detach(), use_reentrant=False,
                )
                kl_total = value if kl_total is None else kl_total + value
                klu_total = klu_total + klu
        if request.indexer_loss:
            record_kl(aux, kl_total, klu_total, q_abs.shape[0] * Tq)
        return torch.cat(outs, dim=1)


# index-list elements per query chunk of dense attention at given positions (env override for tests)
DENSE_CHUNK_ELEMS = int(os.environ.get("DSA_CP_DENSE_CHUNK", 1 << 24))


def cp_runs(cp, seq_len: int) -> list[tuple[int, int, int]]:
    """The contiguous runs of a CP rank's query positions as (local start, global start, length):
    chunks rank and 2 * size - 1 - rank of 2 * size (`dsa_train.parallel.context.local_positions`),
    known from the handle without reading its positions back (FakeTensorMode, no host sync)."""
    size, rank = cp.size, cp.rank
    L = seq_len // (2 * size)
    if cp.positions.shape[0] != 2 * L:
        raise ValueError(f"context-parallel rank {rank} of {size} holds {cp.positions.shape[0]} positions of a "
                         f"{seq_len}-token sequence; expected its 2 chunks of {L} (local_positions)")
    return [(0, rank * L, L), (L, (2 * size - 1 - rank) * L, L)]


def visible_key_indices(doc_start: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Dense attention as index lists: every visible key of the queries at global `positions`
    [Tq] (-1 padded) -> [B, Tq, T] int32, T = the sequence length. The width does not depend on
    the positions' values: no host sync per chunk on a GPU, and the shapes are known without the
    data (the memory trace's FakeTensorMode); DENSE_CHUNK_ELEMS already sizes a chunk for width T."""
    s = torch.arange(doc_start.shape[1], device=doc_start.device)
    valid = (s[None, None, :] <= positions[None, :, None]) & (s[None, None, :] >= doc_start[:, positions, None])
    return torch.where(valid, s, torch.full_like(s, -1)).to(torch.int32)


@torch.no_grad()
def select_topk(q_idx, k_idx_all, w_idx, doc_start, topk: int, cp=None, scoring: str = "bf16") -> torch.Tensor:
    """Eq. 2 for this process's queries over every key of the sequence -> [B, T_loc, topk]
    int32 (-1 = empty). q_idx [B, T_loc, H_I, d_I], k_idx_all [B, T, d_I], w_idx [B, T_loc, H_I].
    scoring: the index scores selected on (model/indexer.py: FP8 scoring is selection only)."""
    positions = None if cp is None else cp.positions
    return K.indexer_topk(q_idx, k_idx_all, w_idx, doc_start, topk, query_positions=positions, scoring=scoring)[0]


# ---- helpers of MLA.forward (module level: the class stays one screenful of methods)
def kl_at_positions(scale: float, q_idx, k_idx_all, w_idx, q_heads, lse_heads, kv_all, doc_start, positions):
    """Eq. 3 for queries at global `positions` over every visible key, one query chunk at a time
    (the sparse KL over `visible_key_indices`, each chunk's index list built inside a checkpoint)."""
    from torch.utils.checkpoint import checkpoint

    Tq, T = q_idx.shape[1], kv_all.shape[1]
    chunk = max(1, DENSE_CHUNK_ELEMS // max(T * q_idx.shape[0], 1))

    def kl(qi, ki, wi, qm, lse, pos, kv):
        idx = visible_key_indices(doc_start, pos)
        value, stats = K.sparse_indexer_kl(qi, ki, wi, idx, qm, kv, lse, scale)
        return value, stats["kl_uniform"]

    kl_total, klu_total = None, 0.0
    for q0 in range(0, Tq, chunk):
        sl = slice(q0, q0 + chunk)
        value, klu = checkpoint(kl, q_idx[:, sl], k_idx_all, w_idx[:, sl], q_heads[:, sl], lse_heads[:, sl],
                                positions[sl], kv_all, use_reentrant=False)
        kl_total = value if kl_total is None else kl_total + value
        klu_total = klu_total + klu
    return kl_total, klu_total


RECALL_CHUNK_ELEMS = 1 << 26  # fp32 logits of the sampled queries per chunk ([B, queries, H, keys]: 256 MB)


def record_topk_recall(aux, scale: float, q_abs, kv_all, topk_indices, doc_start, request, cp) -> None:
    """Top-k recall of the dense attention mass at the sampled query positions this rank holds:
    per query t and row, the share of its head-averaged dense attention over keys [doc start, t]
    that falls on its selected keys. All sampled queries at once (in chunks of at most
    RECALL_CHUNK_ELEMS logits), with no host read: under context parallelism the queries this
    rank holds are masked, not gathered, and the count stays on the device."""
    B, T_loc, H, _ = q_abs.shape
    device = q_abs.device
    queries = request.recall_queries.to(device)  # [n] global positions
    if cp is None:
        rows, held = queries, None
    else:
        match = cp.positions[None, :] == queries[:, None]  # [n, T_loc]
        held = match.any(1)  # the queries this rank holds
        rows = match.to(torch.int8).argmax(1)  # their local rows (row 0 where not held: masked out)
    keys = kv_all.shape[1]
    kv = kv_all.float()
    s = torch.arange(keys, device=device)
    n = queries.shape[0]
    per_query = max(B * H * keys, 1)
    chunk = max(1, min(n, RECALL_CHUNK_ELEMS // per_query))
    total = q_abs.new_zeros((), dtype=torch.float32)
    for j0 in range(0, n, chunk):
        t, r = queries[j0 : j0 + chunk], rows[j0 : j0 + chunk]
        q = q_abs[:, r].float()  # [B, c, H, D]
        logits = torch.einsum("bchd,bsd->bchs", q * scale, kv)  # [B, c, H, S]
        valid = (s[None, None, :] <= t[None, :, None]) & (s[None, None, :] >= doc_start[:, t][:, :, None])
        p = torch.softmax(logits.masked_fill_(~valid[:, :, None, :], float("-inf")), dim=-1).sum(2) / H  # [B, c, S]
        sel = topk_indices[:, r].long()  # [B, c, K]
        hits = torch.zeros_like(p, dtype=torch.int32).scatter_add_(2, sel.clamp(min=0), (sel >= 0).int())
        recall = (p * (hits > 0)).sum(-1)  # [B, c]
        if held is not None:
            recall = recall * held[j0 : j0 + chunk]
        total = total + recall.sum()
    aux.topk_recall_sum = total
    aux.topk_recall_count = float(B * n) if held is None else held.sum().double() * B


def record_kl(aux: AttentionAux, kl_sum: torch.Tensor, kl_uniform_sum: torch.Tensor, queries: int) -> None:
    """kl_sum / kl_uniform_sum stay on the device; queries (B x T_loc, the kernels' "queries"
    stat) is known from the shapes."""
    aux.indexer_kl_sum = kl_sum
    aux.indexer_kl_uniform_sum = kl_uniform_sum
    aux.indexer_queries = float(queries)
