"""What a training step asks of the host does not grow with the model: the step's host reads (each
one a device synchronization on a GPU) and the operators of its update (the non-finite check, the
gradient norm, clipping) are the same for a 2-layer model in 2 micro-batches and a 4-layer one in 4
(no read per micro-batch either: the forward's position check is the trainer's at start-up), and
the routed experts' GEMMs the same for 8 and 16 experts (grouped GEMMs, not a loop). Counted with
`dsa_train.trainer.op_counts` (a TorchDispatchMode and a TorchFunctionMode) around
`Trainer.train_step` of real trainer runs: the single-process engine and DeepSpeed ZeRO-2 on a
1-rank torch.distributed job (the layout of gpu-check's end-to-end.throughput). Measured before
and after: docs/training.md, "Host overhead of a step"."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import dsa_kernels
from dsa_train.trainer.op_counts import count_training_steps

pytestmark = pytest.mark.integration

KERNELS_DIR = str(Path(dsa_kernels.__file__).resolve().parent)
# warm-up 1 step, sparse 2 steps (the second logged: top-k recall measured), micro-batches of 1
# sequence (as many per step as the run's global batch: `_run`)
COMMON = [
    "device=cpu", "~stages.pretrain", "model=tiny", "data.seq_len=32", "data.micro_batch_size=1",
    "probe_batches=0", "eval=none", "logging.wandb_mode=disabled", "logging.progress_bar=false", "logging.log_every=2",
    "stages.warmup.steps=1", "stages.sparse.steps=2", "stages.sparse.topk=8", "stages.sparse.topk_recall_queries=4",
    "checkpoint.every_n_steps=0", "checkpoint.export=false",
]
# ZeRO-2 in bf16, as gpu-check's end-to-end.throughput runs it (DeepSpeed's bf16 path has its own
# overflow check: one amax/amin per parameter unless the trainer turns it off)
LAYOUTS = {"single": ([*COMMON, "model.dtype=float32"], False),
           "zero2": ([*COMMON, "model.dtype=bfloat16", "parallel=zero2"], True)}
# host reads a GPU step makes whatever the model and however many micro-batches: the step's token
# counts, the non-finite check, the gradient norm, the metrics; DeepSpeed adds its own invalid-norm
# checks (one per parameter group). None per micro-batch: the forward's position check
# (`int(position_ids.max())`) is not made for the trainer's rows (`positions_checked=True`)
MAX_READS = 10


def _run(tmp_path: Path, layout: str, arch: str, micro_batches: int = 2, **arch_values) -> dict[tuple[str, bool], dict]:
    overrides, distributed = LAYOUTS[layout]
    extra = [f"++model.arch.{k}={v}" for k, v in arch_values.items()]
    run_dir = f"run_dir={tmp_path / f'{layout}-{arch}'}"
    rows = count_training_steps("small_32k", [*overrides, *_global_batch(micro_batches), *extra, run_dir],
                                distributed=distributed)
    return {(r["stage"], r["logged"]): r for r in rows}


def _global_batch(micro_batches: int) -> list[str]:
    return [f"stages.{s}.global_batch_size={micro_batches}" for s in ("warmup", "sparse")]


def _gpu_reads(row: dict) -> int:
    """Host reads outside the reference kernels (CPU-only code: a GPU runs the Triton kernels) and
    outside the optimizer's own step (AdamW reads its host-resident step counters: no device wait)."""
    files = row["read_files"]
    return sum(n for f, n in files.items() if not f.startswith(KERNELS_DIR))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_step_host_reads_and_update_ops_do_not_grow_with_the_model_or_the_micro_batches(tmp_path, layout, monkeypatch):
    monkeypatch.setenv("DSA_KERNELS", "ref")
    # the suite's device-strict collectives (a TorchFunctionMode of their own) would count their
    # bookkeeping as the step's: off here
    monkeypatch.setenv("DSA_STRICT_DEVICES", "0")
    monkeypatch.setenv("DSA_COUNT_PORT", str(29600 + os.getpid() % 300))
    # 2 layers in 2 micro-batches against 4 layers in 4: a read per layer or per micro-batch shows
    two = _run(tmp_path, layout, "L2", num_hidden_layers=2)
    four = _run(tmp_path, layout, "L4-mb4", micro_batches=4, num_hidden_layers=4)
    assert set(two) == set(four) == {("warmup", False), ("sparse", False), ("sparse", True)}
    for key in two:
        a, b = two[key], four[key]
        assert b["kernels"] > a["kernels"], key  # the model's own work does grow
        # the optimizer's step is left out: AdamW's CPU implementation loops over parameters
        reads_a = _gpu_reads(a) - sum(a["phase_reads"].get("optimizer", {}).values())
        reads_b = _gpu_reads(b) - sum(b["phase_reads"].get("optimizer", {}).values())
        assert reads_a == reads_b <= MAX_READS, (key, a["read_files"], b["read_files"])
        assert a["update_kernels"] == b["update_kernels"], (key, a["update_ops"], b["update_ops"])
        # non-finite checks and norms: a few on scalars and flat buffers (before the fused checks: one per parameter)
        for op in ("aten.isfinite", "aten.linalg_vector_norm", "aten.abs", "aten._to_copy"):
            assert a["update_ops"].get(op, 0) == b["update_ops"].get(op, 0) <= 8, (key, op, a["update_ops"])
    # the routed experts: grouped GEMMs, as many for 16 experts as for 8
    sixteen = _run(tmp_path, layout, "E16", num_hidden_layers=2, n_routed_experts=16)
    for key in two:
        assert two[key]["ops"].get("aten._grouped_mm", 0) > 0, key
        assert two[key]["ops"].get("aten.mm", 0) == sixteen[key]["ops"].get("aten.mm", 0), key



def test_zero2_step_after_a_skipped_one_starts_from_zero(tmp_path, monkeypatch):
    """The fused check reads DeepSpeed's accumulated partition: after a skipped step (an inf put
    into it at global step 2, the first sparse step) the engine drops what DeepSpeed accumulated,
    so steps 3 and 4 are finite and taken (before: the stale inf made every later step skip)."""
    import json
    import math

    monkeypatch.setenv("DSA_KERNELS", "ref")
    monkeypatch.setenv("DSA_STRICT_DEVICES", "0")
    monkeypatch.setenv("DSA_FAULT", "step=2,kind=inf_grad")
    monkeypatch.setenv("DSA_COUNT_PORT", str(29300 + os.getpid() % 300))
    overrides, distributed = LAYOUTS["zero2"]
    run_dir = tmp_path / "skip"
    count_training_steps("small_32k", [*overrides, *_global_batch(2), "stages.sparse.steps=3", "logging.log_every=1",
                                       f"run_dir={run_dir}"], distributed=distributed)
    rows = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "train/loss" in row.get("metrics", {}):
            rows[row["step"]] = row["metrics"]
    assert [rows[s]["train/nonfinite_skipped"] for s in (1, 2, 3, 4)] == [0, 1, 1, 1]
    assert all(math.isfinite(rows[s]["optim/grad_norm"]) for s in (1, 3, 4))
