"""GPU readiness checked on the CPU: the device-strict collective check (DSA_STRICT_DEVICES=1)
fails a collective whose tensor was made without a device (NCCL would reject it on a GPU), and a
real 2-rank training run (data x expert parallel, ZeRO-2, the demo recipe's stages) passes it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dsa_train.parallel.selftest import free_port
from dsa_train.parallel.strict_devices import DeviceStrictError, StrictDevices


@pytest.fixture
def one_rank_group(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_collective_on_tensor_made_without_device_names_both_lines(one_rank_group):
    this_file = Path(__file__).name
    original = dist.all_reduce
    with StrictDevices(torch.device("cpu")):
        made = torch.tensor([1.0, 2.0])
        with pytest.raises(DeviceStrictError, match=rf"all_reduce at tests/{this_file}:\d+ .*made without a device "
                                                   rf"at tests/{this_file}:\d+"):
            dist.all_reduce(made)
        # the mark follows the tensor through operations as a CPU placement would on a GPU run
        with pytest.raises(DeviceStrictError):
            dist.all_reduce(made * 2 + 1)
        with pytest.raises(DeviceStrictError):
            dist.all_gather([torch.empty(2, device="cpu")], made.float())
        # explicit placements pass: the compute device, a move there, CPU bookkeeping on purpose
        dist.all_reduce(torch.tensor([1.0], device="cpu"))
        dist.all_reduce(made.to("cpu"))
        model_side = torch.ones(3, device="cpu")
        dist.all_reduce(model_side * torch.tensor(2.0))  # a 0-dim host scalar joins the device tensor
        dist.all_reduce(torch.zeros_like(model_side))
        # a tensor on another device than the compute device
        with pytest.raises(DeviceStrictError, match="not on the compute device cpu"):
            dist.all_reduce(torch.zeros(2, device="meta"))
    # switched off: the collectives are torch's own again
    dist.all_reduce(torch.tensor([1.0]))
    assert dist.all_reduce is original


TINY_DEMO = [
    "data.seq_len=64", "data.micro_batch_size=1", "logging.progress_bar=false", "probe_batches=1",
    "checkpoint.export=false", "stages.warmup.warmup_steps=1", "stages.sparse.warmup_steps=1", "stages.sparse.topk=16",
    "stages.sparse.topk_recall_queries=4",
    *[f"stages.{s}.{k}={v}" for s in ("pretrain", "warmup", "sparse") for k, v in (("steps", 1), ("global_batch_size", 4))],
]


def run_demo(run_dir, extra, strict=True, nproc=2):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "DSA_STRICT_DEVICES": "1" if strict else "0"}
    for var in ("DSA_FAULT", "WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "WANDB_RUN_ID", "WANDB_RESUME"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
           "-m", "dsa_train.parallel.train", "--config-name", "demo", *TINY_DEMO, *extra, f"run_dir={run_dir}"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)


def test_two_rank_training_passes_the_strict_check_and_reports_mfu_per_device(tmp_path):
    """Data parallel 2 x expert parallel 2 under ZeRO-2 with the demo's three stages, every
    collective checked. The logged MFU is per device: the job's model FLOP/s over 2 devices' peak."""
    peak = 1e12
    out = run_demo(tmp_path / "run", ["parallel=zero2", "parallel.expert_parallel=2", "logging.wandb_mode=offline",
                                      f"logging.peak_flops={peak}"])
    assert out.returncode == 0, out.stderr[-4000:]
    assert "DSA_STRICT_DEVICES" not in out.stderr

    import dsa_train
    from dsa_train.config import load_recipe
    from dsa_train.logging import find_run_file, read_history
    from dsa_train.model.flops import flops_per_token

    ckpt = sorted((tmp_path / "run" / "checkpoints").glob("step_*"))[-1]
    config = dsa_train.DSAConfig.from_pretrained(ckpt)
    recipe = load_recipe("demo", TINY_DEMO)
    rows = [row for row in read_history(find_run_file(tmp_path / "run" / "wandb")) if "perf/mfu" in row]
    assert len(rows) == 3
    for row, (name, stage) in zip(rows, recipe.stages.items()):
        fpt = flops_per_token(config, recipe.data.seq_len, stage.attention.value, stage.topk or config.index_topk,
                              stage_trainable=stage.trainable.value)
        job_flops_per_s = row["perf/tokens_per_s"] * fpt
        assert row["perf/mfu"] == pytest.approx(job_flops_per_s / (2 * peak), rel=1e-6), name
        assert row["perf/tflops_per_device"] == pytest.approx(job_flops_per_s / 2 / 1e12, rel=1e-6), name
