"""The evaluation: for each model, sequence length and attention mode, LM loss by position, per-layer
attention measurements and (optionally) passkey retrieval.

Modes, each one forward of the model as the trainer calls it (`model(input_ids, attention=...,
topk=..., position_ids=...)`, no gradient, one sequence at a time):

  * dense:  `attention="dense"`;
  * sparse: `attention="sparse"` with the model's `index_topk` or `--topk`: the learned indexer picks;
  * oracle: the dense forward with each layer's attention output replaced (a forward hook,
    `attention.layer_hooks`) by sparse attention over the oracle top-k, the k keys with the most
    true head-summed attention mass, computed from the layer's own weights: the loss a perfect
    indexer would reach at this k.

The per-layer measurements (`attention.measure_layer`) run on the dense forward's layer inputs.
"""

from __future__ import annotations

import logging
import sys
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

import dsa_train
from dsa_train.data import Tokenizer, check_vocab, load_tokenizer

from .attention import LayerMeasurements, LayerStats, layer_hooks, oracle_attention_output
from .data import DEFAULT_SEED, heldout_sequences
from .errors import EvalError
from .passkey import DEFAULT_DEPTHS, passkey_examples, score_example, summarize
from .positions import LossByPosition, check_buckets, default_buckets, token_losses

log = logging.getLogger(__name__)

MODES = ("dense", "sparse", "oracle")
# opt-in (--modes): sparse attention over the top-k of FP8 index scores (e4m3 q_I / k_I, as FP8
# inference selects; power-of-two scales with --ue8m0), dsa_kernels.ops.indexer_topk.fp8
EXTRA_MODES = ("sparse_fp8",)
SPARSE_MODES = {"sparse", "oracle", "sparse_fp8"}


@dataclass
class EvalOptions:
    data: list[str] = field(default_factory=lambda: ["bundled"])  # data sources ("bundled": the bundled corpus)
    seq_lens: list[int] = field(default_factory=lambda: [512])
    topk: int | None = None  # None: each model's index_topk
    modes: list[str] = field(default_factory=lambda: list(MODES))
    num_sequences: int = 4
    buckets: list[int] | None = None  # position bucket edges; None: [0, k, 2k, 4k, ...]
    layer_metrics: bool = True
    fp8_ue8m0: bool = False  # power-of-two FP8 scales in the bf16-vs-FP8 index-scoring overlap
    passkey: bool = False
    passkey_depths: tuple[float, ...] = DEFAULT_DEPTHS
    passkey_per_depth: int = 2
    seed: int = DEFAULT_SEED  # the training loader's data.seed whose last rows are held out
    tokenizer: str | None = None  # None: the model directory's tokenizer.json, else the bundled one
    text_field: str = "text"  # field of the text in the data's .jsonl / .json / .parquet records
    dtype: torch.dtype = torch.float32


def check_options(opts: EvalOptions) -> EvalOptions:
    unknown = [m for m in opts.modes if m not in MODES + EXTRA_MODES]
    if unknown or not opts.modes:
        raise EvalError(f"unknown attention mode {', '.join(unknown) or '(none given)'}",
                        f"--modes takes a comma-separated subset of {','.join(MODES + EXTRA_MODES)}")
    if not opts.seq_lens or any(t < 2 for t in opts.seq_lens):
        raise EvalError(f"--seq-len {opts.seq_lens} must be lengths of at least 2 tokens", "e.g. --seq-len 512 1024")
    if opts.topk is not None and opts.topk < 1:
        raise EvalError(f"--topk {opts.topk} must be at least 1", "e.g. --topk 64")
    if opts.num_sequences < 1:
        raise EvalError(f"--num-sequences {opts.num_sequences} must be at least 1", "e.g. --num-sequences 4")
    if opts.buckets is not None:
        check_buckets(opts.buckets)
    return opts


def model_source(path: str | Path) -> tuple[str, Path]:
    """("hf", a Hugging Face directory) -- PATH itself or a run directory's `export/` -- or
    ("training", a training checkpoint): a step directory `checkpoints/step_N`, or the newest step of
    a run (or checkpoints) directory that has no export yet."""
    from dsa_train.checkpoint.training_source import find_step_dir

    p = Path(path).expanduser()
    if not p.exists():
        raise EvalError(f"model {p} does not exist",
                        "pass a Hugging Face directory (config.json + *.safetensors), a run directory or a "
                        "training checkpoint (<run>/checkpoints/step_N)")
    step = find_step_dir(p)
    if step == p:  # a step directory (its config.json is the model's config, not a Hugging Face model)
        return "training", step
    if (p / "config.json").is_file():
        return "hf", p
    if (p / "export" / "config.json").is_file():
        return "hf", p / "export"
    if step is not None:
        return "training", step
    raise EvalError(f"{p} holds no config.json, no export/config.json and no training checkpoint",
                    "pass a Hugging Face directory, a run directory or a training checkpoint (<run>/checkpoints/step_N)")


def model_tokenizer(model_dir: Path, tokenizer: str | None) -> Tokenizer:
    if tokenizer is not None:
        return load_tokenizer(tokenizer)
    return load_tokenizer(model_dir if (model_dir / "tokenizer.json").is_file() else None)


@dataclass
class LoadedModel:
    name: str
    path: Path
    model: torch.nn.Module
    tokenizer: Tokenizer
    topk: int
    training: object = None  # eval/overlap.RunTraining of a run's model, else None
    trained: object = None  # its TrainedSpans (built once, when the evaluation's data is the run's)


def load_model(path: str | Path, opts: EvalOptions) -> LoadedModel:
    kind, directory = model_source(path)
    if kind == "hf":
        tokenizer = model_tokenizer(directory, opts.tokenizer)
        model = dsa_train.from_pretrained(directory, dtype=opts.dtype)
    else:  # a training checkpoint: the run's tokenizer, the top-k of the last sparse stage it trained
        from dsa_train.checkpoint import CheckpointError, from_training_checkpoint

        try:
            model, ckpt = from_training_checkpoint(directory, dtype=opts.dtype)
        except CheckpointError as e:
            # the problem only: the checkpoint layer's fix is export's ("export an earlier step_* directory")
            problem = e.problem if str(directory) in e.problem else f"{directory}: {e.problem}"
            raise EvalError(problem, "pass another step (checkpoints/step_N) or the run's export/") from e
        tokenizer = load_tokenizer(opts.tokenizer if opts.tokenizer is not None else ckpt.tokenizer_dir)
    model.eval()
    check_vocab(tokenizer.vocab_size, model.config.vocab_size)
    from .overlap import TrainedSpans, same_stream, training_of

    training = training_of(directory if kind == "training" else path)
    trained = None
    if training is not None and same_stream(training, opts.data, opts.text_field):
        trained = TrainedSpans(training, tokenizer)
    return LoadedModel(str(path), directory, model, tokenizer, opts.topk or model.config.index_topk, training, trained)


def check_same_tokenizer(models: list[LoadedModel]) -> None:
    hashes = {m.tokenizer.content_hash for m in models}
    if len(hashes) > 1:
        names = ", ".join(f"{m.name} ({m.tokenizer.path}, hash {m.tokenizer.content_hash[:12]})" for m in models)
        raise EvalError(f"the models use different tokenizers: {names}",
                        "compare models of one tokenizer, or pass --tokenizer to use one for both")


def check_lengths(seq_lens: list[int], models: list[LoadedModel], modes: list[str]) -> None:
    """Sparse modes compare with dense only where T > k (at T <= k every key is selected); every
    mode reads positions only below the models' max_position_embeddings."""
    for m in models:
        limit = m.model.config.max_position_embeddings
        if max(seq_lens) > limit:
            raise EvalError(f"--seq-len {max(seq_lens)} is beyond {m.name}'s max_position_embeddings {limit}",
                            f"use --seq-len up to {limit}")
        if not set(modes) & SPARSE_MODES:
            continue
        short = [t for t in seq_lens if t <= m.topk]
        if short:
            raise EvalError(f"--seq-len {' '.join(map(str, short))} is not longer than top-k {m.topk} of {m.name}: "
                            f"sparse attention would select every key",
                            f"use --seq-len above {m.topk}, or a smaller --topk")


# ---------------------------------------------------------------------------- forwards
@torch.no_grad()
def mode_logits(model: torch.nn.Module, mode: str, topk: int, input_ids: torch.Tensor,
                position_ids: torch.Tensor | None = None, measure=None, fp8_ue8m0: bool = False,
                positions_checked: bool = False) -> torch.Tensor:
    """Logits [B, T, V] of one attention mode. `measure(i, attn, tensors)` (dense mode only) sees
    every layer's input during the forward (`attention.layer_hooks`). sparse_fp8: the top-k of
    FP8 index scores (power-of-two scales with fp8_ue8m0). positions_checked: the caller knows the
    positions are below max_position_embeddings (no read of position_ids back to the host)."""
    if mode == "oracle":
        on_layer = lambda i, attn, lt: oracle_attention_output(attn, lt, topk)  # noqa: E731
    else:
        on_layer = measure if mode == "dense" else None
    with layer_hooks(model, on_layer) if on_layer is not None else nullcontext():
        fp8 = {"index_scores": "fp8_ue8m0" if fp8_ue8m0 else "fp8"} if mode == "sparse_fp8" else {}
        out = model(input_ids, attention="sparse" if mode in ("sparse", "sparse_fp8") else "dense", topk=topk,
                    position_ids=position_ids, positions_checked=positions_checked, **fp8)
    return out.logits


@dataclass
class ModeResult:
    losses: LossByPosition
    passkey: dict | None = None


@dataclass
class LengthResult:
    seq_len: int
    rows: list[int]
    available_rows: int
    modes: dict[str, ModeResult]
    layers: dict[int, LayerStats]
    overlapping: list[int] | None = None  # rows the model's run trained on (None: not a run, unknown)


def evaluate_batches(model: torch.nn.Module, topk: int, batches: list[dict[str, torch.Tensor]], seq_len: int,
                     opts: EvalOptions, progress=None) -> tuple[dict[str, ModeResult], dict[int, LayerStats]]:
    """LM loss by position per mode and the per-layer measurements over held-out `batches` (each
    {"input_ids", "labels", "position_ids"}: [1, T], on the model's device). The one evaluation loop
    of `dsa-train eval` and of the recipe's `eval` group (dsa_train/eval/in_training.py)."""
    edges = opts.buckets or default_buckets(topk, seq_len)
    # rows of seq_len tokens whose positions restart at each document: below seq_len, so checked once
    # here (not read back in every forward)
    limit = model.config.max_position_embeddings
    if seq_len > limit:
        raise ValueError(f"eval rows of {seq_len} tokens are beyond max_position_embeddings {limit}; "
                         f"evaluate at most {limit} tokens per row")
    results = {mode: ModeResult(LossByPosition(list(edges))) for mode in opts.modes}
    measure = LayerMeasurements(topk, fp8=True, ue8m0=opts.fp8_ue8m0) if opts.layer_metrics else None
    for batch in batches:
        ids, labels, pos = batch["input_ids"], batch["labels"], batch["position_ids"]
        if ids.shape[-1] > seq_len:  # its positions would not be covered by the check above
            raise ValueError(f"an eval row of {ids.shape[-1]} tokens is longer than seq_len {seq_len}; "
                             f"pass seq_len={ids.shape[-1]} (the rows' length) or cut the rows to {seq_len} tokens")
        for mode in opts.modes:
            logits = mode_logits(model, mode, topk, ids, pos, measure, opts.fp8_ue8m0, positions_checked=True)
            results[mode].losses.add(token_losses(logits, labels), labels, pos)
            _advance(progress)
        if measure is not None and "dense" not in opts.modes:  # the measurements' dense forward
            mode_logits(model, "dense", topk, ids, pos, measure, positions_checked=True)
    return results, (measure.layers if measure is not None else {})


def evaluate_length(m: LoadedModel, seq_len: int, opts: EvalOptions, progress=None) -> LengthResult:
    held = heldout_sequences(opts.data, m.tokenizer, seq_len, opts.num_sequences, opts.seed, opts.text_field)
    results, layers = evaluate_batches(m.model, m.topk, held.batches, seq_len, opts, progress)
    if opts.passkey:
        examples = passkey_examples(m.tokenizer, seq_len, opts.passkey_depths, opts.passkey_per_depth, seed=opts.seed)
        for mode in opts.modes:
            scored = []
            for ex in examples:
                scored.append(score_example(lambda ids: mode_logits(m.model, mode, m.topk, ids,
                                                                    fp8_ue8m0=opts.fp8_ue8m0), ex))
                _advance(progress)
            results[mode].passkey = summarize(scored)
    from .overlap import overlapping_rows

    overlap = overlapping_rows(m.training, m.trained, opts.data, held.rows, seq_len, opts.text_field)
    return LengthResult(seq_len, held.rows, held.available, results, layers, overlap)


def _advance(progress) -> None:
    if progress is not None:
        progress()


def forwards_per_length(opts: EvalOptions) -> int:
    passkey = len(opts.passkey_depths) * opts.passkey_per_depth if opts.passkey else 0
    return len(opts.modes) * (opts.num_sequences + passkey)


def evaluate(model_paths: list[str], opts: EvalOptions, show_progress: bool | None = None) -> dict:
    """Evaluate every model at every sequence length -> the `eval.json` document."""
    check_options(opts)
    models = [load_model(p, opts) for p in model_paths]
    check_same_tokenizer(models)
    check_lengths(opts.seq_lens, models, opts.modes)
    enabled = sys.stdout.isatty() if show_progress is None else show_progress
    total = len(models) * len(opts.seq_lens) * forwards_per_length(opts)
    doc = {"options": _options_dict(opts), "models": []}
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), disable=not enabled) as bar:
        task = bar.add_task("eval", total=total)
        for m in models:
            entry = {"model": m.name, "path": str(m.path), "topk": m.topk,
                     "num_hidden_layers": m.model.config.num_hidden_layers, "lengths": []}
            for seq_len in opts.seq_lens:
                bar.update(task, description=f"eval {Path(m.name).name} T={seq_len}")
                result = evaluate_length(m, seq_len, opts, lambda: bar.advance(task))
                entry["lengths"].append(length_dict(result))
            doc["models"].append(entry)
    return doc


def _options_dict(opts: EvalOptions) -> dict:
    return {"data": opts.data, "seq_lens": opts.seq_lens, "topk": opts.topk, "modes": opts.modes,
            "num_sequences": opts.num_sequences, "buckets": opts.buckets, "passkey": opts.passkey,
            "fp8_ue8m0": opts.fp8_ue8m0, "seed": opts.seed, "dtype": str(opts.dtype).replace("torch.", "")}


def length_dict(r: LengthResult) -> dict:
    return {
        "seq_len": r.seq_len,
        "rows": r.rows,
        "available_rows": r.available_rows,
        "rows_overlapping_training": r.overlapping,  # null: the model is not a run (unknown)
        "modes": {mode: {**res.losses.as_dict(), **({"passkey": res.passkey} if res.passkey else {})}
                  for mode, res in r.modes.items()},
        "layers": [{"layer": i, **stats.values()} for i, stats in sorted(r.layers.items())],
    }
