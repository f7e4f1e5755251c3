"""Distributed == single process, checked on any layout:

    torchrun --nproc_per_node 2 -m dsa_train.testing.selftest --zero 2
    torchrun --nproc_per_node 2 -m dsa_train.testing.selftest --ep 2 --zero 1
    torchrun --nproc_per_node 2 -m dsa_train.testing.selftest --tp 2
    torchrun --nproc_per_node 2 -m dsa_train.testing.selftest --cp 2 --seq-len 96 --topk 16

The Triton kernels (interpreted on the CPU) against a single process on the PyTorch references:

    DSA_KERNELS=triton TRITON_INTERPRET=1 torchrun --nproc_per_node 2 -m dsa_train.testing.selftest
        --cp 2 --seq-len 64 --reference-kernels ref --indexer-loss-atol 2e-6      (one command line)

Every rank builds the same tiny model and the same global batches, trains a single-process copy
with `dsa_train.trainer.Engine` (the reference), then the distributed model (`parallelize_model`
+ `DeepSpeedEngine`, data sharded by DP rank) for the same steps, and compares per step the LM
loss, indexer loss and gradient norm, the gradients of the last step and the final parameters.
Prints one JSON line per rank and ZeRO stage (rank 0 also appends them to --out) and exits 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import warnings
from unittest import mock

import torch
import torch.distributed as dist

from dsa_train.config import Attention, DType, OptimConfig, ParallelConfig, StageConfig, Trainable
from dsa_train.trainer.engine import Engine
from dsa_train.trainer.step import StepHooks, train_step
from dsa_train.model import DSAForCausalLM, tiny_config
from dsa_train.trainer.deepspeed_engine import DeepSpeedEngine
from dsa_train.parallel.groups import destroy_parallel, init_parallel
from dsa_train.parallel.model import full_tensor_slice, parallelize_model
from dsa_train.parallel.reduction import parallel_reduction
from dsa_train.stage import STAGE_KINDS, Stage, stage_kind
from dsa_train.testing import gradients


def make_batches(steps: int, global_batch: int, seq_len: int, vocab: int, seed: int):
    """Global batches of packed random documents: [G, T] input_ids / labels / position_ids."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (global_batch, seq_len), generator=g)
        pos = torch.empty_like(ids)
        labels = torch.roll(ids, -1, dims=1)
        for row in range(global_batch):
            # 1-3 documents per row
            cuts = sorted(torch.randint(seq_len // 4, seq_len, (int(torch.randint(0, 3, (1,), generator=g)),),
                                        generator=g).tolist())
            starts = [0, *cuts]
            ends = [*cuts, seq_len]
            for s, e in zip(starts, ends):
                pos[row, s:e] = torch.arange(e - s)
                labels[row, e - 1] = -100
        out.append({"input_ids": ids, "labels": labels, "position_ids": pos})
    return out


def split_micro(batch, rows, micro: int):
    sub = {k: v[rows] for k, v in batch.items()}
    n = sub["input_ids"].shape[0]
    return [{k: v[i : i + micro] for k, v in sub.items()} for i in range(0, n, micro)]


class KeepGradients(StepHooks):
    """A step hook keeping `read(engine)` (name -> gradient) between backward and the update."""

    def __init__(self, read):
        self.read = read
        self.grads: dict = {}

    def after_backward(self, engine, metrics: dict) -> None:
        self.grads = self.read(engine)


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--zero", default="0", help="ZeRO stage, or several: 1,2,3 (one reference run)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=48)
    p.add_argument("--topk", type=int, default=16)
    p.add_argument("--attention", choices=["dense", "sparse"], default="sparse")
    p.add_argument("--trainable", choices=sorted(STAGE_KINDS), default="all", help="the stage kind (dsa_train.stage)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--recompute", default="none", choices=["none", "attention", "moe", "full"])
    p.add_argument("--expert-loop", action="store_true", help="experts by a Python loop, not grouped GEMMs")
    p.add_argument("--rtol", type=float, default=2e-4)
    p.add_argument("--adam-eps", type=float, default=1e-6)
    p.add_argument("--bf16", action="store_true",
                   help="bf16 parameters (fp32 masters on both sides); compare with --rtol ~3e-2")
    p.add_argument("--mtp", action="store_true", help="an MTP layer trained with mtp_loss_coef 0.3")
    p.add_argument("--grad-accum-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="optim.grad_accum_dtype (bf16 parameters: accumulation and DP reduction dtype)")
    p.add_argument("--reference-kernels", choices=["same", "ref"], default="same",
                   help="ref: the single-process reference runs the PyTorch reference kernels "
                        "(DSA_KERNELS=ref) whatever DSA_KERNELS the distributed run uses, e.g. the "
                        "Triton kernels under TRITON_INTERPRET=1 against the references")
    p.add_argument("--indexer-loss-atol", type=float, default=0.0,
                   help="absolute slack for the indexer loss (added to --rtol's bound): a row's KL is a "
                        "difference of terms of size log(keys), so two implementations (the Triton kernels "
                        "vs the references) differ by fp32 rounding of those terms (~1e-7 to 1e-6), which "
                        "is not small relative to a near-zero KL")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    torch.set_num_threads(1)
    zero_stages = [int(z) for z in str(args.zero).split(",")]
    state = init_parallel(ParallelConfig(tensor_parallel=args.tp, context_parallel=args.cp,
                                         expert_parallel=args.ep, zero_stage=zero_stages[0]))
    dp = state.sizes.data
    torch.manual_seed(0)
    cfg = tiny_config(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                      num_hidden_layers=2, num_nextn_predict_layers=1 if args.mtp else 0, index_topk=args.topk,
                      max_position_embeddings=max(4096, args.seq_len))
    ref_model = DSAForCausalLM(cfg).to(state.device)
    if args.bf16:
        ref_model = ref_model.cast(torch.bfloat16)
    init_model = copy.deepcopy(ref_model)
    # the LM loss where the kind trains the model under it (an indexer-only kind: the indexer loss alone)
    lm_loss_coef = 1.0 if stage_kind(args.trainable).main_backward else 0.0
    stage_config = StageConfig(attention=Attention(args.attention), trainable=Trainable(args.trainable), steps=args.steps,
                               global_batch_size=args.global_batch, lr=args.lr, lm_loss_coef=lm_loss_coef,
                               indexer_loss_coef=1.0, topk=args.topk, mtp_loss_coef=0.3 if args.mtp else 0.0)
    stage = Stage.of("selftest", stage_config)
    # Adam eps 1e-6 (default 1e-8): Adam's update g / (sqrt(v) + eps) turns fp32 rounding noise of
    # near-zero gradients (sums that cancel) into O(lr) parameter differences at eps 1e-8, which
    # would hide real mismatches behind a loose tolerance.
    optim = OptimConfig(grad_clip=1.0, eps=args.adam_eps, grad_accum_dtype=DType(args.grad_accum_dtype))
    batches = [{k: v.to(state.device) for k, v in b.items()}
               for b in make_batches(args.steps, args.global_batch, args.seq_len, cfg.vocab_size, seed=1)]

    # ---- reference: one process, the whole global batch per step
    ref_engine = Engine(ref_model, stage, optim)
    ref_hist = []
    # the last step's gradients, as the update sees them
    ref_grads = KeepGradients(lambda e: {n: p.grad.detach().clone() for n, p in e.trainable if p.grad is not None})
    # --reference-kernels ref: DSA_KERNELS=ref for the reference only; the distributed run below has
    # the caller's DSA_KERNELS again
    with mock.patch.dict(os.environ, {"DSA_KERNELS": "ref"} if args.reference_kernels == "ref" else {}):
        for s, batch in enumerate(batches):
            mbs = split_micro(batch, list(range(args.global_batch)), args.micro_batch)
            ref_hist.append(train_step(ref_engine, mbs, stage, hooks=[ref_grads] if s == len(batches) - 1 else []))

    all_failures = []
    for zero in zero_stages:
        # ---- distributed
        model = copy.deepcopy(init_model)
        model = parallelize_model(model, state, recompute=args.recompute, grouped_experts=not args.expert_loop)
        engine = DeepSpeedEngine(model, stage, optim, state, zero_stage=zero, micro_batch_size=args.micro_batch)
        hist = []
        capture = None  # this rank's gradient contributions during the last step (ZeRO-0/1/2)
        grads = KeepGradients(lambda e: gradients.full_grads(e, capture))
        for s, batch in enumerate(batches):
            rows = list(range(state.dp_rank, args.global_batch, dp))
            mbs = split_micro(batch, rows, args.micro_batch)
            last = s == len(batches) - 1
            if last:
                capture = gradients.capture_gradients(engine)
            hist.append(train_step(engine, mbs, stage, reduction=parallel_reduction(state), hooks=[grads] if last else []))

        # ---- compare
        def rel(a, b):
            return float((a - b).abs().max() / max(float(b.abs().max()), 1e-6))

        failures = []
        worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
        for s, (a, b) in enumerate(zip(hist, ref_hist)):
            for key in ("lm_loss", "mtp_loss", "indexer_loss", "grad_norm"):
                if key in b:
                    slack = args.indexer_loss_atol if key == "indexer_loss" else 0.0
                    d = max(abs(a[key] - b[key]) - slack, 0.0) / max(abs(b[key]), 1e-6)
                    worst["loss"] = max(worst["loss"], d)
                    if not d <= args.rtol:  # NaN fails too
                        failures.append(f"step {s} {key}: {a[key]:.7g} vs single-process {b[key]:.7g}")
        ref_params = dict(ref_model.named_parameters())
        from deepspeed.utils import safe_get_full_fp32_param

        for name, p in engine.trainable:
            # bf16: compare the fp32 master weights (the bf16 copies differ by rounding ulps)
            ref_slice = full_tensor_slice(p, ref_engine.masters.get(name, ref_params[name]) if args.bf16 else ref_params[name])
            if name in ref_grads.grads:
                d = rel(grads.grads[name], full_tensor_slice(p, ref_grads.grads[name]))
                worst["grad"] = max(worst["grad"], d)
                if os.environ.get("SELFTEST_DEBUG"): print(name, float(grads.grads[name].abs().max()), float(ref_grads.grads[name].abs().max()), flush=True)
                if d > args.rtol * 5 and not args.bf16:  # bf16 gradients: reported, not checked
                    failures.append(f"grad {name}: rel diff {d:.3g}")
            value = safe_get_full_fp32_param(p) if (zero == 3 or (args.bf16 and zero >= 1)) else p.detach()
            d = float((value.float() - ref_slice.float()).abs().max())
            worst["param"] = max(worst["param"], d)
            # bf16: bf16 gradient rounding moves Adam's updates of near-zero gradients by O(lr):
            # master weights are reported, not checked (losses and grad norms are)
            if d > 0.02 * args.lr and not args.bf16:  # Adam: updates of near-zero gradients amplify rounding
                failures.append(f"param {name}: max abs diff {d:.3g}")
        result = {
            "layout": {"tp": args.tp, "cp": args.cp, "ep": args.ep, "dp": dp, "zero": zero, "recompute": args.recompute},
            "rank": state.rank,
            "losses": [[h.get("lm_loss"), h.get("indexer_loss"), h["grad_norm"]] for h in hist],
            "ref_losses": [[h.get("lm_loss"), h.get("indexer_loss"), h["grad_norm"]] for h in ref_hist],
            "worst": worst,
            "failures": failures[:10], "n_failures": len(failures), "failed_params": sorted({f.split()[1] for f in failures if f.startswith("param")})[:40],
            "metrics": {k: v for k, v in hist[-1].items() if k.startswith("moe/")},
        }
        print("SELFTEST " + json.dumps(result), flush=True)
        if args.out and state.rank == 0:
            with open(args.out, "a") as f:
                f.write(json.dumps(result) + "\n")
        all_failures += failures

    ok = torch.tensor([0.0 if all_failures else 1.0], device=state.device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    destroy_parallel()
    return 0 if ok.item() == 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())

