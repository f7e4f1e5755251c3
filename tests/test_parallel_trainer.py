"""The distributed trainer end to end on the tiny demo recipe (2 ranks, CPU, gloo): a run under
ZeRO-2 + expert parallel 2 that crashes mid-stage resumes from its per-rank checkpoints (model
shards, ZeRO optimizer partitions) to the same losses as an uninterrupted run; a ZeRO-3 + tensor
parallel 2 run goes through all three stages and exports a full model that loads."""

import os
import re
import subprocess
import sys

import pytest
import torch

from dsa_train.parallel.selftest import free_port

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

    # the expert-parallel checkpoint (each rank: its experts + replicated dense tensors) exports
    # to one complete model
    export = _export(tmp_path / "run", tmp_path / "offline")
    import dsa_train

    model = dsa_train.from_pretrained(export)
    n_experts = model.config.n_routed_experts
    keys = set(model.state_dict())
    assert all(f"model.layers.{i}.mlp.experts.{e}.down_proj.weight" in keys for e in range(n_experts)
               for i in range(model.config.first_k_dense_replace, model.config.num_hidden_layers))


def _export(run_dir, out):
    cmd = [sys.executable, "-m", "dsa_train.cli", "export", str(run_dir), str(out), "--dtype", "float32"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.slow
def test_zero3_tensor_parallel_trains_and_exports(tmp_path):
    out = _run(tmp_path / "run", ["parallel=zero2", "parallel.zero_stage=3", "parallel.tensor_parallel=2",
                                  "probe_batches=1", "checkpoint.every_n_steps=7"])  # the last of 7 steps
    assert out.returncode == 0, out.stderr[-3000:]
    import dsa_train

    model = dsa_train.from_pretrained(tmp_path / "run" / "export")
    cfg = model.config
    attn = model.model.layers[0].self_attn
    assert attn.q_b_proj.weight.shape[0] == cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    assert float(attn.o_proj.weight.detach().abs().sum()) > 0

    # `dsa-train export` of the run's last checkpoint (tensor-parallel slices in two rank files)
    # equals the export the run gathered itself
    from safetensors.torch import load_file

    offline = _export(tmp_path / "run", tmp_path / "offline")

    def tensors(d):
        out = {}
        for f in sorted(d.glob("*.safetensors")):
            out.update(load_file(f))
        return out

    ours, gathered = tensors(offline), tensors(tmp_path / "run" / "export")
    assert set(ours) == set(gathered)
    for name in gathered:
        assert ours[name].shape == gathered[name].shape, name
        assert torch.equal(ours[name].float(), gathered[name].float()), name
