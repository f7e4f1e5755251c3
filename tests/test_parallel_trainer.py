"""The distributed trainer end to end on the tiny demo recipe (2 ranks, CPU, gloo): a run under
ZeRO-2 + expert parallel 2 that crashes mid-stage resumes from its per-rank checkpoints (model
shards, ZeRO optimizer partitions) to the same losses as an uninterrupted run; a ZeRO-3 + tensor
parallel 2 run goes through all three stages and exports a full model that loads."""

import os
import re
import subprocess
import sys

import pytest

from dsa_train.parallel.selftest import free_port

pytest.importorskip("deepspeed")

TINY = [
    "data.seq_len=64", "data.micro_batch_size=1", "logging.wandb_mode=disabled", "logging.progress_bar=false",
    "stages.pretrain.warmup_steps=1", "stages.sparse.warmup_steps=1", "stages.sparse.topk=16",
    *[f"stages.{s}.{k}={v}" for s in ("pretrain", "warmup") for k, v in (("steps", 2), ("global_batch_size", 2))],
    "stages.sparse.steps=3", "stages.sparse.global_batch_size=2",
]


def _run(run_dir, extra, fault=None):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    env.pop("DSA_FAULT", None)
    if fault:
        env["DSA_FAULT"] = fault
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "-m", "dsa_train.parallel.train", "--config-name", "demo", *TINY, *extra, f"run_dir={run_dir}"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def _sparse_losses(log):
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"sparse (\d)/3  loss (\S+)", log)}


@pytest.mark.slow
def test_resume_after_crash_matches_uninterrupted_run(tmp_path):
    extra = ["parallel=zero2", "parallel.expert_parallel=2", "probe_batches=0", "checkpoint.every_n_steps=1",
             "checkpoint.export=false"]
    ref = _run(tmp_path / "ref", extra)
    assert ref.returncode == 0, ref.stderr[-3000:]
    crashed = _run(tmp_path / "run", extra, fault="step=6,kind=crash")  # global step 6 = sparse step 2
    assert crashed.returncode != 0
    resumed = _run(tmp_path / "run", extra)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout + resumed.stderr
    ref_losses, got = _sparse_losses(ref.stdout + ref.stderr), _sparse_losses(resumed.stdout + resumed.stderr)
    assert set(got) == {2, 3} and all(got[s] == ref_losses[s] for s in got), (got, ref_losses)


@pytest.mark.slow
def test_zero3_tensor_parallel_trains_and_exports(tmp_path):
    out = _run(tmp_path / "run", ["parallel=zero2", "parallel.zero_stage=3", "parallel.tensor_parallel=2",
                                  "probe_batches=1", "checkpoint.every_n_steps=0"])
    assert out.returncode == 0, out.stderr[-3000:]
    import dsa_train

    model = dsa_train.from_pretrained(tmp_path / "run" / "export")
    cfg = model.config
    attn = model.model.layers[0].self_attn
    assert attn.q_b_proj.weight.shape[0] == cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    assert float(attn.o_proj.weight.detach().abs().sum()) > 0
