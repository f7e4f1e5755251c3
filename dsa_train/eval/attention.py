"""Per-layer attention measurements from the layer's own weights (a plain PyTorch reference path).

For one MLA layer and its input x (the normalized hidden state its forward receives) this module
recomputes, in the MQA (absorbed) form the sparse path runs in:

    q_abs [B, T, H, C + R], kv [B, T, C + R]            (C = kv_lora_rank, R = qk_rope_head_dim)
    mass[t, s] = (1/H) sum_h softmax_s(scale * q_abs[t, h] . kv[s])     over the keys t may see

`mass` is the head-summed, L1-normalized dense attention of query t: the warm-up's target (report
eq. 3). From it:

  * oracle top-k: the k keys with the most mass (ties to the lower key index), the selection a
    perfect indexer would make;
  * top-k recall: the mass inside a selected set (1 where k covers every visible key);
  * oracle overlap: |selected ∩ oracle| / |oracle|, and the intersection size itself (which, unlike
    the fraction, never decreases as k grows);
  * KL-captured: 1 - KL(mass || indexer softmax) / KL(mass || uniform) over the visible keys, as
    `indexer_kl_captured` in training (docs/training.md), summed over queries before the ratio;
  * FP8 overlap: the indexer's top-k scored with bf16 q_I / k_I against e4m3 q_I / k_I with one
    scale per 128 channels (per token, and per head for q; power-of-two scales with ue8m0), the
    quantizer of the FP8 indexer kernel and of a sparse stage's `index_scores: fp8`
    (`dsa_kernels.ops.indexer_topk.fp8_emulated`, DeepSeek-V3.2's act_quant).

Every [queries, keys] block exists one query chunk at a time (`chunk_queries`): memory is bounded
by `BLOCK_ELEMS` fp32 elements per block whatever T is.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

import dsa_kernels as K
from dsa_kernels.masking import chunk_valid_mask
from dsa_kernels.ops.indexer_topk import index_scores_block, topk_from_scores
from dsa_kernels.ops.indexer_topk import fp8_emulated


BLOCK_ELEMS = 1 << 24  # fp32 elements of one [chunk, heads, keys] logit block (64 MB)


def chunk_queries(T: int, per_query_elems: int, budget: int = BLOCK_ELEMS) -> list[tuple[int, int]]:
    """Query ranges [q0, q1) whose [q1 - q0, per_query_elems] blocks stay within `budget`."""
    step = max(1, min(T, budget // max(per_query_elems, 1)))
    return [(q0, min(q0 + step, T)) for q0 in range(0, T, step)]


# ---------------------------------------------------------------------------- projections
@dataclass
class LayerTensors:
    """What the measurements need from one layer's forward input."""

    q_abs: torch.Tensor  # [B, T, H, C + R] absorbed queries
    kv: torch.Tensor  # [B, T, C + R] the shared key [latent | k_rope]
    q_index: torch.Tensor  # [B, T, H_I, D_I] indexer queries
    k_index: torch.Tensor  # [B, T, D_I] indexer key
    w_index: torch.Tensor  # [B, T, H_I] fp32 indexer head weights
    doc_start: torch.Tensor  # [B, T]
    scale: float


@torch.no_grad()
def layer_tensors(attn: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  doc_start: torch.Tensor) -> LayerTensors:
    q_latent, q_nope, q_rope, latent, k_rope = attn.project(x, cos, sin)
    q_abs, kv = attn.mqa_qkv(q_nope, q_rope, latent, k_rope)
    q_index, k_index, w_index = attn.indexer(x, q_latent, cos, sin)
    return LayerTensors(q_abs, kv, q_index, k_index, w_index, doc_start, float(attn.config.softmax_scale))


def attention_mass(lt: LayerTensors, q0: int, q1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Head-summed L1-normalized dense attention of queries [q0, q1) over all T keys ->
    (mass [B, C, T] fp32, zero where invalid; visible [B, C, T] bool)."""
    T = lt.kv.shape[1]
    visible = chunk_valid_mask(lt.doc_start, q0, q1, 0, T)  # [B, C, T]
    logits = torch.einsum("bchd,bsd->bhcs", lt.q_abs[:, q0:q1].float(), lt.kv.float()) * lt.scale
    logits = logits.masked_fill(~visible[:, None], float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # [B, H, C, T]
    return probs.mean(dim=1), visible


def oracle_topk_chunk(mass: torch.Tensor, visible: torch.Tensor, topk: int) -> torch.Tensor:
    """The `topk` keys with the most mass per query -> [B, C, topk] int32, -1 = empty slot."""
    return topk_from_scores(mass.masked_fill(~visible, float("-inf")), topk)[0]


@torch.no_grad()
def oracle_topk(lt: LayerTensors, topk: int) -> torch.Tensor:
    """Oracle top-k of every query -> [B, T, topk] int32."""
    B, T, H, _ = lt.q_abs.shape
    return torch.cat([oracle_topk_chunk(*attention_mass(lt, q0, q1), topk)
                      for q0, q1 in chunk_queries(T, B * H * T)], dim=1)


# ---------------------------------------------------------------------------- set measures
def _members(indices: torch.Tensor, T: int) -> torch.Tensor:
    """indices [B, C, k] (-1 = empty) -> [B, C, T] bool membership."""
    member = torch.zeros(*indices.shape[:2], T + 1, dtype=torch.bool, device=indices.device)
    member.scatter_(-1, torch.where(indices < 0, T, indices).long(), True)
    return member[..., :T]


def mass_inside(mass: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Attention mass inside the selected keys: mass [B, C, T], indices [B, C, k] -> [B, C]."""
    return (mass * _members(indices, mass.shape[-1])).sum(-1)


def set_overlap(selected: torch.Tensor, reference: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """selected, reference [B, C, k] -> (|selected ∩ reference| / |reference| [B, C], 1 for an empty
    reference; |selected ∩ reference| [B, C])."""
    a, b = _members(selected, T), _members(reference, T)
    inter = (a & b).sum(-1).float()
    size = b.sum(-1).float()
    return torch.where(size > 0, inter / size.clamp(min=1), torch.ones_like(inter)), inter


def indexer_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Eq. 1 scores of a query chunk over all keys, -inf where invalid: q [B, C, H_I, D_I],
    k [B, T, D_I], w [B, C, H_I], visible [B, C, T] -> [B, C, T] fp32."""
    return index_scores_block(q, k, w).masked_fill(~visible, float("-inf"))


def fp8_rounded(x: torch.Tensor, ue8m0: bool) -> torch.Tensor:
    """x [..., D] through e4m3 with one scale per 128 channels, as fp32: the FP8 indexer's quantizer
    (`dsa_kernels.ops.indexer_topk.fp8_emulated`, the training switch `index_scores: fp8` uses it too)."""
    return fp8_emulated(x, ue8m0)


def fp8_topk_overlap(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, visible: torch.Tensor, topk: int,
                     ue8m0: bool = False) -> torch.Tensor:
    """Top-k overlap between bf16 and FP8 (e4m3) index scoring of one query chunk -> [B, C]:
    |S_fp8 ∩ S_bf16| / |S_bf16|. q [B, C, H_I, D_I], k [B, T, D_I], w [B, C, H_I], visible [B, C, T]."""
    bf16 = indexer_scores(q.bfloat16().float(), k.bfloat16().float(), w, visible)
    # inference quantizes its bf16 q_I / k_I: the FP8 side starts from the same bf16 values
    fp8 = indexer_scores(fp8_rounded(q.bfloat16(), ue8m0), fp8_rounded(k.bfloat16(), ue8m0), w, visible)
    T = visible.shape[-1]
    return set_overlap(topk_from_scores(fp8, topk)[0], topk_from_scores(bf16, topk)[0], T)[0]


def kl_sums(mass: torch.Tensor, scores: torch.Tensor, visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(KL(mass || softmax(scores)), KL(mass || uniform)) summed over the chunk's queries, both over
    the visible keys; fp32."""
    log_q = torch.log_softmax(scores, dim=-1)
    p = mass
    log_p = torch.where(p > 0, p.clamp(min=1e-30).log(), torch.zeros_like(p))
    kl = torch.where(p > 0, p * (log_p - log_q.masked_fill(~visible, 0.0)), torch.zeros_like(p)).sum(-1)
    n = visible.sum(-1).clamp(min=1).float()
    kl_uniform = (torch.where(p > 0, p * log_p, torch.zeros_like(p)).sum(-1) + n.log())
    return kl.sum(), kl_uniform.sum()


# ---------------------------------------------------------------------------- one layer
@dataclass
class LayerStats:
    """Sums over queries of one layer's measurements (ratios formed by `values`)."""

    queries: float = 0.0
    recall: float = 0.0  # mass inside the indexer's top-k
    oracle_recall: float = 0.0  # mass inside the oracle top-k
    oracle_overlap: float = 0.0  # |indexer ∩ oracle| / |oracle|
    oracle_intersection: float = 0.0  # |indexer ∩ oracle|
    kl: float = 0.0
    kl_uniform: float = 0.0
    fp8_overlap: float = 0.0
    fp8_queries: float = 0.0

    def add(self, other: "LayerStats") -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def values(self) -> dict[str, float]:
        n = max(self.queries, 1.0)
        out = {
            "topk_recall": self.recall / n,
            "oracle_recall": self.oracle_recall / n,
            "oracle_overlap": self.oracle_overlap / n,
            "oracle_intersection": self.oracle_intersection / n,
            "indexer_kl_captured": 1.0 - self.kl / self.kl_uniform if self.kl_uniform > 0 else 1.0,
        }
        if self.fp8_queries:
            out["fp8_overlap"] = self.fp8_overlap / self.fp8_queries
        return out


@torch.no_grad()
def measure_layer(lt: LayerTensors, topk: int, fp8: bool = True, ue8m0: bool = False) -> LayerStats:
    """The layer's recall, oracle overlap, KL-captured and (fp8=True) FP8 overlap, summed over queries."""
    B, T, H, _ = lt.q_abs.shape
    indexer_idx = K.indexer_topk(lt.q_index, lt.k_index, lt.w_index, lt.doc_start, topk)[0]  # the model's selection
    stats = LayerStats()
    for q0, q1 in chunk_queries(T, B * max(H, lt.q_index.shape[2]) * T):
        mass, visible = attention_mass(lt, q0, q1)
        selected = indexer_idx[:, q0:q1]
        oracle = oracle_topk_chunk(mass, visible, topk)
        overlap, inter = set_overlap(selected, oracle, T)
        scores = indexer_scores(lt.q_index[:, q0:q1], lt.k_index, lt.w_index[:, q0:q1], visible)
        kl, kl_uniform = kl_sums(mass, scores, visible)
        stats.queries += B * (q1 - q0)
        stats.recall += float(mass_inside(mass, selected).sum())
        stats.oracle_recall += float(mass_inside(mass, oracle).sum())
        stats.oracle_overlap += float(overlap.sum())
        stats.oracle_intersection += float(inter.sum())
        stats.kl += float(kl)
        stats.kl_uniform += float(kl_uniform)
        if fp8:
            stats.fp8_overlap += float(fp8_topk_overlap(lt.q_index[:, q0:q1], lt.k_index, lt.w_index[:, q0:q1],
                                                        visible, topk, ue8m0).sum())
            stats.fp8_queries += B * (q1 - q0)
    return stats


@torch.no_grad()
def oracle_attention_output(attn: nn.Module, lt: LayerTensors, topk: int) -> torch.Tensor:
    """The layer's attention output when every query reads its oracle top-k keys (the sparse MQA
    path with the oracle's indices) -> [B, T, hidden]."""
    B, T = lt.kv.shape[:2]
    out_latent, _ = K.sparse_mla(lt.q_abs, lt.kv, oracle_topk(lt, topk), lt.scale, attn.config.kv_lora_rank)
    return attn.o_proj(attn.mqa_output(out_latent).reshape(B, T, -1))


# ---------------------------------------------------------------------------- hooks
def attention_layers(model: nn.Module) -> list[nn.Module]:
    """The MLA module of every main decoder layer (not the MTP module)."""
    return [layer.self_attn for layer in model.model.layers[: model.config.num_hidden_layers]]


def _input_of(attn: nn.Module, args: tuple, kwargs: dict) -> tuple[torch.Tensor, ...]:
    """(x, cos, sin, doc_start) of an MLA forward call, however it was called."""
    bound = inspect.signature(attn.forward).bind(*args, **kwargs)
    a = bound.arguments
    return a["x"], a["cos"], a["sin"], a["doc_start"]


@contextmanager
def layer_hooks(model: nn.Module, on_layer: Callable[[int, nn.Module, LayerTensors], torch.Tensor | None]):
    """Within the block, every main layer's attention calls `on_layer(i, attn, tensors)` after its
    forward; a tensor returned replaces the layer's attention output (its aux stays)."""

    def make(i: int):
        def hook(attn, args, kwargs, output):
            lt = layer_tensors(attn, *_input_of(attn, args, kwargs))
            replaced = on_layer(i, attn, lt)
            if replaced is None:
                return None
            return (replaced.to(output[0].dtype), *output[1:])
        return hook

    handles = [attn.register_forward_hook(make(i), with_kwargs=True) for i, attn in enumerate(attention_layers(model))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@dataclass
class LayerMeasurements:
    """`on_layer` callback of `layer_hooks` accumulating `measure_layer` per layer."""

    topk: int
    fp8: bool = True
    ue8m0: bool = False
    layers: dict[int, LayerStats] = field(default_factory=dict)

    def __call__(self, i: int, attn: nn.Module, lt: LayerTensors) -> None:
        self.layers.setdefault(i, LayerStats()).add(measure_layer(lt, self.topk, self.fp8, self.ue8m0))
        return None
