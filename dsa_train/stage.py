"""A stage of the continued-pretraining chain as a type: what trains, how the forward is called,
which loss terms count and what a step costs.

A recipe's stage is `config.StageConfig` (the Hydra schema: attention, trainable, loss
coefficients, schedule). `Stage.of(name, stage_config)` reads it once; the engines' parameter
selection, the step, the probes, the FLOPs count (the trainer's MFU and the plan's step time:
`Stage.step_flops`), the planner, the profiles and the summary ask
the `Stage`, none of them reads `trainable` or the loss coefficients itself.

The value of `stages.<name>.trainable` names a `StageKind` declared in `STAGE_KINDS` below: which
parameters train, whether the main model (everything but the indexer) runs a backward, whether the
FLOPs count the LM head, whether the indexer's KL target recomputes the main attention scores, and the
kind's own config rules. Adding a kind is one entry here plus the recipe (docs/stages.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable

from dsa_train.errors import DSATrainError

if TYPE_CHECKING:  # annotations only: the config schema imports this module, and must not load the model
    import torch

    from dsa_train.model.config import DSAConfig

__all__ = ["STAGE_KINDS", "Stage", "StageKind", "UnknownStageKind", "register_stage_kind", "stage_kind"]


class UnknownStageKind(DSATrainError, ValueError):
    """A recipe's `trainable` names no declared stage kind."""


def _value(setting) -> str:
    """The string of a config enum member (`Attention.sparse` -> "sparse") or of a plain string."""
    return str(getattr(setting, "value", setting))


@dataclass(frozen=True)
class StageKind:
    """What one value of `stages.<name>.trainable` means."""

    name: str
    # parameter name -> whether this kind trains it
    trains: Callable[[str], bool]
    # the main model's weights receive gradients: its backward runs, its activations are kept for it
    # and its parameters have optimizer state (planner, FLOPs); False: it runs forward only and
    # the planner counts the indexer's parameters as the trainable set
    main_backward: bool
    # the FLOPs count the LM head (forward, and backward with `main_backward`)
    lm_head: bool
    # the indexer's KL target recomputes the main attention scores once more (FLOPs)
    kl_recomputes_main_scores: bool
    # StageConfig -> [(field, message)]: values this kind rejects, for the config check to report
    # as `stages.<name>.<field>: <message>`
    config_errors: Callable[[object], list[tuple[str, str]]] = field(default=lambda config: [])
    summary: str = ""


def _indexer_only_errors(config) -> list[tuple[str, str]]:
    errors = []
    if not config.indexer_loss_coef > 0:
        errors.append(("indexer_loss_coef", "an indexer-only stage needs the indexer loss"))
    if config.lm_loss_coef != 0:
        errors.append(("lm_loss_coef", "the LM loss does not reach the indexer (its input is detached); use 0"))
    if config.router_bias_update_rate != 0:
        errors.append(("router_bias_update_rate", "the router is frozen in an indexer-only stage"))
    return errors


def _is_indexer_parameter(name: str) -> bool:
    return ".indexer." in name


def _every_parameter(name: str) -> bool:
    return True


STAGE_KINDS: dict[str, StageKind] = {}


def register_stage_kind(kind: StageKind) -> StageKind:
    """Declares a kind under its name (the value a recipe's `trainable` takes)."""
    if kind.name in STAGE_KINDS:
        raise ValueError(f"stage kind {kind.name!r} is declared twice; give the new kind another name")
    STAGE_KINDS[kind.name] = kind
    return kind


def stage_kind(name) -> StageKind:
    """The kind a `trainable` value names; `UnknownStageKind` naming the known kinds otherwise."""
    key = _value(name)
    if key not in STAGE_KINDS:
        raise UnknownStageKind(f"trainable={key}: no such stage kind",
                               f"use one of {', '.join(STAGE_KINDS)} or declare it in dsa_train/stage.py (docs/stages.md)")
    return STAGE_KINDS[key]


# dense warm-up (report section 2.1.1): the indexer learns the frozen model's attention (eq. 3)
register_stage_kind(StageKind(
    "indexer", trains=_is_indexer_parameter, main_backward=False, lm_head=False, kl_recomputes_main_scores=True,
    config_errors=_indexer_only_errors, summary="parameters with '.indexer.' in their name; everything else frozen",
))
# sparse training: every parameter; the indexer (detached input) still learns from its own loss (eq. 4)
register_stage_kind(StageKind(
    "all", trains=_every_parameter, main_backward=True, lm_head=True, kl_recomputes_main_scores=False,
    summary="every parameter",
))


@dataclass(frozen=True)
class Stage:
    """One stage of a recipe: its name, its `StageConfig` (`config`) and its kind."""

    name: str
    config: object  # dsa_train.config.StageConfig
    kind: StageKind

    @classmethod
    def of(cls, name: str, config) -> Stage:
        return cls(name, config, stage_kind(config.trainable))

    # ------------------------------------------------------------------ attention
    @property
    def attention(self) -> str:
        """"dense" or "sparse" (the model's `attention` argument)."""
        return _value(self.config.attention)

    @property
    def sparse(self) -> bool:
        return self.attention == "sparse"

    def topk_for(self, model_config: DSAConfig) -> int:
        """Top-k of the sparse selection: the stage's, else the model's `index_topk`."""
        return self.config.topk or model_config.index_topk

    @property
    def recall_queries(self) -> int:
        """Queries per layer sampled for top-k recall (sparse stages only; 0: not measured)."""
        return self.config.topk_recall_queries if self.sparse else 0

    # ------------------------------------------------------------------ what trains
    def trains(self, param_name: str) -> bool:
        return self.kind.trains(param_name)

    def select_trainable(self, model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
        """Freezes / unfreezes the model's parameters in place (frozen ones get requires_grad=False:
        no gradient, no optimizer state) and clears their gradients; returns the trainable
        (name, parameter) pairs in `named_parameters` order."""
        selected = []
        for name, param in model.named_parameters():
            train = self.trains(name)
            param.requires_grad_(train)
            param.grad = None
            if train:
                selected.append((name, param))
        if not selected:
            raise ValueError(f"trainable={self.kind.name}: the model has no such parameters")
        return selected

    # ------------------------------------------------------------------ the forward
    @property
    def uses_lm(self) -> bool:
        """The LM loss counts: the forward runs the final norm, LM head and cross-entropy on labels."""
        return self.config.lm_loss_coef > 0

    @property
    def uses_mtp(self) -> bool:
        """The multi-token-prediction loss counts (it needs the LM head)."""
        return self.uses_lm and self.config.mtp_loss_coef > 0

    @property
    def uses_indexer_loss(self) -> bool:
        return self.config.indexer_loss_coef > 0

    @property
    def index_scores(self) -> str:
        """The scores the sparse selection is made on: "bf16" (default), "fp8" or "fp8_ue8m0"."""
        return _value(getattr(self.config, "index_scores", "bf16"))

    def _scoring_kwargs(self) -> dict:
        """The forward's `index_scores`, only when a recipe chose FP8 (the forward's default is bf16)."""
        return {} if self.index_scores == "bf16" else {"index_scores": self.index_scores}

    def forward_kwargs(self, topk_recall_queries: int = 0) -> dict:
        """Keyword arguments of the model's forward in a training step (labels and positions aside);
        `topk_recall_queries` > 0 samples that many queries per layer for top-k recall."""
        return {
            "attention": self.attention,
            "indexer_loss": self.uses_indexer_loss,
            "compute_logits": self.uses_lm,
            "topk": self.config.topk,
            "mtp": self.uses_mtp,
            "measure_topk_recall": topk_recall_queries,
            **self._scoring_kwargs(),
        }

    def probe_forward_kwargs(self) -> dict:
        """Keyword arguments of the model's forward on probe batches: every metric (LM loss, indexer
        KL, recall in sparse stages) under this stage's attention, whatever trains."""
        return {
            "attention": self.attention,
            "indexer_loss": True,
            "compute_logits": True,
            "topk": self.config.topk,
            "measure_topk_recall": self.recall_queries,
            **self._scoring_kwargs(),
        }

    # ------------------------------------------------------------------ the loss
    @property
    def loss_coefficients(self) -> dict[str, float]:
        """Weight of each loss term in the step's loss ("lm", "mtp", "indexer")."""
        c = self.config
        return {"lm": c.lm_loss_coef, "mtp": c.mtp_loss_coef if c.lm_loss_coef > 0 else 0.0,
                "indexer": c.indexer_loss_coef}

    def add_step_loss(self, metrics: dict[str, float]) -> dict[str, float]:
        """Adds to a step's reduced metrics `indexer_loss` (the indexer KL, when it counts) and `loss`
        (the coefficient-weighted sum of the terms); returns the same dict."""
        coefs = self.loss_coefficients
        if self.uses_indexer_loss and "indexer_kl" in metrics:
            metrics["indexer_loss"] = metrics["indexer_kl"]
        metrics["loss"] = sum(coefs[key] * metrics.get(name, 0.0)
                              for key, name in (("lm", "lm_loss"), ("mtp", "mtp_loss"), ("indexer", "indexer_loss")))
        return metrics

    # ------------------------------------------------------------------ cost
    def flops_per_token(self, model_config: DSAConfig, seq_len: int) -> float:
        """Model FLOPs per token of one training step, as users count them (docs/training.md): the
        numerator of the trainer's `perf/mfu`, and the plan's model FLOPs. The model column of
        `step_flops` (whatever the layout: it does not depend on it)."""
        return self.step_flops(model_config, seq_len, issued=False).model

    def step_flops(self, model_config: DSAConfig, seq_len: int, context: int = 1, recompute: str = "none",
                   micro_batch: int = 1, issued: bool = True, tensor: int = 1):
        """This stage's step per token, part by part: the FLOPs users count beside the FLOPs and bytes
        the CUDA path issues under this layout (`dsa_train.model.step_flops.StepFlops`; the plan times
        the issued column, the trainer's MFU divides the model column by the step's time)."""
        from dsa_train.model.step_flops import step_flops

        return step_flops(
            model_config, seq_len, self.attention, self.topk_for(model_config),
            main_backward=self.kind.main_backward, lm_head=self.kind.lm_head,
            kl_recomputes_main_scores=self.kind.kl_recomputes_main_scores, indexer_loss=self.uses_indexer_loss,
            context=context, recompute=recompute, micro_batch=micro_batch, index_scores=self.index_scores,
            issued=issued, tensor=tensor,
        )

    def describe(self, trainable_tensors: int) -> str:
        """The trainer's opening line of the stage."""
        c = self.config
        return (f"stage {self.name}: {self.attention} attention, trains {self.kind.name} ({trainable_tensors} tensors), "
                f"{c.steps} steps x {c.global_batch_size} sequences")


def trained_index_topk(stages: Iterable[tuple[str, int | None]], default: int) -> int:
    """The top-k the model was last trained with: that of the last sparse stage among
    `(attention, topk)` of the stages that ran, in order (topk None: the model's `default`).
    Written as `index_topk` of the export, so that the exported model selects as it was trained."""
    topk = default
    for attention, k in stages:
        if str(attention) == "sparse":
            topk = int(k) if k else default
    return topk
