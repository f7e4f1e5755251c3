"""Context parallelism: each CP rank holds 2 of the sequence's 2*CP chunks, chunk r and chunk
2*CP-1-r, so causal attention work is the same on every rank (load balance).

Every CP rank receives the whole micro-batch (data is sharded by DP rank only) and keeps its
chunks: embeddings, MLA projections, the indexer, MoE and the LM head run on local tokens only.
Attention (`ParallelMLA`) all-gathers only the 576-dim latent KV and the 128-dim indexer key;
top-k is selected over the whole sequence. Losses are partial sums normalized by the whole
micro-batch's counts (LM: valid labels; indexer: query tokens), so they add up over CP ranks to
the single-process values; `dsa_train.parallel.step` sums gradients over CP accordingly.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn import functional as F

import dsa_kernels as K
from dsa_train.model.mla import AttentionRequest
from dsa_train.model.transformer import DSAOutput
from dsa_train.parallel.comm import all_gather_autograd
from dsa_train.parallel.groups import ParallelState


def local_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions of CP rank `rank`'s tokens: chunks rank and 2*cp-1-rank of 2*cp."""
    if seq_len % (2 * cp):
        raise ValueError(
            f"context parallel {cp} splits a sequence into {2 * cp} equal chunks: data.seq_len={seq_len} "
            f"must be a multiple of {2 * cp}"
        )
    L = seq_len // (2 * cp)
    a = torch.arange(rank * L, (rank + 1) * L, device=device)
    b = torch.arange((2 * cp - 1 - rank) * L, (2 * cp - rank) * L, device=device)
    return torch.cat([a, b])


@dataclass
class CPInfo:
    group: object
    size: int
    rank: int
    positions: torch.Tensor  # [T_loc] global positions of this rank's tokens
    inverse: torch.Tensor  # [T] index into the rank-ordered all-gather, for each global position

    @classmethod
    def build(cls, state: ParallelState, seq_len: int, device) -> "CPInfo":
        cp, r = state.sizes.context, state.cp_rank
        gathered = torch.cat([local_positions(seq_len, cp, i, device) for i in range(cp)])
        return cls(state.cp_group, cp, r, local_positions(seq_len, cp, r, device), torch.argsort(gathered))

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T_loc, ...] on every rank -> [B, T, ...] in sequence order (autograd)."""
        return all_gather_autograd(x, 1, self.group).index_select(1, self.inverse)


@dataclass
class CPRequest(AttentionRequest):
    cp: CPInfo | None = None


def cp_forward(
    self, input_ids, attention="dense", labels=None, indexer_loss=False, position_ids=None, compute_logits=True,
    topk=None, measure_topk_recall=0, mtp=False, mla_form="auto", return_topk=False, cu_seqlens=None,
) -> DSAOutput:
    """`DSAForCausalLM.forward` on this CP rank's share of the sequence. input_ids / labels /
    position_ids are the whole micro-batch [B, T]; logits are returned for local tokens only
    (`out.metrics["cp_positions"]` is not set; use `CPInfo.positions`)."""
    state: ParallelState = self._pstate
    B, T = input_ids.shape
    cfg = self.config
    if mtp:
        raise NotImplementedError("multi-token prediction loss under context parallelism")
    if position_ids is None:
        if cu_seqlens is not None:
            doc_start = K.doc_starts_from_cu_seqlens(cu_seqlens.to(input_ids.device), T)
            position_ids = torch.arange(T, device=input_ids.device)[None] - doc_start
        else:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
            doc_start = torch.zeros_like(position_ids)
    else:
        position_ids = position_ids.expand(B, T)
        doc_start = K.doc_starts_from_position_ids(position_ids)
    if int(position_ids.max()) >= cfg.max_position_embeddings:
        raise ValueError(f"position {int(position_ids.max())} is beyond max_position_embeddings={cfg.max_position_embeddings}")
    info = CPInfo.build(state, T, input_ids.device)
    pos = info.positions
    request = CPRequest(attention=attention, indexer_loss=indexer_loss, topk=topk or cfg.index_topk,
                        mla_form="mqa", return_topk=return_topk, cp=info)
    cos, sin = self.model.rotary_emb(position_ids[:, pos])
    h = self.model.embed_tokens(input_ids[:, pos])
    auxes = []
    for layer in self.main_layers():
        h, aux = layer(h, cos, sin, doc_start, request)
        auxes.append(aux)
    out = DSAOutput()
    if compute_logits or labels is not None:
        out.logits = self.lm_head(self.model.norm(h))
        if labels is not None:
            n_valid = max(int((labels != -100).sum()), 1)
            ce = F.cross_entropy(out.logits.float().reshape(-1, out.logits.shape[-1]), labels[:, pos].reshape(-1),
                                 ignore_index=-100, reduction="sum")
            out.lm_loss = ce / n_valid  # partial: sums over CP ranks to the mean over the sequence
    if indexer_loss:
        queries = float(B * T)
        out.indexer_loss = torch.stack([a.indexer_kl_sum / queries for a in auxes]).mean()
        sums = torch.tensor([[float(a.indexer_kl_sum.detach()), float(a.indexer_kl_uniform_sum)] for a in auxes],
                            dtype=torch.float64)
        dist.all_reduce(sums, group=info.group)
        for i, (kl, klu) in enumerate(sums.tolist()):
            out.metrics[f"indexer_kl/layer_{i}"] = kl / queries
        out.metrics["indexer_kl"] = float(sums[:, 0].mean()) / queries
        out.metrics["indexer_kl_uniform"] = float(sums[:, 1].mean()) / queries
        out.metrics["indexer_kl_captured"] = 1.0 - out.metrics["indexer_kl"] / max(out.metrics["indexer_kl_uniform"], 1e-12)
    if return_topk:
        out.topk_indices = [a.topk_indices for a in auxes]
    self._moe_metrics(out.metrics)
    return out


def enable_context_parallel(model, state: ParallelState) -> None:
    from dsa_train.parallel.attention import ParallelMLA

    for layer in model.model.layers:
        if not isinstance(layer.self_attn, ParallelMLA):
            ParallelMLA.convert(layer.self_attn, state)
    model._pstate = state
    model.forward = types.MethodType(cp_forward, model)
