"""Model configuration: the DeepSeek-V3 architecture plus the DSA lightning indexer.

Field names follow the Hugging Face `config.json` of DeepSeek-V3 / V3.1-Terminus
(`model_type: deepseek_v3`) and DeepSeek-V3.2-Exp (`model_type: deepseek_v32`), so a config
round-trips through `from_hf_dict` / `to_hf_dict` unchanged apart from the V3.2 additions.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from dsa_train.errors import DSATrainError

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "deepseek_v32", "kimi_k2", "deepseek_v2")


class ModelConfigError(DSATrainError, ValueError):
    """A model config.json that does not describe a model this code can build (a field of the
    wrong type, inconsistent sizes, another architecture). Names the field and what it expects."""


class ModelConfigNotFound(ModelConfigError, FileNotFoundError):
    pass


_EXPECTED = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
             "dict": "an object"}
_ROPE_NUMBERS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def _type_ok(value: Any, kind: str) -> bool:
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, {"bool": bool, "str": str, "dict": dict}[kind])


def type_problems(d: dict[str, Any]) -> list[str]:
    """One line per config.json value whose JSON type does not match the field's (e.g.
    `"hidden_size": "192"`), from the DSAConfig annotations; unknown keys are not checked."""
    problems = []
    annotations = {f.name: str(f.type) for f in fields(DSAConfig)}
    for key, value in d.items():
        ann = annotations.get(key)
        if ann is None or key in ("extra", "has_indexer_weights"):
            continue
        kinds = [part.strip() for part in ann.split("|")]
        if value is None and "None" in kinds:
            continue
        if key.endswith("_token_id") and isinstance(value, list) and all(_type_ok(v, "int") for v in value):
            continue  # transformers allows several end tokens
        kinds = [k for k in kinds if k != "None"]
        if kinds and kinds[0] in _EXPECTED and not any(_type_ok(value, k) for k in kinds):
            problems.append(f"{key} is {json.dumps(value)} ({type(value).__name__}), expected {_EXPECTED[kinds[0]]}"
                            + (" or null" if "None" in ann else ""))
    rope = d.get("rope_scaling")
    if isinstance(rope, dict):
        for key in _ROPE_NUMBERS:
            if key in rope and rope[key] is not None and not _type_ok(rope[key], "float"):
                problems.append(f"rope_scaling.{key} is {json.dumps(rope[key])} ({type(rope[key]).__name__}), "
                                "expected a number")
    return problems


@dataclass
class DSAConfig:
    # --- trunk ---
    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_nextn_predict_layers: int = 1  # MTP modules stored at layers [L, L + n)
    num_attention_heads: int = 128
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    max_position_embeddings: int = 163840
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1
    # --- MLA ---
    q_lora_rank: int | None = 1536  # None: a single q_proj (DeepSeek-V2-Lite)
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    attention_bias: bool = False
    rope_theta: float = 10000.0
    # YaRN: {"type"/"rope_type": "yarn", "factor", "original_max_position_embeddings",
    #        "beta_fast", "beta_slow", "mscale", "mscale_all_dim"}; None = plain RoPE.
    rope_scaling: dict | None = None
    rope_interleave: bool = True  # MLA's RoPE pairs (x0,x1),(x2,x3),...
    # --- MoE ---
    n_routed_experts: int | None = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    first_k_dense_replace: int = 3
    moe_layer_freq: int = 1
    # --- DSA lightning indexer (V3.2 additions) ---
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 2048
    index_hadamard: bool = True  # rotate q_I, k_I (no-op in exact arithmetic; for FP8)
    # --- provenance ---
    model_type: str = "deepseek_v32"
    has_indexer_weights: bool = True  # False when loaded from a dense (V3) checkpoint
    # keys of config.json we do not model, kept so export writes them back
    extra: dict = field(default_factory=dict)

    # ------------------------------------------------------------------ derived
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def rope_type(self) -> str:
        rs = self.rope_scaling or {}
        return rs.get("rope_type", rs.get("type", "default")) or "default"

    @property
    def softmax_scale(self) -> float:
        """MLA softmax scale: (qk_nope + qk_rope)^-1/2 * mscale^2 (YaRN)."""
        scale = self.qk_head_dim ** -0.5
        if self.rope_type == "yarn":
            mscale_all_dim = self.rope_scaling.get("mscale_all_dim", 0) or 0
            factor = self.rope_scaling.get("factor", 1.0)
            if mscale_all_dim and factor > 1:
                m = 0.1 * mscale_all_dim * math.log(factor) + 1.0
                scale = scale * m * m
        return scale

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (
            self.n_routed_experts is not None
            and self.n_routed_experts > 0
            and layer_idx >= self.first_k_dense_replace
            and layer_idx % self.moe_layer_freq == 0
        )

    def validate(self) -> None:
        problems = []
        if self.index_head_dim < self.qk_rope_head_dim:
            problems.append(
                f"index_head_dim ({self.index_head_dim}) must be >= qk_rope_head_dim "
                f"({self.qk_rope_head_dim}): the indexer ropes its first qk_rope_head_dim dims"
            )
        if self.qk_rope_head_dim % 2:
            problems.append(f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even")
        if self.index_hadamard and self.index_head_dim & (self.index_head_dim - 1):
            problems.append(
                f"index_hadamard needs a power-of-two index_head_dim, got {self.index_head_dim}; "
                "set index_hadamard=false"
            )
        if self.n_routed_experts:
            if self.n_routed_experts % self.n_group:
                problems.append(
                    f"n_routed_experts ({self.n_routed_experts}) must be divisible by n_group ({self.n_group})"
                )
            if self.topk_group > self.n_group:
                problems.append(f"topk_group ({self.topk_group}) > n_group ({self.n_group})")
            per_group = self.n_routed_experts // max(self.n_group, 1)
            if self.num_experts_per_tok > self.topk_group * per_group:
                problems.append(
                    f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts in "
                    f"topk_group={self.topk_group} groups of {per_group}"
                )
            if self.scoring_func != "sigmoid":
                problems.append(f"scoring_func {self.scoring_func!r} is not supported (only 'sigmoid', as in V3)")
        if self.index_topk < 1:
            problems.append(f"index_topk must be >= 1, got {self.index_topk}")
        if problems:
            raise ModelConfigError("invalid model config:\n  - " + "\n  - ".join(problems))

    # ------------------------------------------------------------------ HF I/O
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "DSAConfig":
        model_type = d.get("model_type", "deepseek_v3")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(
                f"config.json has model_type={model_type!r}; dsa_train supports the DeepSeek-V3 "
                f"architecture family {SUPPORTED_MODEL_TYPES}. Is this the right checkpoint?"
            )
        d = dict(d)
        wrong = type_problems(d)
        if wrong:
            raise ModelConfigError("config.json has values of the wrong type: " + "; ".join(wrong),
                                   fix="correct them in config.json (numbers without quotes)")
        if "num_mtp_layers" in d and "num_nextn_predict_layers" not in d:
            d["num_nextn_predict_layers"] = d.pop("num_mtp_layers")
        known = {f.name for f in fields(cls)} - {"extra", "has_indexer_weights"}
        kwargs: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for key, value in d.items():
            if key in known:
                kwargs[key] = value
            else:
                extra[key] = value
        # transformers 5 writes rope settings as `rope_parameters` (with rope_theta inside)
        rope_parameters = extra.pop("rope_parameters", None)
        if rope_parameters:
            rp = dict(rope_parameters)
            if "rope_theta" in rp:
                kwargs.setdefault("rope_theta", rp.pop("rope_theta"))
            rtype = rp.get("rope_type", rp.get("type", "default"))
            if rtype not in (None, "default") and not kwargs.get("rope_scaling"):
                kwargs["rope_scaling"] = rp
        if kwargs.get("rope_scaling"):
            rtype = kwargs["rope_scaling"].get("rope_type", kwargs["rope_scaling"].get("type"))
            if rtype not in ("yarn", "default", None):
                raise ModelConfigError(f"rope_scaling type {rtype!r} is not supported (yarn or none)")
        kwargs["model_type"] = model_type
        kwargs["has_indexer_weights"] = model_type == "deepseek_v32"
        if model_type == "deepseek_v32":
            kwargs["rope_interleave"] = True  # V3.2 always uses interleaved MLA RoPE
        cfg = cls(**kwargs, extra=extra)
        cfg.validate()
        return cfg

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "DSAConfig":
        cfg_file = os.path.join(path, "config.json") if os.path.isdir(path) else str(path)
        if not os.path.exists(cfg_file):
            raise ModelConfigNotFound(
                f"no config.json at {cfg_file}: pass a Hugging Face model directory "
                "(config.json + *.safetensors)"
            )
        with open(cfg_file) as f:
            try:
                d = json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ModelConfigError(f"{cfg_file} is not valid JSON: {e}") from e
        if not isinstance(d, dict):
            raise ModelConfigError(f"{cfg_file} holds a JSON {type(d).__name__}, not an object")
        try:
            return cls.from_hf_dict(d)
        except ModelConfigError as e:
            raise ModelConfigError(f"{cfg_file}: {e.problem}", fix=e.fix) from e

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json in the DeepSeek-V3.2-Exp layout (model_type deepseek_v32)."""
        d = {k: v for k, v in asdict(self).items() if k not in ("extra", "has_indexer_weights", "index_hadamard")}
        out = dict(self.extra)
        out.pop("quantization_config", None)  # export writes its own when it quantizes
        out.pop("rope_parameters", None)
        out.update(d)
        out["model_type"] = "deepseek_v32"
        out["architectures"] = ["DeepseekV32ForCausalLM"]
        out["torch_dtype"] = out.get("torch_dtype", "bfloat16")
        return out


def tiny_config(**overrides: Any) -> DSAConfig:
    """A tiny V3.2-shaped config (MoE, MLA with q-LoRA, YaRN, indexer, MTP) for demos and tests."""
    base = dict(
        vocab_size=4096,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_nextn_predict_layers=1,
        num_attention_heads=4,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        max_position_embeddings=4096,
        rope_scaling={
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        index_n_heads=4,
        index_head_dim=32,
        index_topk=64,
    )
    base.update(overrides)
    cfg = DSAConfig(**base)
    cfg.validate()
    return cfg
