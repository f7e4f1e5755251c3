"""`dsa-train inspect PATH`: what a checkpoint is and whether it loads, from headers only.

Reports the architecture, parameter counts (total, MTP, indexer, active per token), a dtype
histogram, the quantization, and the tensors missing or unexpected against config.json. A
Hugging Face directory is checked exactly as the loader checks it (no weight is read); a
training checkpoint is checked against its resolved config.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..model.config import DSAConfig
from .errors import CheckpointError
from .loader import examine_checkpoint
from .match import is_indexer_tensor, raise_if_unloadable

_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass
class ParamCounts:
    total: int = 0  # main model (without MTP), indexer included
    mtp: int = 0
    indexer: int = 0
    routed_experts: int = 0  # in the main model
    active: int = 0  # per token in the main model: everything but the routed experts not chosen


def count_parameters(shapes: dict[str, tuple[int, ...]], config: DSAConfig) -> ParamCounts:
    c = ParamCounts()
    for name, shape in shapes.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        n = 1
        for s in shape:
            n *= s
        m = _LAYER.match(name)
        if m and int(m.group(1)) >= config.num_hidden_layers:
            c.mtp += n
            continue
        c.total += n
        c.indexer += n if is_indexer_tensor(name) else 0
        c.routed_experts += n if _EXPERT.search(name) else 0
    experts = config.n_routed_experts or 1
    c.active = c.total - c.routed_experts + c.routed_experts * config.num_experts_per_tok // experts
    return c


def human(n: float, unit: str = "") -> str:
    for suffix, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {suffix}{unit}"
    return f"{n:.0f} {unit}".rstrip()


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    error: str | None = None
    bad_values: str | None = None  # --check-values: tensors holding NaN / inf

    def add(self, key: str, value: str) -> None:
        self.lines.append(f"{key + ':':<16}{value}")

    def text(self) -> str:
        if self.error:
            status = f"CANNOT LOAD: {self.error}"
        elif self.bad_values:
            status = f"loads, but BAD VALUES: {self.bad_values}"
        else:
            status = "loads"
        return "\n".join(self.lines + [f"{'status:':<16}{status}"])


HEADERS_ONLY = "not read: names, shapes and dtypes come from the headers; --check-values reads every tensor for NaN/inf"


def nonfinite_counts(tensors) -> tuple[int, list[str]]:
    """Read `(name, tensor)` pairs one at a time; -> (tensors read, 'name (k NaN, m inf)' for each
    tensor that is not all finite)."""
    import torch

    read, bad = 0, []
    for name, t in tensors:
        read += 1
        if not (t.is_floating_point() or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)):
            continue
        x = t.float()
        nan = int(torch.isnan(x).sum())
        inf = int(torch.isinf(x).sum())
        if nan or inf:
            bad.append(f"{name} ({nan} NaN, {inf} inf of {x.numel()})")
    return read, bad


def _add_value_check(r: Report, tensors, check: bool) -> None:
    if not check:
        r.add("values", HEADERS_ONLY)
        return
    read, bad = nonfinite_counts(tensors)
    if bad:
        r.add("values", f"{len(bad)} of {read} tensors hold NaN/inf")
        r.bad_values = f"{len(bad)} tensors hold NaN/inf: " + ", ".join(bad[:6]) + (" ..." if len(bad) > 6 else "")
    else:
        r.add("values", f"all {read} tensors finite (every value read)")


def _hf_tensors(hf):
    from .safetensors_file import SafetensorsReader

    by_file: dict = {}
    for e in hf.entries.values():
        by_file.setdefault(e.file, []).append(e)
    for file, entries in by_file.items():
        with SafetensorsReader(file) as reader:
            for e in entries:
                yield e.name, reader.read(e)


def _describe_config(r: Report, cfg: DSAConfig) -> None:
    moe = (
        f"{cfg.n_routed_experts} routed experts (top-{cfg.num_experts_per_tok}, {cfg.n_group} groups / top-"
        f"{cfg.topk_group}) + {cfg.n_shared_experts} shared, first {cfg.first_k_dense_replace} layers dense"
        if cfg.n_routed_experts else "dense MLPs"
    )
    r.add("layers", f"{cfg.num_hidden_layers} + {cfg.num_nextn_predict_layers or 0} MTP; hidden {cfg.hidden_size}, "
          f"{cfg.num_attention_heads} heads, vocab {cfg.vocab_size}")
    r.add("attention", f"MLA q_lora {cfg.q_lora_rank}, kv_lora {cfg.kv_lora_rank}, qk {cfg.qk_nope_head_dim}+"
          f"{cfg.qk_rope_head_dim}, v {cfg.v_head_dim}, rope {cfg.rope_type}")
    r.add("indexer", f"{cfg.index_n_heads} heads x {cfg.index_head_dim}, top-{cfg.index_topk}")
    r.add("mlp", moe)


def _describe_params(r: Report, shapes: dict, cfg: DSAConfig) -> None:
    c = count_parameters(shapes, cfg)
    r.add("parameters", f"{human(c.total)} total ({human(c.indexer)} indexer), {human(c.active)} active per token, "
          f"+ {human(c.mtp)} MTP")


def inspect_hf(path: Path, check_values: bool = False) -> Report:
    r = Report()
    plan = examine_checkpoint(path)
    cfg, m = plan.config, plan.match
    shards = len(plan.hf.files)
    r.add("path", str(path))
    r.add("format", f"Hugging Face safetensors, {shards} file{'s' * (shards > 1)}"
          f"{' + index' if plan.hf.indexed else ''}, {human(plan.hf.total_bytes, 'B')}")
    r.add("architecture", f"{plan.hf.config.get('architectures', ['?'])[0]} (model_type {cfg.model_type})"
          + ("; dense: indexers are initialized on load" if m.dense else "; has indexer weights"))
    _describe_config(r, cfg)
    _describe_params(r, m.expected, cfg)
    hist: Counter = Counter()
    nbytes: Counter = Counter()
    for e in plan.hf.entries.values():
        hist[e.dtype] += 1
        nbytes[e.dtype] += e.nbytes
    r.add("dtypes", ", ".join(f"{d} {hist[d]} tensors ({human(nbytes[d], 'B')})" for d in sorted(hist)))
    qc = plan.hf.config.get("quantization_config")
    fp8 = sum(1 for st in plan.stored.values() if st.scale is not None)
    if qc:
        r.add("quantization", f"{qc.get('quant_method')} {qc.get('fmt', '')} blocks {qc.get('weight_block_size')} "
              f"scale_fmt {qc.get('scale_fmt', 'float')}; {fp8} weights with weight_scale_inv")
    else:
        r.add("quantization", "none" + (f" declared, but {fp8} weights have weight_scale_inv" if fp8 else ""))
    r.add("missing", _names(m.missing) + (f"; indexer: {len(m.missing_indexer)} tensors (initialized on load)"
                                          if m.dense else ""))
    r.add("unexpected", _names(m.unexpected))
    _add_value_check(r, _hf_tensors(plan.hf), check_values)
    try:
        raise_if_unloadable(m, plan.path, cfg)
    except CheckpointError as e:
        r.error = str(e)
    return r


def inspect_training(path: Path, config: str | None, check_values: bool = False) -> Report:
    from .training_source import open_training_checkpoint

    r = Report()
    ckpt = open_training_checkpoint(path, config)
    r.add("path", str(ckpt.step_dir))
    r.add("format", f"dsa_train training checkpoint ({', '.join(sorted({f.name for f in ckpt.files.values()}))})")
    r.add("architecture", f"DSAForCausalLM (from model_type {ckpt.config.model_type})")
    _describe_config(r, ckpt.config)
    headers = getattr(ckpt.state, "meta", ckpt.state)  # sharded: shapes and dtypes from the metadata
    _describe_params(r, {n: tuple(t.shape) for n, t in headers.items()}, ckpt.config)
    hist = Counter(str(t.dtype).replace("torch.", "") for t in headers.values())
    r.add("dtypes", ", ".join(f"{d} {n} tensors" for d, n in sorted(hist.items())))
    r.add("missing", "none")
    r.add("unexpected", "none")
    _add_value_check(r, ckpt.state.items(), check_values)
    return r


def _names(names: list[str], n: int = 8) -> str:
    if not names:
        return "none"
    more = f" ... (+{len(names) - n})" if len(names) > n else ""
    return f"{len(names)}: " + ", ".join(names[:n]) + more


def inspect_checkpoint(path: str | os.PathLike, config: str | None = None, check_values: bool = False) -> Report:
    """The report; CheckpointError when the files themselves cannot be read. From headers only,
    unless `check_values`: then every tensor is read and checked for NaN / inf."""
    from .training_source import is_training_checkpoint

    path = Path(path)
    if is_training_checkpoint(path):
        return inspect_training(path, config, check_values)
    return inspect_hf(path, check_values)  # raises with what is missing when it is neither
