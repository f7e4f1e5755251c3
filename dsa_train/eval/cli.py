"""`dsa-train eval MODEL [--compare MODEL2] ...`: dense vs sparse vs oracle top-k, by position.

    dsa-train eval /ckpt/V3.2 --seq-len 1024 2048 --topk 256 --passkey --out eval/
    dsa-train eval runs/demo --compare /ckpt/start --modes dense,sparse

Prints a table per model and length, writes `<out>/eval.json` and PNG plots (docs/eval.md).
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import torch

from dsa_train.data.naming import flags_named
from dsa_train.data.sources import needs_hf_datasets
from dsa_train.runtime import require_train_extra

from .data import DEFAULT_SEED
from .errors import EvalError
from .report import print_tables, write_json, write_plots
from .run import EXTRA_MODES, MODES, EvalOptions, evaluate

# DataConfig field -> the flag that sets it here (dsa_train/data/naming.py)
DATA_FLAGS = {"sources": "--data", "text_field": "--text-field", "tokenizer": "--tokenizer"}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dsa-train eval",
        description="Held-out LM loss by query position (dense, sparse with the learned indexer, sparse with the "
                    "oracle top-k), per-layer indexer recall / KL-captured / oracle and FP8 overlap, "
                    "passkey retrieval.")
    p.add_argument("model", help="Hugging Face directory (V3, V3.1, V3.2 layout, FP8 included), a run directory "
                                 "(its export/, else its newest checkpoint) or a training checkpoint "
                                 "(RUN/checkpoints/step_N)")
    p.add_argument("--compare", metavar="MODEL2", help="a second model evaluated the same way (same tokenizer)")
    p.add_argument("--data", nargs="+", default=["bundled"], metavar="SOURCE",
                   help="data sources as in data.sources (files, directories, globs, hub datasets); "
                        "default: the bundled corpus")
    p.add_argument("--text-field", default="text",
                   help="field holding the text in .jsonl / .json / .parquet sources (default text)")
    p.add_argument("--seq-len", nargs="+", type=int, default=[512], metavar="T", help="sequence lengths (default 512)")
    p.add_argument("--topk", type=int, default=None, help="k of the sparse modes (default: the model's index_topk)")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated subset of {','.join(MODES + EXTRA_MODES)} (sparse_fp8: the top-k of FP8 "
                        "index scores, as FP8 inference selects; --ue8m0 for power-of-two scales)")
    p.add_argument("--num-sequences", type=int, default=4, metavar="N",
                   help="held-out sequences per length (default 4)")
    p.add_argument("--buckets", nargs="+", type=int, default=None, metavar="EDGE",
                   help="position bucket edges, e.g. 0 512 1024 2048 (default: 0 k 2k 4k ... T)")
    p.add_argument("--passkey", action="store_true", help="also run passkey retrieval at each length")
    p.add_argument("--passkey-per-depth", type=int, default=2, metavar="N",
                   help="passkey examples per depth (depths 0, 0.25, 0.5, 0.75, 1; default 2)")
    p.add_argument("--no-layer-metrics", action="store_true", help="skip the per-layer measurements")
    p.add_argument("--ue8m0", action="store_true",
                   help="power-of-two FP8 scales (DeepSeek-V3.2's inference) in the bf16-vs-FP8 overlap and sparse_fp8")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory or tokenizer.json (default: the model's, else the bundled one)")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED,
                   help=f"the training loader's data.seed whose first epoch feeds the held-out rows last "
                        f"(default {DEFAULT_SEED})")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="model dtype (default float32)")
    p.add_argument("--out", type=Path, default=Path("eval"), help="output directory (default ./eval)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def options(args: argparse.Namespace) -> EvalOptions:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.passkey_per_depth < 1:
        raise EvalError(f"--passkey-per-depth {args.passkey_per_depth} must be at least 1",
                        "e.g. --passkey-per-depth 2")
    return EvalOptions(data=args.data, seq_lens=args.seq_len, topk=args.topk, modes=modes,
                       num_sequences=args.num_sequences, buckets=args.buckets, layer_metrics=not args.no_layer_metrics,
                       fp8_ue8m0=args.ue8m0, passkey=args.passkey, passkey_per_depth=args.passkey_per_depth,
                       seed=args.seed, tokenizer=args.tokenizer, dtype=DTYPES[args.dtype], text_field=args.text_field)


def check_out(out: Path) -> None:
    """--out must be a directory that can hold eval.json: checked before the evaluation runs."""
    for p in [out, *out.parents]:
        if p.exists() and not p.is_dir():
            raise EvalError(f"--out {out}: {p} is a file, not a directory; nothing was evaluated",
                            f"pass a directory for --out, e.g. --out {out.with_name(out.name + '-eval')}"
                            if p == out else f"pass an --out outside {p}")
        if p.exists():
            if not os.access(p, os.W_OK):
                raise EvalError(f"--out {out}: {p} is not writable; nothing was evaluated",
                                "pass a writable directory for --out")
            break


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    args = parser().parse_args(argv)
    opts = options(args)
    check_out(args.out)
    if needs_hf_datasets(args.data, streaming=False):  # local files and the bundled corpus are read without it
        require_train_extra("datasets", purpose="`dsa-train eval`'s data sources")
    models = [args.model] + ([args.compare] if args.compare else [])
    with flags_named(DATA_FLAGS):  # a data error names --data / --text-field / --tokenizer, not data.sources ...
        doc = evaluate(models, opts, show_progress=None if not args.no_progress else False)
    print_tables(doc)
    path = write_json(doc, args.out)
    print(f"wrote {path}")
    plots = write_plots(doc, args.out)
    if isinstance(plots, str):
        print(plots)
    else:
        for p in plots:
            print(f"wrote {p}")
    return 0
