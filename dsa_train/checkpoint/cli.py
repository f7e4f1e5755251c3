"""`dsa-train export | inspect | make-tiny-checkpoint` (dispatched here by dsa_train/cli.py).

    dsa-train export SRC OUT [--dtype bfloat16|float32] [--fp8] [--ue8m0] [--max-shard-size 5GB]
                             [--tokenizer DIR] [--config HF_DIR_OR_CONFIG_JSON]
    dsa-train inspect PATH [--config HF_DIR_OR_CONFIG_JSON] [--check-values]
    dsa-train make-tiny-checkpoint OUT [--seed N] [--dense]

Exit status: 0 on success; 2 with one line `dsa-train <command>: <problem> — <fix>` when the
checkpoint cannot be read, loaded or written (the line names the tensor and file) and for usage
errors; 1 when `inspect` reports a problem in its report.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import time

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """'5GB' -> 5e9 bytes, '500MiB' -> 500 * 2^20, '1000' -> 1000 (Hugging Face's convention)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; use e.g. 5GB, 500MB, 2GiB or a byte count")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsa-train", description="checkpoint tools (docs/checkpoints.md)")
    sub = p.add_subparsers(dest="command", required=True)

    e = sub.add_parser("export", help="training checkpoint or HF directory -> DeepSeek-V3.2-Exp HF layout")
    e.add_argument("src", help="training checkpoint (step_* dir, its parent, or the run dir) or Hugging Face directory")
    e.add_argument("out", help="output directory")
    e.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="dtype of the tensors that are not FP8 (default bfloat16, as the reference)")
    e.add_argument("--fp8", action="store_true", help="FP8 e4m3 weights with 128x128 block scales, as the reference")
    e.add_argument("--ue8m0", action="store_true", help="power-of-two (ue8m0) scales; implies --fp8")
    e.add_argument("--max-shard-size", type=parse_size, default=parse_size("5GB"), help="shard size cap (default 5GB)")
    e.add_argument("--tokenizer", help="directory whose tokenizer files are copied (default: the source's)")
    e.add_argument("--config", help="model config for a training checkpoint without one (HF dir or config.json)")
    e.add_argument("--no-verify-checksums", action="store_true",
                   help="training checkpoint: check file sizes only, and accept one without manifest.json")

    i = sub.add_parser("inspect", help="architecture, parameters, dtypes, quantization, missing/unexpected keys "
                       "(from headers only; --check-values reads the values)")
    i.add_argument("path")
    i.add_argument("--config", help="model config for a training checkpoint without one")
    i.add_argument("--check-values", action="store_true",
                   help="read every tensor and check for NaN/inf (by default only the headers are read)")

    t = sub.add_parser("make-tiny-checkpoint", help="tiny random checkpoint in the DeepSeek-V3.1-Terminus layout")
    t.add_argument("out")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--dense", action="store_true", help="dense MLPs in every main layer (no MoE); MTP keeps its MoE")
    return p


def run(args: argparse.Namespace) -> int:
    import torch

    if args.command == "export":
        from .convert import export_checkpoint
        from .export import ExportOptions

        from . import training_source

        from .export import check_out

        check_out(args.out, args.src)  # before any work: only a new or empty folder or an earlier export
        training_source.VERIFY_CHECKSUMS = not args.no_verify_checksums
        options = ExportOptions(dtype=getattr(torch, args.dtype), fp8=args.fp8, ue8m0=args.ue8m0,
                                max_shard_bytes=args.max_shard_size)
        start = time.perf_counter()
        r = export_checkpoint(args.src, args.out, options, args.tokenizer, args.config)
        print(f"exported {args.src} -> {r.path}: {r.tensors} tensors ({r.fp8_tensors} FP8) in {len(r.files)} "
              f"shard(s), {r.total_bytes / 1e6:.1f} MB, tokenizer files {r.tokenizer_files or 'none'} "
              f"({time.perf_counter() - start:.1f} s)")
        return 0
    if args.command == "inspect":
        from .inspection import inspect_checkpoint

        report = inspect_checkpoint(args.path, args.config, check_values=args.check_values)
        print(report.text())
        return 1 if report.error or report.bad_values else 0
    if args.command == "make-tiny-checkpoint":
        from .export import TINY_KIND, check_out
        from .tiny import make_tiny_checkpoint

        check_out(args.out, kind=TINY_KIND)  # a new or empty folder, or an earlier tiny checkpoint (replaced)
        r = make_tiny_checkpoint(args.out, seed=args.seed, dense_mlp=args.dense)
        print(f"wrote {r.path}: DeepSeek-V3.1-Terminus layout, {r.tensors} tensors ({r.fp8_tensors} FP8), "
              f"{len(r.files)} shards, {r.total_bytes / 1e6:.1f} MB")
        return 0
    raise AssertionError(args.command)


def main(argv: list[str] | None = None) -> int:
    from dsa_train.errors import run_reporting

    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return run_reporting(lambda: run(args), prefix=f"dsa-train {args.command}")


if __name__ == "__main__":
    sys.exit(main())
