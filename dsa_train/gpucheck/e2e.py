"""`dsa-train gpu-check`'s end-to-end and NCCL steps (sections "end-to-end" and "nccl").

end-to-end.train_kill_resume
    The real trainer (`python -m dsa_train.launch.rank`: the recipe loader, the DeepSpeed ZeRO-2
    engine on megatron-core groups, one rank) runs both stages of `small_32k` (dense warm-up, then
    sparse) with its depth cut to 2 layers (one dense, one MoE), at its T = 32768, bf16, the
    Triton kernels (DSA_KERNELS=triton: a missing Triton path fails instead of falling back):
    warm-up 3 + sparse 4 steps (global 1-7), a checkpoint every 2 steps (global 2, 3 = warm-up
    end, 5, 7). Three runs of the same command:
      1. killed      DSA_FAULT=step=7,kind=sigkill,at=step: SIGKILL as global step 7 starts
                     (step 6 done, not checkpointed: its work is lost); alone on the device;
      2. reference   uninterrupted;                                 } side by side, after 1
      3. resumed     the killed run's command again: `checkpoint.resume=auto` loads step 5 and
                     runs steps 6 and 7.                               }
    All three set `deterministic=true` (torch's deterministic algorithms, the sparse MLA
    backward's ordered reduction, a fixed cuBLAS workspace). Judged bitwise, no tolerance:
      replay        the resumed step 6 recomputes, from the checkpoint, what the killed run
                    computed from its memory: same weights, router biases, batch and lr. Its
                    losses and lr must equal the killed run's step 6 bit for bit on any machine
                    (no forward kernel accumulates with atomics). Always required.
      continuation  when the killed run's steps 1-6 equal the reference's bit for bit (the runs
                    are reproducible here: the CPU), the resumed steps 6 and 7 must equal the
                    reference in every value, gradient norm included (step 7 checks the
                    restored optimizer moments through step 6's update). When two uninterrupted
                    runs already differ (backward kernels that add with atomics, e.g. the indexer
                    KL's key gradient, are not ordered by deterministic=true), no run can be
                    compared bitwise with another; the check still passes on the replay and
                    says "NOT reproducible here" with the run-to-run and resumed relative
                    differences, for the record.
    Any difference in what is required means state that the checkpoint lost or changed
    (weights, optimizer moments, data position, RNG, router biases, schedule), which is what the
    check is for. Reported per stage beside `dsa-train plan` for the same recipe and layout
    (computed in-process): tokens/s, MFU and step time of the killed run, which had the device to
    itself (median over the stage's steps after its first, which includes Triton compilation),
    and its peak memory (`torch.cuda.max_memory_allocated`: tensors only, no CUDA context or
    allocator cache).
nccl.ep2
    With >= 2 GPUs: `dsa-train launch torchrun --nproc-per-node 2` of the same model at T = 8192
    with expert parallel 2 x ZeRO-2 on the NCCL backend (NCCL_DEBUG=INFO: the check requires
    NCCL's own init lines in the log, so a run that silently used gloo does not pass). One GPU:
    skipped, saying so.

`--small --device cpu` (the command's CPU test, `make test`): the same three runs with the tiny
model (`model=tiny`, fp32) at T = 64 on the CPU (DeepSpeed with DS_ACCELERATOR=cpu, gloo, the
PyTorch reference kernels, DSA_KERNELS=ref: under the Triton interpreter a sparse step of this
model takes ~9 s instead of ~0.2 s), and `nccl.ep2` runs the same 2-rank EP2 launch on gloo,
labelled as such: the code path, not NCCL.

Needs what the trainer imports: hydra-core, omegaconf, DeepSpeed, megatron-core, tokenizers and
the core install (no `datasets`: the bundled corpus is read without it); each is looked up before anything runs
and a missing one is one failing line. W&B is never imported (`logging.wandb_mode=disabled`).
Logs and each run's `metrics.jsonl` are kept under `<out>/end-to-end/` and `<out>/nccl/`; the
checkpoints are deleted once a check passed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dsa_train.gpucheck.core import Check, Options, Outcome

RECIPE = "small_32k"
GPU_LAYERS = 2  # small_32k's first layer is dense, the others MoE: 2 keeps one of each
GPU_SEQ_LEN = 32768  # small_32k's T
NCCL_SEQ_LEN = 8192  # the NCCL run checks communication: above top-k 2048, short
SMALL_SEQ_LEN = 64
WARMUP_STEPS, SPARSE_STEPS = 3, 4
CHECKPOINT_EVERY = 2  # checkpoints at global steps 2, 3 (warm-up end), 5, 7 (sparse end)
RESUME_STEP = WARMUP_STEPS + 2  # the newest checkpoint when the kill comes (global step 5)
KILL_STEP = RESUME_STEP + 2  # SIGKILL as global step 7 starts: step 6 is done, not checkpointed
# end-to-end.throughput: the steady state the kill/resume runs are too short (and deterministic) to show.
# Each stage's first THROUGHPUT_SKIPPED steps compile and autotune the kernels; the profiled steps are
# the warm-up's last and the sparse stage's last (global numbering), and are left out of the medians
# (the profiler slows a step: 0.86 s against 0.16 s for a warm-up step on the H200, session 2)
THROUGHPUT_WARMUP_STEPS, THROUGHPUT_SPARSE_STEPS = 5, 8
THROUGHPUT_SKIPPED = 2
SMALL_THROUGHPUT = (3, 2, 1)  # --small (the CPU form: the code path, not a figure): warm-up, sparse, skipped


def throughput_steps(small: bool) -> tuple[int, int, int, tuple[int, int]]:
    """(warm-up steps, sparse steps, steps skipped per stage, profiled global steps) of end-to-end.throughput."""
    warmup, sparse, skipped = SMALL_THROUGHPUT if small else (THROUGHPUT_WARMUP_STEPS, THROUGHPUT_SPARSE_STEPS,
                                                              THROUGHPUT_SKIPPED)
    return warmup, sparse, skipped, (warmup, warmup + sparse)
COMPARED = ("train/loss", "train/lm_loss", "train/indexer_loss", "optim/grad_norm", "optim/lr")
REPLAYED = ("train/loss", "train/lm_loss", "train/indexer_loss", "optim/lr")  # forward values and the schedule

# module the trainer imports -> the pip distribution that provides it. `datasets` is not needed: the
# runs read the bundled corpus, which the data loader reads without it (dsa_train/data/sources.py).
REQUIRED = {
    "hydra": "hydra-core", "omegaconf": "omegaconf", "deepspeed": "deepspeed", "megatron.core": "megatron-core",
    "tokenizers": "tokenizers", "safetensors": "safetensors", "rich": "rich",
}
# inherited variables that would change what the runs do (fault switch, a torchrun/Slurm rank's
# identity and restart count, a shared W&B service, a forced backend)
STRIPPED_ENV = (
    "DSA_FAULT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
    "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT", "WANDB_SERVICE", "DSA_TRAIN_BACKEND",
)


class StepFailed(Exception):
    """One line: why a check's step failed (the check's Outcome summary)."""


@dataclass(frozen=True)
class Layout:
    """What the runs of one check train, as recipe overrides of `small_32k`."""

    device: str  # "cuda" | "cpu"
    small: bool
    seq_len: int
    world: int = 1

    @property
    def model_overrides(self) -> list[str]:
        if self.small:  # the tiny model; fp32 on the CPU (bf16 matmuls there are slow and not the point)
            return ["model=tiny", f"model.dtype={'float32' if self.device == 'cpu' else 'bfloat16'}",
                    "stages.sparse.topk=16", "stages.sparse.topk_recall_queries=8"]
        return [f"model.arch.num_hidden_layers={GPU_LAYERS}"]

    def overrides(self, run_dir: Path, warmup_steps: int, sparse_steps: int, checkpoint_every: int,
                  deterministic: bool = True) -> list[str]:
        batch = self.world  # one sequence per data-parallel rank per step
        return [
            f"run_dir={run_dir}", f"device={self.device}", "~stages.pretrain", *self.model_overrides,
            f"data.seq_len={self.seq_len}", "data.micro_batch_size=1", "probe_batches=0",
            "logging.wandb_mode=disabled", "logging.progress_bar=false", f"deterministic={str(deterministic).lower()}",
            f"stages.warmup.steps={warmup_steps}", f"stages.warmup.global_batch_size={batch}",
            f"stages.sparse.steps={sparse_steps}", f"stages.sparse.global_batch_size={batch}",
            "stages.sparse.warmup_steps=1", f"checkpoint.every_n_steps={checkpoint_every}", "checkpoint.keep_last=2",
            "checkpoint.export=false", "parallel=zero2",
            *(["parallel.expert_parallel=2"] if self.world == 2 else []),
        ]

    def describe(self) -> str:
        model = "tiny model, fp32" if self.small and self.device == "cpu" else (
            "tiny model, bf16" if self.small else f"{RECIPE} cut to {GPU_LAYERS} layers (1 dense + 1 MoE), bf16")
        parallel = "EP2 x ZeRO-2, 2 ranks" if self.world == 2 else "ZeRO-2, 1 rank"
        return f"{model}, T={self.seq_len}, {parallel}, {kernels_label(self.device)}, {self.device}"


def kernels_label(device: str) -> str:
    return "Triton kernels" if device == "cuda" else "PyTorch reference kernels"


def single_layout(opts: Options) -> Layout:
    return Layout(opts.device, opts.small, SMALL_SEQ_LEN if opts.small else GPU_SEQ_LEN)


def nccl_layout(opts: Options) -> Layout:
    return Layout(opts.device, opts.small, SMALL_SEQ_LEN if opts.small else NCCL_SEQ_LEN, world=2)


# ---------------------------------------------------------------------------------------- checks
def checks(opts: Options) -> list[Check]:
    one, two = single_layout(opts), nccl_layout(opts)
    warmup, sparse, skipped, profiled = throughput_steps(opts.small)
    steps = (f"warm-up {WARMUP_STEPS} + sparse {SPARSE_STEPS} steps, checkpoint every {CHECKPOINT_EVERY}, "
             f"SIGKILL at step {KILL_STEP}, resume; vs dsa-train plan")
    nccl = ("2-rank EP2 launch on gloo (the CPU stand-in for NCCL)" if opts.device == "cpu"
            else "2-rank EP2 launch on NCCL (>= 2 GPUs; else skipped)")
    e, h, inter, rows = GROUPED_SMALL if opts.small else GROUPED_GPU
    return [
        Check("end-to-end.grouped_experts", "end-to-end",
              f"the routed experts as the runs below compute them: {e} experts (one idle), hidden {h}, intermediate "
              f"{inter}, {rows} routed rows, weights in a DeepSpeed-style flat buffer, "
              f"{'fp32' if opts.device == 'cpu' else 'bf16'}; grouped GEMMs vs the per-expert loop vs fp32, "
              "out + dx + dW", run_grouped_experts),
        Check("end-to-end.train_kill_resume", "end-to-end", f"{one.describe()}; {steps}", run_train_kill_resume),
        Check("end-to-end.throughput", "end-to-end",
              f"{one.describe()}; warm-up {warmup} + sparse {sparse} steps, deterministic=false, "
              f"torch.profiler on steps {profiled}; median of each stage's unprofiled steps after its first "
              f"{skipped} vs dsa-train plan", run_throughput),
        Check("nccl.ep2", "nccl", f"{two.describe()}; warm-up 1 + sparse 2 steps; {nccl}", run_nccl_ep2),
    ]


# end-to-end.grouped_experts: small_32k's MoE layer (32 experts, hidden 1024, intermediate 512) on one
# micro-batch's routed rows (T = 32768 x top-4); the CPU form's tiny model
GROUPED_GPU = (32, 1024, 512, 32768 * 4)
GROUPED_SMALL = (8, 128, 64, 64 * 2)
GROUPED_TOL = 2e-2  # bf16 operands, fp32 accumulation: relative to the reference's largest value


def run_grouped_experts(opts: Options) -> Outcome:
    """The grouped expert GEMMs the training runs use on this device (`expert_gemm_path`), with the
    weights as views of one flat buffer (gate, up, down of each expert after the other, as
    DeepSpeed's ZeRO-1/2 flattening leaves them), against the per-expert loop, both against an fp32
    loop: forward output, input gradient and weight gradients. Passes when the grouped error is
    within GROUPED_TOL or twice the loop's own. Before the runs: a grouped GEMM that fails or
    computes wrong here is named on its own line (`parallel.grouped_experts=false` runs the loop)."""
    import torch

    from dsa_train.gpucheck.compare import compare
    from dsa_train.model.grouped_experts import expert_gemm_path, expert_offsets, grouped_expert_mlp, stacked_weights

    started = time.monotonic()
    e, h, inter, rows = GROUPED_SMALL if opts.small else GROUPED_GPU
    device = torch.device("cuda" if opts.device == "cuda" else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    shapes = [(inter, h), (inter, h), (h, inter)]  # gate, up, down (nn.Linear layout)
    flat = torch.randn(e * sum(a * b for a, b in shapes), generator=g).mul_(0.02).to(device, dtype)
    weights, offset = [[], [], []], 0
    for _ in range(e):
        for k, (a, b) in enumerate(shapes):
            weights[k].append(flat[offset : offset + a * b].view(a, b).detach().requires_grad_())
            offset += a * b
    share = torch.rand(e, generator=g)
    share[e // 2] = 0.0  # an idle expert, as routing leaves some
    counts = (share / share.sum() * rows).floor().long()
    counts[0] += rows - int(counts.sum())
    x = torch.randn(rows, h, generator=g).to(device, dtype).requires_grad_()
    dy = torch.randn(rows, h, generator=g).to(device, dtype)
    path = expert_gemm_path(dtype, device.type, h, inter)

    def grads(out, leaves):
        return torch.autograd.grad(out, leaves, dy.to(out.dtype))

    def loop(xs, ws):
        outs, start = [], 0
        for i, n in enumerate(counts.tolist()):
            xe = xs[start : start + n]
            outs.append(torch.nn.functional.linear(torch.nn.functional.silu(xe @ ws[0][i].t()) * (xe @ ws[1][i].t()),
                                                   ws[2][i]))
            start += n
        return torch.cat(outs)

    leaves = [x, *[w for ws in weights for w in ws]]
    try:
        stacks = [stacked_weights(ws) for ws in weights]
        out = grouped_expert_mlp(x, expert_offsets(counts.to(device), device), *stacks, path=path)
        got = [out, *grads(out, leaves)]
    except Exception as err:  # noqa: BLE001 - the one line names it
        return Outcome("fail", f"grouped expert GEMMs ({path}, {dtype}) failed: {type(err).__name__}: "
                               f"{str(err).splitlines()[0] if str(err) else ''} (parallel.grouped_experts=false runs the loop)")
    out = loop(x, weights)
    low = [out, *grads(out, leaves)]
    x32 = x.detach().float().requires_grad_()
    w32 = [[w.detach().float().requires_grad_() for w in ws] for ws in weights]
    out = loop(x32, w32)
    ref = [out, *grads(out, [x32, *[w for ws in w32 for w in ws]])]
    names = ["out", "dx"] + [f"d{p}" for p in ("gate", "up", "down") for _ in range(e)]
    results: dict[str, dict] = {}
    for name, a, b, r in zip(names, got, low, ref):
        if name in ("out", "dx") or name not in results:
            results.setdefault(name, {"grouped": 0.0, "loop": 0.0})
        results[name]["grouped"] = max(results[name]["grouped"], compare(a, r, GROUPED_TOL)["err"])
        results[name]["loop"] = max(results[name]["loop"], compare(b, r, GROUPED_TOL)["err"])
    bad = [k for k, v in results.items() if not (v["grouped"] <= max(GROUPED_TOL, 2 * v["loop"]))]
    parts = ", ".join(f"{k} {v['grouped']:.2g} (loop {v['loop']:.2g})" for k, v in results.items())
    metrics = {"path": path, "dtype": str(dtype), "experts": e, "hidden": h, "intermediate": inter, "rows": rows,
               "errors": results, "tol": GROUPED_TOL, "seconds": round(time.monotonic() - started, 2)}
    summary = f"{path} grouped GEMMs vs fp32 loop (max relative error): {parts}"
    return Outcome("fail" if bad else "pass", ("FAILED " + ", ".join(bad) + ": " if bad else "") + summary, metrics)


run_grouped_experts.need_s = 10.0


def run_throughput(opts: Options) -> Outcome:
    try:
        return _throughput(opts)
    except StepFailed as err:
        return Outcome("fail", str(err))


def run_train_kill_resume(opts: Options) -> Outcome:
    try:
        return _train_kill_resume(opts)
    except StepFailed as err:
        return Outcome("fail", str(err))


# seconds on one GPU for budget.check_need_s: the kill/resume check measured 154 s on an H200 (the first
# GPU session, docs/gpu-check/NVIDIA-H200/session-1); the throughput run and NCCL are estimates
run_train_kill_resume.need_s = 180.0
run_throughput.need_s = 150.0


def run_nccl_ep2(opts: Options) -> Outcome:
    if opts.device == "cuda":
        import torch

        count = torch.cuda.device_count()
        if count < 2:
            return Outcome("skip", "one GPU: NCCL not exercised" if count == 1 else "no CUDA GPU: NCCL not exercised",
                           {"gpus": count})
    try:
        return _nccl_ep2(opts)
    except StepFailed as err:
        return Outcome("fail", str(err))


# ----------------------------------------------------------------------------- end to end on one GPU
def _train_kill_resume(opts: Options) -> Outcome:
    started = time.monotonic()
    work = _fresh_work_dir(opts, "end-to-end")
    layout = single_layout(opts)
    plan = plan_estimate(layout, work / "plan-run")  # also checks the overrides before any run starts
    reference_dir, resumed_dir = work / "reference", work / "killed_then_resumed"
    extra = peak_flops_overrides(layout)
    ref_cmd = trainer_command(layout, reference_dir, extra)
    run_cmd = trainer_command(layout, resumed_dir, extra)
    fault = f"step={KILL_STEP},kind=sigkill,at=step"
    # the killed run first and alone on the device: its steps 1-6 give the stage figures (Triton
    # compiles there, once: the later runs find the cache); then the reference and the resume,
    # which do not depend on each other, side by side
    killed = run_logged(opts, run_cmd, work / "killed.log", fault=fault)
    if killed != -signal.SIGKILL:
        raise StepFailed(f"the run with DSA_FAULT={fault} exited {killed}, not by SIGKILL: "
                         f"{last_error(work / 'killed.log')} (log: {work / 'killed.log'})")
    from dsa_train.checkpoint.training import read_latest

    resumed_from = read_latest(resumed_dir / "checkpoints")
    if resumed_from != f"step_{RESUME_STEP:08d}":
        raise StepFailed(f"after the kill the newest checkpoint is {resumed_from}, expected step_{RESUME_STEP:08d} "
                         f"(log: {work / 'killed.log'})")
    ref, code = run_together(opts, [(ref_cmd, work / "reference.log", None), (run_cmd, work / "resumed.log", None)])
    if ref != 0:
        raise StepFailed(f"reference run exited {ref}: {last_error(work / 'reference.log')} "
                         f"(log: {work / 'reference.log'})")
    if code != 0:
        raise StepFailed(f"resumed run exited {code}: {last_error(work / 'resumed.log')} (log: {work / 'resumed.log'})")

    steps = WARMUP_STEPS + SPARSE_STEPS
    reference = attempts(reference_dir)
    runs = attempts(resumed_dir)
    if len(reference) != 1 or len(runs) != 2:
        raise StepFailed(f"{len(reference)} start(s) in {reference_dir / 'metrics.jsonl'} and {len(runs)} in "
                         f"{resumed_dir / 'metrics.jsonl'}, expected 1 and 2 (logs: {work})")
    ref_rows, killed_rows, resumed_rows = by_step(reference[0]), by_step(runs[0]), by_step(runs[1])
    for what, rows, first, last in (("reference", ref_rows, 1, steps), ("killed", killed_rows, 1, KILL_STEP - 1),
                                    ("resumed", resumed_rows, RESUME_STEP + 1, steps)):
        if sorted(rows) != list(range(first, last + 1)):
            raise StepFailed(f"the {what} run logged global steps {sorted(rows)}, expected {first}..{last} (logs: {work})")
    status, verdict, resume = judge_resume(ref_rows, killed_rows, resumed_rows)
    losses = {str(s): {"reference": ref_rows[s]["train/loss"], "killed": killed_rows.get(s, {}).get("train/loss"),
                       "resumed": resumed_rows[s]["train/loss"]} for s in sorted(resumed_rows)}
    resume.update(fault=fault, resumed_from=resumed_from, losses=losses)
    stages = stage_figures(runs[0]["stages"], killed_rows, layout.device, plan)
    metrics = {"layout": layout.describe(), "recipe": RECIPE, "seq_len": layout.seq_len, "stages": stages,
               "deterministic": True,  # the figures too: the sparse MLA backward's ordered reduction
               "resume": resume, "plan": plan, "seconds": round(time.monotonic() - started, 1),
               "logs": str(work)}
    figures = "; ".join(f"{name} {s['tokens_per_s']:.0f} tok/s (plan {s['plan_tokens_per_s']:.0f}), MFU "
                        f"{fmt_pct(s['mfu'])} (plan {fmt_pct(s['plan_mfu'])}), peak {s['peak_memory_gib']:.2f} GiB "
                        f"{s['peak_memory_kind']} (plan {s['plan_gib']:.2f})" for name, s in stages.items())
    if status == "pass":
        for run_dir in (reference_dir, resumed_dir):  # GBs at 32K; logs and metrics.jsonl stay
            shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return Outcome(status, f"SIGKILL at step {KILL_STEP}, resumed from {resumed_from}: {verdict}; {figures}", metrics)


def _throughput(opts: Options) -> Outcome:
    """One uninterrupted run, not deterministic (the kernels' fast paths), long enough that each
    stage's median is over steps after compilation and autotuning; two steps under torch.profiler
    (their tables are kept beside the logs and their top kernels go into the report)."""
    started = time.monotonic()
    work = _fresh_work_dir(opts, "throughput")
    layout = single_layout(opts)
    plan = plan_estimate(layout, work / "plan-run")
    run_dir = work / "run"
    warmup, sparse, skipped, profiled = throughput_steps(opts.small)
    cmd = [sys.executable, "-m", "dsa_train.launch.rank", "--config-name", RECIPE,
           *layout.overrides(run_dir, warmup, sparse, 0, deterministic=False),
           f"logging.profile_steps=[{','.join(map(str, profiled))}]", *peak_flops_overrides(layout)]
    log = work / "run.log"
    code = run_logged(opts, cmd, log)
    if code != 0:
        raise StepFailed(f"the throughput run exited {code}: {last_error(log)} (log: {log})")
    runs = attempts(run_dir)
    rows = by_step(runs[-1]) if runs else {}
    if sorted(rows) != list(range(1, warmup + sparse + 1)):
        raise StepFailed(f"the throughput run logged global steps {sorted(rows)} (log: {log})")
    stages = stage_figures(runs[-1]["stages"], rows, layout.device, plan, skip=skipped, leave_out=profiled)
    from dsa_train.logging.profile import profile_path

    profiles, overhead = {}, {}
    for step in profiled:
        path = profile_path(run_dir, step, 0, ".txt")
        if not path.is_file():
            raise StepFailed(f"logging.profile_steps wrote no {path}")
        shutil.copy2(path, work / path.name)
        profiles[str(step)] = top_rows(path.read_text(), 12)
        overhead[str(step)] = host_overhead(path.read_text())
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    metrics = {"layout": layout.describe(), "recipe": RECIPE, "seq_len": layout.seq_len, "stages": stages,
               "deterministic": False, "plan": plan, "profiles": profiles, "host_overhead": overhead,
               "skipped_steps": skipped,
               "profiled_by": "self device time" if layout.device == "cuda" else "self CPU time", "seconds": round(time.monotonic() - started, 1),
               "per_step": {str(s): {"stage": r["progress/stage"], "step_time_s": r["perf/step_time_s"],
                                     "tokens_per_s": r["perf/tokens_per_s"]} for s, r in rows.items()},
               "logs": str(work)}
    figures = "; ".join(f"{name} {s['tokens_per_s']:.0f} tok/s (plan {s['plan_tokens_per_s']:.0f}), MFU "
                        f"{fmt_pct(s['mfu'])} (plan {fmt_pct(s['plan_mfu'])}), step {s['step_time_s']:.3g} s "
                        f"(plan {s['plan_step_s']:.3g}), peak {s['peak_memory_gib']:.2f} GiB" for name, s in stages.items())
    last = overhead[str(profiled[-1])]
    host = (f"; profiled sparse step {profiled[-1]}: {last['kernel_launches']} kernel launches, "
            f"{last['syncs']} synchronizations, {last['host_reads']} host reads (_local_scalar_dense), "
            f"{last['aten::mm']} mm + {last['aten::_grouped_mm']} grouped mm, CPU {last['self_cpu_ms']:.0f} ms vs "
            f"device {last['self_device_ms']:.0f} ms")
    return Outcome("pass", f"steady state over steps after each stage's first {skipped}: {figures}{host}", metrics)


# what a profiled step asks of the host (the calls section of logging/profile.py's table): kernel
# launches, synchronizations (each a host wait for the device), copies, host reads, the GEMM counts
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaLaunchCooperativeKernel")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
COPIES = ("cudaMemcpyAsync", "cudaMemcpy")
COUNTED_OPS = ("aten::_local_scalar_dense", "aten::mm", "aten::_grouped_mm", "aten::isfinite", "aten::_foreach_norm",
               "aten::linalg_vector_norm")


def host_overhead(table: str) -> dict:
    """{kernel_launches, syncs, copies, host_reads, <COUNTED_OPS calls>, events, self_cpu_ms,
    self_device_ms} of one profiled step, from its table's calls section (`dsa_train.logging.profile`;
    zeros where the table has none, e.g. a CPU run has no CUDA launches)."""
    from dsa_train.logging.profile import CALLS_HEADER

    calls: dict[str, int] = {}
    cpu_us = device_us = 0.0
    lines = table.split(CALLS_HEADER, 1)[1].splitlines() if CALLS_HEADER in table else []
    for line in lines:
        parts = line.split("\t")
        if len(parts) != 4:
            continue
        name, n, cpu, dev = parts
        calls[name] = calls.get(name, 0) + int(n)
        cpu_us += float(cpu)
        device_us += float(dev)
    out = {"kernel_launches": sum(calls.get(k, 0) for k in LAUNCHES), "syncs": sum(calls.get(k, 0) for k in SYNCS),
           "copies": sum(calls.get(k, 0) for k in COPIES), "host_reads": calls.get("aten::_local_scalar_dense", 0)}
    out.update({k: calls.get(k, 0) for k in COUNTED_OPS if k != "aten::_local_scalar_dense"})
    out.update(events=sum(calls.values()), self_cpu_ms=round(cpu_us / 1e3, 2), self_device_ms=round(device_us / 1e3, 2))
    return out


def top_rows(table: str, n: int) -> list[str]:
    """The first `n` operator rows of a profile table's first section (the header and rules left out)."""
    rows, seen_header = [], False
    for line in table.splitlines():
        if line.startswith("## ") and seen_header and rows:
            break
        if line.strip().startswith("Name"):
            seen_header = True
            continue
        if seen_header and line.strip() and not line.startswith(("-", "#", "Self ")) and len(rows) < n:
            rows.append(" ".join(line.split()))
    return rows


def compare(reference: dict[int, dict], got: dict[int, dict], keys=COMPARED) -> list[dict]:
    """Every value of `keys` in `got` that is not exactly the reference's (a missing or non-finite
    value -- None in metrics.jsonl -- is a difference too)."""
    out = []
    for step in sorted(got):
        for key in keys:
            ref, value = reference[step].get(key, "absent"), got[step].get(key, "absent")
            if ref is None or value is None or ref != value:
                out.append({"step": step, "key": key, "reference": ref, "got": value})
    return out


def _show(d: dict) -> str:
    return f"step {d['step']} {d['key']} {d['got']!r} vs {d['reference']!r}"


def judge_resume(reference: dict[int, dict], killed: dict[int, dict], resumed: dict[int, dict]) -> tuple[str, str, dict]:
    """(status, one-line verdict, details) of the resume, from the three runs' per-step metrics.

    replay: the resumed run's first step recomputes, from the checkpoint, a step that the killed
        run had completed after writing it: same weights, router biases, batch and lr, so its
        forward values (losses) and lr must be bitwise the killed run's, on any machine (no
        forward kernel accumulates with atomics). Always required.
    reproducible: the killed run's steps before the kill equal the uninterrupted run's bitwise.
        When they do, the resumed steps must too, every compared value (gradient norm included:
        it also checks the restored optimizer moments through the next update). When they do not
        (backward kernels with atomic adds under deterministic=true), two uninterrupted runs
        already differ, so the resumed steps are compared with the run-to-run spread only for the
        record, and the verdict says so."""
    run_to_run = compare(reference, killed)
    replay = compare(killed, {RESUME_STEP + 1: resumed[RESUME_STEP + 1]}, keys=REPLAYED)
    continued = compare(reference, resumed)
    details = {
        "killed_at_step": KILL_STEP, "first_resumed_step": RESUME_STEP + 1, "compared_keys": list(COMPARED),
        "replayed_keys": list(REPLAYED), "replay_equal": not replay, "reproducible": not run_to_run,
        "equal": not continued, "differences": continued[:10], "replay_differences": replay[:10],
        "run_to_run_differences": run_to_run[:10],
        "max_rel_diff": _max_rel(reference, resumed), "run_to_run_max_rel_diff": _max_rel(reference, killed),
    }
    steps = f"steps {RESUME_STEP + 1}-{max(resumed)}"
    if replay:
        return "fail", (f"the replayed step differs from the killed run's (same checkpointed state and batch): "
                        f"{_show(replay[0])}"), details
    if not run_to_run:
        if continued:
            return "fail", (f"{steps} differ from the uninterrupted run although the runs before the kill were "
                            f"bitwise equal: {_show(continued[0])} ({len(continued)} values)"), details
        return "pass", f"{steps} bitwise equal to the uninterrupted run", details
    return "pass", (f"replayed step {RESUME_STEP + 1} bitwise equal to the killed run's; NOT reproducible here: two "
                    f"uninterrupted runs already differ ({_show(run_to_run[0])}; max rel "
                    f"{details['run_to_run_max_rel_diff']:.1e}), resumed {steps} within max rel "
                    f"{details['max_rel_diff']:.1e} of the uninterrupted run"), details


def _max_rel(reference: dict[int, dict], got: dict[int, dict]) -> float:
    """Largest |got - reference| / |reference| over the compared values present in both (finite)."""
    worst = 0.0
    for step, row in got.items():
        for key in COMPARED:
            a, b = reference[step].get(key), row.get(key)
            if isinstance(a, float) and isinstance(b, float) and a != b:
                worst = max(worst, abs(b - a) / max(abs(a), 1e-30))
    return worst


def stage_figures(stage_names, rows: dict[int, dict], device: str, plan: dict, skip: int = 1,
                  leave_out: tuple[int, ...] = ()) -> dict[str, dict]:
    """Per stage: median tokens/s, MFU, step time over the stage's steps after its first (which
    includes Triton compilation and engine start), the peak memory over all its steps, beside the
    plan's figures for the stage. `rows`: the run that had the device to itself (the killed one,
    steps 1-6: warm-up 1-3, sparse 4-6)."""
    planned = {s["stage"]: s for s in plan["stages"]}
    out = {}
    for index, name in enumerate(stage_names):
        stage_rows = [rows[s] for s in sorted(rows) if rows[s]["progress/stage"] == index]
        if not stage_rows:
            raise StepFailed(f"the reference run logged no step of stage {name}")
        timed = [r for r in stage_rows[skip:] if int(r["progress/global_step"]) not in leave_out] or stage_rows
        memory_key = "perf/cuda_max_allocated_gib" if device == "cuda" else "perf/memory_rss_gib"
        p = planned[name]
        tokens_per_step = p["step_detail"]["tokens_per_step"]
        out[name] = {
            "steps": len(stage_rows), "timed_steps": len(timed),
            "tokens_per_s": statistics.median(r["perf/tokens_per_s"] for r in timed),
            "mfu": statistics.median(r["perf/mfu"] for r in timed) if plan.get("peak_flops_known", True) else None,
            "step_time_s": statistics.median(r["perf/step_time_s"] for r in timed),
            "peak_memory_gib": max(r[memory_key] for r in stage_rows),
            "peak_memory_kind": "allocated" if device == "cuda" else "RSS",
            "plan_gib": p["total_gib"], "plan_gib_by_category": p["gib"],
            "plan_step_s": p["step_s"], "plan_tokens_per_s": tokens_per_step / p["step_s"] if p["step_s"] else None,
            # the MFU the trainer would report at the plan's step time (the same model FLOPs, `Stage.flops_per_token`)
            "plan_mfu": p["step_detail"]["mfu"],
        }
    return out


def fmt_pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def markdown_lines(result: dict) -> list[str]:
    """report.md lines for the end-to-end check's result (the runner's result dict: name,
    status, summary, metrics): the stage figures beside the plan and the resumed losses."""
    m = result.get("metrics") or {}
    if "stages" not in m:
        return []
    title = "steady state (end-to-end.throughput)" if result.get("name") == "end-to-end.throughput" else "kill and resume"
    out = [f"### End to end, {title}: measured beside `dsa-train plan`", "",
           f"{m['layout']}{'' if m.get('deterministic', True) else ', deterministic=false'}.", "",
           "| stage | tokens/s | plan tokens/s | MFU | plan MFU | step s | plan step s | peak GiB | plan GiB |",
           "|---|---|---|---|---|---|---|---|---|"]
    for name, s in m["stages"].items():
        plan_tps = "n/a" if s["plan_tokens_per_s"] is None else f"{s['plan_tokens_per_s']:.0f}"
        out.append(f"| {name} | {s['tokens_per_s']:.0f} | {plan_tps} | {fmt_pct(s['mfu'])} | {fmt_pct(s['plan_mfu'])} | "
                   f"{s['step_time_s']:.3g} | {s['plan_step_s']:.3g} | {s['peak_memory_gib']:.2f} "
                   f"({s['peak_memory_kind']}) | {s['plan_gib']:.2f} |")
    r = m.get("resume") or {}
    if r.get("losses"):
        out += ["", f"Resume ({r['fault']}, from {r['resumed_from']}): replay bitwise "
                    f"{'yes' if r['replay_equal'] else '**NO**'}, "
                    f"runs reproducible {'yes' if r['reproducible'] else 'no'}, resumed = uninterrupted bitwise "
                    f"{'yes' if r['equal'] else 'no'} (max rel {r['max_rel_diff']:.1e}).", "",
                "| step | uninterrupted loss | killed run's loss | resumed loss |", "|---|---|---|---|"]
        for step, v in r["losses"].items():
            killed = "—" if v["killed"] is None else repr(v["killed"])
            out.append(f"| {step} | {v['reference']!r} | {killed} | {v['resumed']!r} |")
    if m.get("host_overhead"):
        out += ["", "Host overhead of the profiled steps (torch.profiler's calls; docs/training.md, \"Host overhead of "
                    "a step\"):", "",
                "| step | kernel launches | synchronizations | copies | host reads | mm | grouped mm | isfinite | "
                "self CPU ms | self device ms |", "|---|---|---|---|---|---|---|---|---|---|"]
        for step, h in m["host_overhead"].items():
            out.append(f"| {step} | {h['kernel_launches']} | {h['syncs']} | {h['copies']} | {h['host_reads']} | "
                       f"{h['aten::mm']} | {h['aten::_grouped_mm']} | {h['aten::isfinite']} | {h['self_cpu_ms']:.1f} | "
                       f"{h['self_device_ms']:.1f} |")
    for step, rows in (m.get("profiles") or {}).items():
        out += ["", f"torch.profiler, global step {step}, top operators by {m.get('profiled_by', 'self device time')} "
                    "(name, self %, self time, total %, total time, time per call, calls):", "", "```", *rows, "```"]
    return out + [""]


# ------------------------------------------------------------------------------------------- NCCL
def _nccl_ep2(opts: Options) -> Outcome:
    started = time.monotonic()
    work = _fresh_work_dir(opts, "nccl")
    layout = nccl_layout(opts)
    run_dir = work / "ep2"
    (port,) = free_ports(1)
    cmd = [sys.executable, "-m", "dsa_train.cli", "launch", "torchrun", "--nproc-per-node", "2", "--master-port",
           str(port), "--run-id", f"gpucheck-{port}", "--max-restarts", "0", "--config-name", RECIPE,
           *layout.overrides(run_dir, 1, 2, 0), *peak_flops_overrides(layout)]
    env = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT"} if layout.device == "cuda" else {}
    log = work / "ep2.log"
    code = run_logged(opts, cmd, log, env=env, single_rank=False)
    if code != 0:
        raise StepFailed(f"2-rank EP2 launch exited {code}: {last_error(log)} (log: {log})")
    runs = attempts(run_dir)
    rows = by_step(runs[-1]) if runs else {}
    if sorted(rows) != [1, 2, 3]:
        raise StepFailed(f"2-rank EP2 run logged global steps {sorted(rows)}, expected 1..3 (log: {log})")
    text = log.read_text(errors="replace")
    if "rank 1/2" not in text or "ep 1/2" not in text:
        raise StepFailed(f"2-rank EP2 run: no 'rank 1/2 ... ep 1/2' layout line in {log}")
    losses = [rows[s]["train/loss"] for s in sorted(rows)]
    if any(v is None for v in losses):
        raise StepFailed(f"2-rank EP2 run: non-finite loss {losses}")
    metrics = {"layout": layout.describe(), "losses": losses, "seconds": round(time.monotonic() - started, 1),
               "tokens_per_s": {str(s): rows[s]["perf/tokens_per_s"] for s in sorted(rows)}, "logs": str(work)}
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    if layout.device == "cpu":
        metrics["backend"] = "gloo"
        return Outcome("pass", f"gloo stand-in (CPU, NCCL not exercised): 2-rank EP2 x ZeRO-2 ran warm-up 1 + sparse 2 "
                               f"steps, losses {', '.join(f'{v:.4f}' for v in losses)}", metrics)
    version = next((line.split("NCCL version", 1)[1].split()[0] for line in text.splitlines()
                    if "NCCL version" in line), None)
    metrics.update(backend="nccl", nccl_version=version)
    if "NCCL INFO" not in text:
        return Outcome("fail", f"2-rank EP2 run finished but NCCL never initialized (no 'NCCL INFO' line with "
                               f"NCCL_DEBUG=INFO in {log}): its collectives ran elsewhere", metrics)
    sparse = rows[3]["perf/tokens_per_s"]
    return Outcome("pass", f"NCCL {version or '(version not logged)'}: 2-rank EP2 x ZeRO-2 ran warm-up 1 + sparse 2 "
                           f"steps at T={layout.seq_len}, losses {', '.join(f'{v:.4f}' for v in losses)}, last sparse "
                           f"step {sparse:.0f} tok/s", metrics)


# ------------------------------------------------------------------------------------------ helpers
def _fresh_work_dir(opts: Options, name: str) -> Path:
    """`<out>/<name>`, emptied, once the trainer's packages are there and time is left."""
    require_packages()
    _timeout(opts)
    work = Path(opts.out) / name
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    return work


def missing_packages() -> list[str]:
    """The distributions of REQUIRED that are not installed (nothing is imported)."""
    missing = []
    for module, dist in REQUIRED.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:  # a missing parent package (megatron for megatron.core)
            found = False
        if not found:
            missing.append(dist)
    return missing


def require_packages() -> None:
    missing = missing_packages()
    if missing:
        raise StepFailed(f"missing Python package(s) {', '.join(missing)}, which the training runs import: install "
                         "dsa-train's core from a wheelhouse, python -m pip install --no-index "
                         "--find-links wheelhouse -c wheelhouse/image-constraints.txt 'dsa-train' "
                         "(docs/install.md; a GPU session: scripts/gpu_session.py)")


def peak_flops_overrides(layout: Layout) -> list[str]:
    """The trainer refuses a GPU whose peak it does not know (MFU needs it); such a GPU runs with
    H100's peak, and `plan_estimate` marks the MFU figures as not meaningful."""
    if layout.device != "cuda" or _known_peak() is not None:
        return []
    from dsa_train.logging.perf import GPU_PEAK_FLOPS

    return [f"logging.peak_flops={GPU_PEAK_FLOPS['H100']}"]


def _known_peak() -> float | None:
    import torch

    from dsa_train.logging.perf import peak_flops_per_device

    try:
        return peak_flops_per_device(torch.device("cuda", 0), None)
    except ValueError:
        return None


def plan_estimate(layout: Layout, run_dir: Path) -> dict:
    """`dsa-train plan` of the runs' recipe and layout (1 rank), in this process, with this
    machine's device peak and memory in place of the plan's H100 defaults."""
    import torch

    from dsa_train.config import ConfigError, load_recipe
    from dsa_train.logging.perf import CPU_PEAK_FLOPS_PER_THREAD
    from dsa_train.plan.estimate import make_plan, parse_opts

    overrides = layout.overrides(run_dir, WARMUP_STEPS, SPARSE_STEPS, CHECKPOINT_EVERY)
    args, peak_known = [], True
    if layout.device == "cuda":
        peak = _known_peak()
        peak_known = peak is not None
        if peak_known:
            args += ["--peak-tflops", str(peak / 1e12)]
        args += ["--gpu-gb", str(torch.cuda.get_device_properties(0).total_memory / 2**30)]
    else:  # the trainer's CPU peak at the runs' one thread
        args += ["--peak-tflops", str(CPU_PEAK_FLOPS_PER_THREAD / 1e12)]
    plan_opts, _ = parse_opts(args)
    try:
        cfg = load_recipe(RECIPE, overrides)
        plan = make_plan(cfg, plan_opts, world=layout.world)
    except ConfigError as err:
        raise StepFailed(f"the check's recipe {RECIPE} {' '.join(overrides[1:])} is invalid here: {err}")
    plan.update(assumed_mfu=plan_opts.mfu, peak_tflops=plan_opts.peak_tflops, peak_flops_known=peak_known)
    return plan


def trainer_command(layout: Layout, run_dir: Path, extra: list[str]) -> list[str]:
    """One rank of the distributed trainer, as torchrun would start it (its environment comes
    from `run_logged`)."""
    return [sys.executable, "-m", "dsa_train.launch.rank", "--config-name", RECIPE,
            *layout.overrides(run_dir, WARMUP_STEPS, SPARSE_STEPS, CHECKPOINT_EVERY), *extra]


def free_ports(n: int) -> list[int]:
    """`n` distinct free TCP ports (all bound at once while chosen, so runs side by side never
    share a rendezvous port)."""
    import socket

    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def run_env(device: str, single_rank: bool, fault: str | None, extra: dict | None = None,
            port: int | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in STRIPPED_ENV}
    env["WANDB_MODE"] = "disabled"
    env["DS_ACCELERATOR"] = device
    if device == "cuda":
        env["DSA_KERNELS"] = "triton"  # a missing Triton path fails instead of falling back
        env.pop("TRITON_INTERPRET", None)  # compiled kernels: the interpreter is the CPU's
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # deterministic=true's, before CUDA starts
    else:  # the interpreter (set by `gpu-check --device cpu`) costs ~9 s per sparse step here
        env["DSA_KERNELS"] = "ref"
        env["DSA_TRAIN_BACKEND"] = "gloo"
        env.setdefault("OMP_NUM_THREADS", "1")
    if single_rank:  # what torchrun gives its one worker
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port or free_ports(1)[0]))
    if fault:
        env["DSA_FAULT"] = fault
    env.update(extra or {})
    return env


def _timeout(opts: Options) -> float:
    budget = 240.0 if opts.small else 480.0
    left = opts.time_left()
    if left <= 5:
        raise StepFailed("no time left before the gpu-check deadline")
    return min(budget, left)


def _start(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    with open(log, "w") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        return subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def _wait(proc: subprocess.Popen, deadline: float, log: Path) -> int:
    try:
        return proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: torchrun's workers too
        proc.wait()
        raise StepFailed(f"{log.stem} run did not finish in time; stopped (log: {log})")


def run_logged(opts: Options, cmd: list[str], log: Path, fault: str | None = None, env: dict | None = None,
               single_rank: bool = True) -> int:
    """Run `cmd` (stdout and stderr into `log`) within the check's time; its exit code."""
    deadline = time.monotonic() + _timeout(opts)
    proc = _start(cmd, log, run_env(opts.device, single_rank, fault, env))
    return _wait(proc, deadline, log)


def run_together(opts: Options, runs: list[tuple[list[str], Path, str | None]]) -> list[int]:
    deadline = time.monotonic() + _timeout(opts)
    ports = free_ports(len(runs))
    procs = [_start(cmd, log, run_env(opts.device, True, fault, port=port))
             for (cmd, log, fault), port in zip(runs, ports)]
    try:
        return [_wait(p, deadline, log) for p, (_, log, _) in zip(procs, runs)]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def last_error(log: Path) -> str:
    """The line of a run's log that says why it failed: the last error-looking line, else the last one."""
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no log"
    for line in reversed(lines):
        if "Error" in line or "error:" in line or line.startswith("dsa-train"):
            return line[:300]
    return lines[-1][:300] if lines else "empty log"


def attempts(run_dir: Path) -> list[dict]:
    """The starts of a run in its metrics.jsonl, in order: {"stages": [names], "rows": [metrics]}."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise StepFailed(f"no {path}: the run logged no step")
    out: list[dict] = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "run" in record:
            out.append({"stages": list(record["run"].get("stages") or {}), "rows": []})
        elif "metrics" in record and out:
            out[-1]["rows"].append(record["metrics"])
    return out


def by_step(attempt: dict) -> dict[int, dict]:
    rows = {}
    for m in attempt["rows"]:
        if "train/loss" in m:
            rows[int(m["progress/global_step"])] = m
    return rows
