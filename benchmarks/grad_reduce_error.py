"""Error of reducing bf16 gradients over data parallel in bf16 instead of fp32 (docs/distributed.md,
"Gradient reduction"): the numbers behind `optim.grad_accum_dtype: float32`'s fp32 reduction.

    torchrun --nproc_per_node 2 benchmarks/grad_reduce_error.py deepspeed [--micro-batches 8]
    python benchmarks/grad_reduce_error.py ring [--ranks 2,32,256,1024]

`deepspeed`: the tiny model with bf16 parameters under the real `DeepSpeedEngine` (ZeRO-2, DP 2 on
gloo, fp32 gradient accumulation, overlap_comm as shipped), one step of several micro-batches per
rank, run twice from the same weights and data: reduce-scatter in fp32 (the reference) and in bf16.
Compares this rank's fp32 gradient partition after the step's backward passes.

`ring`: what a ring reduce-scatter over N ranks does to each element (NCCL's reduce-scatter: N - 1
additions in sequence, the partial sum rounded to the wire dtype after each), emulated in one
process on N micro-batch gradients of the same model: bf16 wire vs fp32 wire vs an exact (fp64)
sum, streamed (one gradient in memory at a time).

Both print one JSON line: the relative error of the reduced gradient ||g - g_ref|| / ||g_ref||, its
largest element error relative to the largest element, and for scale the error of rounding the
exact result to bf16 once.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings

import torch

from dsa_train.config import OptimConfig, ParallelConfig, StageConfig, Trainable
from dsa_train.model import DSAForCausalLM, tiny_config
from dsa_train.stage import Stage

SEQ_LEN = 48


def make_model() -> DSAForCausalLM:
    torch.manual_seed(0)
    cfg = tiny_config(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                      num_hidden_layers=2, index_topk=16, max_position_embeddings=4096)
    return DSAForCausalLM(cfg).cast(torch.bfloat16)


def micro_batch(index: int, vocab: int) -> dict:
    """Micro-batch `index`: one row of random tokens (its own seed, so any rank can make any one)."""
    g = torch.Generator().manual_seed(1000 + index)
    ids = torch.randint(0, vocab, (1, SEQ_LEN), generator=g)
    return {"input_ids": ids, "labels": torch.roll(ids, -1, dims=1), "position_ids": torch.arange(SEQ_LEN)[None]}


def errors(value: torch.Tensor, reference: torch.Tensor) -> dict:
    value, reference = value.double(), reference.double()
    rounded = reference.to(torch.bfloat16).double()
    norm, peak = float(reference.norm()), float(reference.abs().max())
    return {"rel_norm": float((value - reference).norm()) / norm, "rel_max": float((value - reference).abs().max()) / peak,
            "bf16_rounding_rel_norm": float((rounded - reference).norm()) / norm}


def stage() -> Stage:
    return Stage.of("measure", StageConfig(trainable=Trainable.all, steps=1, global_batch_size=1, lr=1e-4, topk=16))


def deepspeed_main(micro_batches: int) -> dict:
    import torch.distributed as dist

    from dsa_train.trainer.step import forward_backward
    from dsa_train.parallel import deepspeed_compat
    from dsa_train.trainer.deepspeed_engine import DeepSpeedEngine
    from dsa_train.parallel.groups import destroy_parallel, init_parallel
    from dsa_train.parallel.reduction import parallel_reduction

    state = init_parallel(ParallelConfig(zero_stage=2, data_parallel=-1))
    vocab = make_model().config.vocab_size
    mine = [micro_batch(state.dp_rank + i * state.sizes.data, vocab) for i in range(micro_batches)]
    partitions = {}
    for name, reduce_fp32 in (("fp32", True), ("bf16", False)):
        model = make_model()
        engine = DeepSpeedEngine(model, stage(), OptimConfig(), state, zero_stage=2, reduce_fp32=reduce_fp32)
        assert engine.ds_config["communication_data_type"] == name
        forward_backward(engine, mine, stage(), reduction=parallel_reduction(state))
        # (DeepSpeed 0.19.8 fills a rank's compact fp32 partition buffer during the backward only on
        # some ranks -- here rank 0 --, the others' at the step: the ranks that hold one compare)
        buffers = deepspeed_compat.gradient_buffers(engine.ds.optimizer)
        partitions[name] = torch.cat([b.detach().double().flatten() for b in buffers]) if buffers else None
        engine.close()
    result = errors(partitions["bf16"], partitions["fp32"]) if partitions["fp32"] is not None else None
    if result:
        result["elements"] = partitions["fp32"].numel()
    every = [None] * state.sizes.world
    dist.all_gather_object(every, result)
    destroy_parallel()
    measured = [r for r in every if r]
    return {"mode": "deepspeed", "ranks": state.sizes.world, "micro_batches_per_rank": micro_batches,
            "ranks_compared": len(measured), **{k: max(r[k] for r in measured) for k in measured[0]}}


def flat_gradient(model: DSAForCausalLM, index: int) -> torch.Tensor:
    """One micro-batch's bf16 gradient of every parameter (LM + indexer loss of the sparse stage),
    flattened: what one rank contributes."""
    model.zero_grad(set_to_none=True)
    mb = micro_batch(index, model.config.vocab_size)
    out = model(mb["input_ids"], labels=mb["labels"], position_ids=mb["position_ids"], **stage().forward_kwargs(0))
    loss = out.lm_loss_sum / out.lm_tokens + out.indexer_loss
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def ring_main(ranks: list[int]) -> list[dict]:
    """Rank i's gradient is micro-batch i's; the chunk's partial sum travels the ring from rank 0."""
    model = make_model()
    out = []
    start = time.time()
    exact = fp32 = bf16 = None
    for i in range(max(ranks)):
        g = flat_gradient(model, i)
        if exact is None:
            exact, fp32, bf16 = g.double(), g.float(), g.clone()
        else:
            exact += g.double()
            fp32 = fp32 + g.float()  # fp32 wire: each hop adds in fp32
            bf16 = (bf16.float() + g.float()).to(torch.bfloat16)  # bf16 wire: each hop rounds to bf16
        if i + 1 in ranks:
            out.append({"mode": "ring", "ranks": i + 1, "elements": exact.numel(),
                        "bf16_wire": errors(bf16, exact), "fp32_wire": errors(fp32, exact), "seconds": round(time.time() - start, 1)})
            print(json.dumps(out[-1]), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["deepspeed", "ring"])
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--ranks", default="2,32,256,1024")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.mode == "deepspeed":
        print(json.dumps(deepspeed_main(args.micro_batches)), flush=True)
    else:
        ring_main(sorted(int(r) for r in args.ranks.split(",")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
