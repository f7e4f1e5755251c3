"""MLA under tensor and context parallelism (`ParallelMLA`: the same module, parameters and
names, with a forward that knows its TP rank's heads and its CP rank's queries).

Tensor parallel: this rank runs H / TP heads. The shared latent KV and k_rope feed every head, so
their gradients are summed over TP (`copy_to_group`). The indexer's KL target (head-summed main
attention) needs all heads: the detached queries (and log-sum-exps) are gathered over TP.

Context parallel (`request.cp`, set by `dsa_train.parallel.context`): this rank holds the queries
of two load-balanced chunks of the sequence. Attention runs in the MQA form, so the only
activations exchanged are the 576-dim latent KV [c | k_rope] and the 128-dim indexer key k_I
of every token (all-gathered; their gradients come back by an all-reduce). Top-k selection is
global: local queries score all keys of the sequence. Dense attention under CP is the sparse
kernel over every visible key, query chunk by query chunk with the index lists rebuilt in the
backward (the same function; the dense indexer loss is then eq. 4 over all keys = eq. 3).
"""

from __future__ import annotations

import os

import torch

import dsa_kernels as K
from dsa_kernels.ops.indexer_topk import index_scores_block, topk_from_scores
from dsa_kernels.masking import query_chunk_size
from dsa_train.model.mla import MLA, AttentionAux
from dsa_train.parallel.comm import all_gather_nograd, copy_to_group
from dsa_train.parallel.groups import ParallelState

# index-list elements per query chunk of dense attention under CP (env override for tests)
DENSE_CP_CHUNK_ELEMS = int(os.environ.get("DSA_CP_DENSE_CHUNK", 1 << 24))


@torch.no_grad()
def topk_at_positions(q, k, w, doc_start, positions, topk: int):
    """Top-k over all keys for queries at global `positions` [Tq]. q [B, Tq, H, D] (local
    queries), k [B, T, D] (all keys), w [B, Tq, H], doc_start [B, T] -> indices [B, Tq, topk]."""
    B, Tq, H, _ = q.shape
    chunk = query_chunk_size(Tq, per_query_elems=B * H * k.shape[1])
    out = []
    for q0 in range(0, Tq, chunk):
        pos = positions[q0 : q0 + chunk]
        k0, k1 = int(doc_start[:, pos].min()), int(pos.max()) + 1
        scores = index_scores_block(q[:, q0 : q0 + chunk], k[:, k0:k1], w[:, q0 : q0 + chunk])
        s = torch.arange(k0, k1, device=k.device)
        valid = (s[None, None, :] <= pos[None, :, None]) & (s[None, None, :] >= doc_start[:, pos, None])
        idx, _ = topk_from_scores(scores.masked_fill(~valid, float("-inf")), topk, key_offset=k0)
        out.append(idx)
    return torch.cat(out, dim=1)


def all_key_indices(doc_start, positions, T: int) -> torch.Tensor:
    """Dense attention as index lists: every visible key of each query (-1 padded) [B, Tq, T]."""
    s = torch.arange(T, device=doc_start.device)
    valid = (s[None, None, :] <= positions[None, :, None]) & (s[None, None, :] >= doc_start[:, positions, None])
    return torch.where(valid, s, torch.full_like(s, -1)).to(torch.int32)


class ParallelMLA(MLA):
    @classmethod
    def convert(cls, attn: MLA, state: ParallelState) -> "ParallelMLA":
        attn.__class__ = cls
        attn._pstate = state
        return attn

    def _gather_heads(self, x: torch.Tensor) -> torch.Tensor:
        st = self._pstate
        return all_gather_nograd(x, 2, st.tp_group) if st.sizes.tensor > 1 else x

    def forward(self, x, cos, sin, doc_start, request):
        st = self._pstate
        cp = getattr(request, "cp", None)
        B, T, _ = x.shape
        aux = AttentionAux()
        q_latent, q_nope, q_rope, latent, k_rope = self._project(x, cos, sin)
        if st.sizes.tensor > 1:
            latent, k_rope = copy_to_group(latent, st.tp_group), copy_to_group(k_rope, st.tp_group)
        sparse = request.attention == "sparse"
        if request.attention not in ("dense", "sparse"):
            raise ValueError(f"attention must be 'dense' or 'sparse', got {request.attention!r}")
        form = request.mla_form if request.mla_form != "auto" else ("mqa" if sparse or cp is not None else "mha")
        if (sparse or cp is not None) and form != "mqa":
            raise ValueError("sparse and context-parallel attention run in the MQA (absorbed) form")
        if sparse or request.indexer_loss:
            q_idx, k_idx, w_idx = self.indexer(x.detach(), q_latent.detach(), cos, sin)

        if form == "mha":
            q, k, v = self.mha_qkv(q_nope, q_rope, latent, k_rope)
            out, _ = K.dense_attention(q, k, v, self.scale, doc_start)
            if request.indexer_loss:
                kl, stats = K.dense_indexer_kl(
                    q_idx, k_idx, w_idx, self._gather_heads(q.detach()), self._gather_heads(k.detach()), self.scale, doc_start
                )
                self._record_kl(aux, kl, stats)
            return self.o_proj(out.reshape(B, T, self.num_heads * self.v_dim)), aux

        q_abs, kv = self.mqa_qkv(q_nope, q_rope, latent, k_rope)
        if cp is None and not sparse:  # dense MQA on one CP rank
            out_latent, _ = K.dense_attention(q_abs, kv[:, :, None, :], latent[:, :, None, :], self.scale, doc_start)
            if request.indexer_loss:
                kl, stats = K.dense_indexer_kl(
                    q_idx, k_idx, w_idx, self._gather_heads(q_abs.detach()), kv.detach()[:, :, None, :], self.scale, doc_start
                )
                self._record_kl(aux, kl, stats)
        else:
            if cp is not None:
                kv_all = cp.gather(kv)  # [B, T_full, 576]: the only attention activations exchanged
                k_idx_all = cp.gather(k_idx) if (sparse or request.indexer_loss) else None  # [B, T_full, 128]
                if sparse:
                    indices = topk_at_positions(q_idx.detach(), k_idx_all.detach(), w_idx.detach(), doc_start,
                                                cp.positions, request.topk)
                else:
                    out_latent = self._dense_cp(aux, request, q_abs, kv_all, q_idx, k_idx_all, w_idx, doc_start, cp)
                    out = self.mqa_output(out_latent)
                    return self.o_proj(out.reshape(B, T, self.num_heads * self.v_dim)), aux
            else:
                kv_all, k_idx_all = kv, k_idx
                indices, _ = K.indexer_topk(q_idx.detach(), k_idx.detach(), w_idx.detach(), doc_start, request.topk)
            out_latent, lse = K.sparse_mla(q_abs, kv_all, indices, self.scale, self.kv_lora_rank)
            if request.indexer_loss:
                kl, stats = K.sparse_indexer_kl(
                    q_idx, k_idx_all, w_idx, indices, self._gather_heads(q_abs.detach()), kv_all.detach(),
                    self._gather_heads(lse.detach()), self.scale,
                )
                self._record_kl(aux, kl, stats)
            if request.recall_queries is not None and cp is None:
                aux.topk_recall = K.dense_mass_recall(
                    q_abs.detach(), kv.detach(), indices, self.scale, doc_start, request.recall_queries
                )
            if request.return_topk:
                aux.topk_indices = indices
        out = self.mqa_output(out_latent)
        return self.o_proj(out.reshape(B, T, self.num_heads * self.v_dim)), aux

    def _dense_cp(self, aux, request, q_abs, kv_all, q_idx, k_idx_all, w_idx, doc_start, cp):
        """Dense attention (and eq. 3) for this CP rank's queries, as the sparse kernels over every
        visible key, one query chunk at a time. Each chunk's index list [C, keys] is built inside a
        checkpointed function, so neither the forward nor the backward holds more than one chunk's
        (about 2^24 indices), never [T_loc, T]."""
        from torch.utils.checkpoint import checkpoint

        Tq, T = q_abs.shape[1], kv_all.shape[1]
        chunk = max(1, DENSE_CP_CHUNK_ELEMS // max(T * q_abs.shape[0], 1))
        q_heads = self._gather_heads(q_abs.detach()) if request.indexer_loss else None
        outs, kl_total, klu_total = [], None, 0.0

        def attend(q_c, kv, pos):
            idx = all_key_indices(doc_start, pos, int(pos.max()) + 1)
            return K.sparse_mla(q_c, kv, idx, self.scale, self.kv_lora_rank)

        def kl(qi, ki, wi, qm, lse, pos):
            idx = all_key_indices(doc_start, pos, int(pos.max()) + 1)
            value, stats = K.sparse_indexer_kl(qi, ki, wi, idx, qm, kv_all.detach(), lse, self.scale)
            return value, stats["kl_uniform"]

        for q0 in range(0, Tq, chunk):
            pos = cp.positions[q0 : q0 + chunk]
            o, lse = checkpoint(attend, q_abs[:, q0 : q0 + chunk], kv_all, pos, use_reentrant=False)
            outs.append(o)
            if request.indexer_loss:
                value, klu = checkpoint(
                    kl, q_idx[:, q0 : q0 + chunk], k_idx_all, w_idx[:, q0 : q0 + chunk], q_heads[:, q0 : q0 + chunk],
                    self._gather_heads(lse.detach()), pos, use_reentrant=False,
                )
                kl_total = value if kl_total is None else kl_total + value
                klu_total = klu_total + klu
        if request.indexer_loss:
            queries = torch.tensor(float(q_abs.shape[0] * Tq))
            self._record_kl(aux, kl_total, {"kl_uniform": klu_total, "queries": queries})
        return torch.cat(outs, dim=1)
