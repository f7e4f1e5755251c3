"""The DeepSeek-V3 decoder with DSA attention, multi-token prediction, and the causal-LM head.

Parameter names are Hugging Face's, so state dicts map 1:1 onto V3 / V3.2 checkpoints:
`model.embed_tokens`, `model.layers.{i}.{input_layernorm,self_attn,post_attention_layernorm,mlp}`,
`model.norm`, `lm_head`; the MTP module is `model.layers.{num_hidden_layers}` with `embed_tokens`,
`enorm`, `hnorm`, `eh_proj`, `shared_head.{norm,head}` beside its own attention and MoE.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

import dsa_kernels as K

from .config import DSAConfig
from .mla import MLA, AttentionAux, AttentionRequest
from .moe import MLP, MoE
from .norm import RMSNorm
from .dtypes import FP32_PARAMETERS
from .dtypes import apply as apply_dtype_policy
from .rope import RotaryEmbedding
from ..loss import cross_entropy_sum, metric_values, mtp_targets

# Kept in fp32 whatever the model dtype: the policy is dsa_train/model/dtypes.py.
FP32_PARAM_SUFFIXES = FP32_PARAMETERS


@dataclass
class DSAOutput:
    """What a forward returns. Nothing in it has been read back to the host: the stats stay on
    the device until `dsa_train.loss.MetricSums` reduces a whole step's at once; `lm_loss`,
    `mtp_loss` and `metrics` read their token counts / stats when accessed."""

    logits: torch.Tensor | None = None  # [B, T, V]
    indexer_loss: torch.Tensor | None = None  # mean over layers of (KL sum / query tokens)
    topk_indices: list[torch.Tensor] | None = None  # per layer [B, T, k] when return_topk
    # Sums over the tokens this process holds (all of them without context parallelism), from
    # which `dsa_train.loss` forms the step's loss with global token counts:
    lm_loss_sum: torch.Tensor | None = None  # CE summed over valid labels
    lm_tokens: torch.Tensor | None = None  # number of valid labels (0-dim int64, on the device)
    mtp_loss_sum: torch.Tensor | None = None  # CE summed over valid MTP targets
    mtp_tokens: torch.Tensor | None = None  # number of valid MTP targets (0-dim int64)
    indexer_kl_sum: torch.Tensor | None = None  # mean over layers of the KL summed over queries
    # metric: (numerator, denominator), each a 0-dim tensor on the device or a Python float
    stats: dict[str, tuple[torch.Tensor | float, torch.Tensor | float]] = field(default_factory=dict)

    @property
    def lm_loss(self) -> torch.Tensor | None:
        """Mean CE over this forward's valid labels (reads their count from the device)."""
        return None if self.lm_loss_sum is None else self.lm_loss_sum / max(float(self.lm_tokens), 1.0)

    @property
    def mtp_loss(self) -> torch.Tensor | None:
        return None if self.mtp_loss_sum is None else self.mtp_loss_sum / max(float(self.mtp_tokens), 1.0)

    @property
    def metrics(self) -> dict[str, float]:
        """This forward's metrics (indexer_kl, topk_recall, MoE load, ...), read from the device."""
        return metric_values({key: (float(num), float(den)) for key, (num, den) in self.stats.items()})


def mean_over_layers(values: list[torch.Tensor]) -> torch.Tensor:
    """sum(values) / len(values) in float64 on the device, added one layer at a time from 0.0:
    the value Python's `sum(float(v) for v in values) / len(values)` gives, without reading any
    back. (The divisor is a device tensor: a true division, as Python's.)"""
    total = torch.zeros((), dtype=torch.float64, device=values[0].device)
    for v in values:
        total = total + v.detach().double()
    return total / torch.full((), float(len(values)), dtype=torch.float64, device=total.device)


def _check_max_position(max_position: int, limit: int) -> None:
    """One line naming the position and the fix when `max_position` is beyond the model's RoPE range."""
    if max_position >= limit:
        raise ValueError(
            f"position {max_position} is beyond max_position_embeddings={limit}; restart position_ids at 0 "
            f"at each packed document, shorten the sequences, or use a model with a longer context"
        )


class DecoderLayer(nn.Module):
    def __init__(self, config: DSAConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLA(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.is_moe = config.is_moe_layer(layer_idx)  # routed experts (MoE) or a dense MLP, fixed here
        self.mlp = MoE(config) if self.is_moe else MLP(config.hidden_size, config.intermediate_size)
        # activation recompute of this layer (set from outside, `parallelize_model`):
        # "none" | "attention" | "moe" | "full" (the whole layer)
        self.recompute = "none"

    def forward(self, h, cos, sin, doc_start, request: AttentionRequest) -> tuple[torch.Tensor, AttentionAux]:
        if request.main_frozen:
            return self._forward_frozen(h, cos, sin, doc_start, request)
        if self.recompute == "full":
            return _checkpointed(self._forward, h, cos, sin, doc_start, request)
        return self._forward(h, cos, sin, doc_start, request)

    def _forward(self, h, cos, sin, doc_start, request):
        x = self.input_layernorm(h)
        if self.recompute == "attention":
            attn_out, aux = _checkpointed(self.self_attn, x, cos, sin, doc_start, request)
        else:
            attn_out, aux = self.self_attn(x, cos, sin, doc_start, request)
        h = h + attn_out
        x = self.post_attention_layernorm(h)
        if self.recompute == "moe" and self.is_moe:
            return h + _checkpointed(self.mlp, x), aux
        return h + self.mlp(x), aux

    def _forward_frozen(self, h, cos, sin, doc_start, request):
        """The main model frozen (the dense warm-up): norms, attention and MLP run once without
        autograd, whatever `recompute` says; the attention layer's indexer and KL are the only
        graph, recomputed in the backward when `recompute` covers the attention."""
        with torch.no_grad():
            x = self.input_layernorm(h)
        attn_out, aux = self.self_attn(x, cos, sin, doc_start, request,
                                       recompute_indexer=self.recompute in ("full", "attention"))
        with torch.no_grad():
            h = h + attn_out
            return h + self.mlp(self.post_attention_layernorm(h)), aux


def _checkpointed(fn, *args):
    """fn(*args) with its activations recomputed in the backward (non-reentrant checkpoint;
    collectives inside run again in the same order on every rank)."""
    if not torch.is_grad_enabled():
        return fn(*args)
    from torch.utils.checkpoint import checkpoint

    from .recompute import topk_reuse_contexts  # the recompute replays the forward's top-k indices

    return checkpoint(fn, *args, use_reentrant=False, context_fn=topk_reuse_contexts)


class SharedHead(nn.Module):
    def __init__(self, config: DSAConfig):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


class MTPLayer(DecoderLayer):
    """Multi-token prediction module: predicts token t+2 from h_t and the embedding of token t+1.
    h' = eh_proj([enorm(emb(x_{t+1})) ; hnorm(h_t)]) -> decoder block -> shared_head."""

    def __init__(self, config: DSAConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.shared_head = SharedHead(config)

    def predict(self, h, next_ids, cos, sin, doc_start, request) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(self.embed_tokens(next_ids)), self.hnorm(h)], dim=-1))
        x, _ = super().forward(x, cos, sin, doc_start, request)
        return self.shared_head.head(self.shared_head.norm(x))


class DSAModel(nn.Module):
    def __init__(self, config: DSAConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        layers: list[nn.Module] = [DecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        layers += [
            MTPLayer(config, config.num_hidden_layers + j) for j in range(config.num_nextn_predict_layers or 0)
        ]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class DSAForCausalLM(nn.Module):
    """DeepSeek-V3 / V3.2 causal LM whose attention runs dense MLA or DeepSeek Sparse Attention."""

    def __init__(self, config: DSAConfig, *, init_weights: bool = True):
        """init_weights=False leaves parameters as constructed (the meta-device start-up builds the
        model with parameters on meta and loads every one of them: nothing to initialize)."""
        super().__init__()
        config.validate()
        self.config = config
        self.model = DSAModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # context parallelism, applied from outside (dsa_train.parallel.context.ContextParallel):
        # an object whose `for_sequence(T, device)` gives this rank's CP handle; None: one process
        self.context_parallel = None
        if init_weights:
            self.init_weights()

    # ------------------------------------------------------------------ init
    @torch.no_grad()
    def init_weights(self) -> None:
        std = self.config.initializer_range
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, std)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, (RMSNorm, nn.LayerNorm)):
                module.reset_parameters() if isinstance(module, nn.LayerNorm) else module.weight.fill_(1.0)
            elif isinstance(module, MoE):
                module.gate.weight.normal_(0.0, std)
                module.gate.e_score_correction_bias.zero_()
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def cast(self, dtype: torch.dtype) -> "DSAForCausalLM":
        """Cast to dtype under the dtype policy (dsa_train/model/dtypes.py): the indexer's
        weights_proj / k_norm and every buffer (router biases, token loads, RoPE frequencies, the
        Hadamard matrix) stay fp32."""
        return apply_dtype_policy(self, dtype)

    # ------------------------------------------------------------------ params
    def main_layers(self) -> list[DecoderLayer]:
        return list(self.model.layers[: self.config.num_hidden_layers])

    def mtp_layers(self) -> list[MTPLayer]:
        return list(self.model.layers[self.config.num_hidden_layers :])

    @torch.no_grad()
    def update_router_bias(self, rate: float) -> None:
        """Aux-loss-free balancing step from the expert loads of all training-mode forwards since
        the previous update (every micro-batch of a step), or of the last forward."""
        for module in self.modules():
            if isinstance(module, MoE):
                module.update_bias(rate)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.Tensor,
        attention: str = "dense",
        labels: torch.Tensor | None = None,
        indexer_loss: bool = False,
        position_ids: torch.Tensor | None = None,
        compute_logits: bool = True,
        topk: int | None = None,
        measure_topk_recall: int = 0,
        mtp: bool = False,
        mla_form: str = "auto",
        return_topk: bool = False,
        cu_seqlens: torch.Tensor | None = None,
        index_scores: str = "bf16",
        *,
        positions_checked: bool = False,
    ) -> DSAOutput:
        """input_ids [B, T]; position_ids [B, T] restart at 0 where a packed document starts (or
        cu_seqlens [n_docs + 1] for a single packed row). labels [B, T] are next-token targets
        (-100 ignored). See README "Public API".

        Positions must stay below `config.max_position_embeddings` (a ValueError otherwise). The
        positions the forward makes (position_ids None) are checked from T alone; given
        position_ids are read back (`position_ids.max()`: on a GPU a device synchronization)
        unless `positions_checked=True`, with which the caller guarantees the bound: the trainer
        (`dsa_train.trainer.step`), whose rows of data.seq_len <= max_position_embeddings (checked
        at start-up) restart their positions at 0 at every document.

        With context parallelism applied (`self.context_parallel`, set by
        `dsa_train.parallel.model.parallelize_model`) every rank passes the whole micro-batch and
        runs the tokens it holds; logits, losses and stats are then this rank's share."""
        B, T = input_ids.shape
        cfg = self.config
        limit = cfg.max_position_embeddings
        if position_ids is None:
            if cu_seqlens is not None:
                if B != 1:
                    raise ValueError("cu_seqlens describes one packed row; pass position_ids for B > 1")
                doc_start = K.doc_starts_from_cu_seqlens(cu_seqlens.to(input_ids.device), T)
                position_ids = torch.arange(T, device=input_ids.device)[None] - doc_start
                if T > limit:  # positions <= T - 1 always; beyond the limit only the documents' lengths tell
                    _check_max_position(int(position_ids.max()), limit)
            else:
                if T > limit:  # positions 0 .. T - 1: known without reading anything
                    raise ValueError(
                        f"a sequence of {T} tokens has positions up to {T - 1}, beyond max_position_embeddings="
                        f"{limit}; pass at most {limit} tokens per row, or position_ids restarting at 0 at each "
                        f"packed document, or use a model with a longer context"
                    )
                position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
                doc_start = torch.zeros_like(position_ids)
        else:
            if position_ids.shape != input_ids.shape:
                position_ids = position_ids.expand(B, T)
            doc_start = K.doc_starts_from_position_ids(position_ids)
            if not positions_checked:  # on a GPU this read waits for the device
                _check_max_position(int(position_ids.max()), limit)
        # context parallelism: this rank's share of the sequence (global positions [T_loc])
        cp = self.context_parallel.for_sequence(T, input_ids.device) if self.context_parallel is not None else None
        local = (lambda t: t) if cp is None else (lambda t: t[:, cp.positions])  # noqa: E731
        request = AttentionRequest(
            attention=attention,
            indexer_loss=indexer_loss,
            topk=topk or cfg.index_topk,
            index_scores=index_scores,
            mla_form=mla_form,
            return_topk=return_topk,
            context=cp,
            # the frozen-main path is the dense warm-up's (MHA form); other frozen runs take the general one
            main_frozen=attention == "dense" and mla_form in ("auto", "mha") and self.main_frozen(),
        )
        if measure_topk_recall and attention == "sparse":
            g = torch.Generator().manual_seed(T)
            n = min(measure_topk_recall, T)
            request.recall_queries = torch.randperm(T, generator=g)[:n].sort().values

        cos, sin = self.model.rotary_emb(local(position_ids))
        h = self.model.embed_tokens(local(input_ids))
        auxes: list[AttentionAux] = []
        for layer in self.main_layers():
            h, aux = layer(h, cos, sin, doc_start, request)
            auxes.append(aux)

        out = DSAOutput()
        if compute_logits or labels is not None:
            out.logits = self.lm_head(self.model.norm(h))
            if labels is not None:
                out.lm_loss_sum, out.lm_tokens = cross_entropy_sum(out.logits, local(labels))
                out.stats["lm_loss"] = (out.lm_loss_sum.detach(), out.lm_tokens)
        if mtp and labels is not None and self.mtp_layers() and T > 1:
            # position t sees h_t and token t+1 (the last position: any token, its target ignored)
            next_ids = torch.cat([input_ids[:, 1:], input_ids[:, -1:]], dim=1)
            mtp_request = AttentionRequest(attention=request.attention, topk=request.topk, context=cp,
                                           index_scores=request.index_scores)
            logits = self.mtp_layers()[0].predict(h, local(next_ids), cos, sin, doc_start, mtp_request)
            out.mtp_loss_sum, out.mtp_tokens = cross_entropy_sum(logits, local(mtp_targets(labels)))
            out.stats["mtp_loss"] = (out.mtp_loss_sum.detach(), out.mtp_tokens)
        if indexer_loss:
            queries = auxes[0].indexer_queries
            out.indexer_kl_sum = torch.stack([a.indexer_kl_sum for a in auxes]).mean()
            out.indexer_loss = out.indexer_kl_sum / max(queries, 1.0)
            for i, a in enumerate(auxes):
                out.stats[f"indexer_kl/layer_{i}"] = (a.indexer_kl_sum.detach(), queries)
            out.stats["indexer_kl"] = (out.indexer_kl_sum.detach(), queries)
            uniform = mean_over_layers([a.indexer_kl_uniform_sum for a in auxes])
            out.stats["indexer_kl_uniform"] = (uniform, queries)
        if request.recall_queries is not None:
            recall = mean_over_layers([a.topk_recall_sum for a in auxes])
            out.stats["topk_recall"] = (recall, auxes[0].topk_recall_count)
        if return_topk:
            out.topk_indices = [a.topk_indices for a in auxes]
        self._moe_stats(out.stats)
        return out

    def main_frozen(self) -> bool:
        """No parameter but the indexer's trains (the dense warm-up's `Stage.select_trainable`):
        the main model then runs without autograd and is never recomputed (`DecoderLayer._forward_frozen`)."""
        return not any(p.requires_grad for name, p in self.named_parameters() if ".indexer." not in name)

    def _moe_stats(self, stats: dict) -> None:
        """Expert-load balance of this forward over the main MoE layers (each ran on this
        forward's tokens, so each load sums to tokens x experts per token > 0)."""
        loads = [m.last_expert_load for m in self.main_moe_modules()]
        if not loads:
            return
        load = torch.stack(loads)  # [L_moe, E]
        frac = load / load.sum(-1, keepdim=True)
        stats["moe/expert_load_min"] = (frac.min(-1).values.mean(), 1.0)
        stats["moe/expert_load_max"] = (frac.max(-1).values.mean(), 1.0)
        stats["moe/expert_load_cv"] = ((frac.std(-1) / frac.mean(-1)).mean(), 1.0)

    def main_moe_modules(self) -> list[MoE]:
        return [layer.mlp for layer in self.main_layers() if layer.is_moe]

