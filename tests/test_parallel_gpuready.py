"""GPU readiness checked on the CPU (2 ranks, gloo, torchrun):
* the device-strict collective check (DSA_STRICT_DEVICES=1) fails a collective whose tensor was
  made without a device (NCCL would reject it on a GPU), and a real 2-rank training run (data x
  expert parallel, ZeRO-2, the demo recipe's stages) passes it and logs MFU per device;
* a bf16 ZeRO-2 run that crashes and resumes continues from the exact fp32 master weights."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dsa_train.parallel.strict_devices import DeviceStrictError, StrictDevices
from tests.helpers import free_port


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


def run_demo(run_dir, extra, fault=None, base=TINY_DEMO, nproc=2):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "DSA_STRICT_DEVICES": "1"}
    for var in ("DSA_FAULT", "WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "WANDB_RUN_ID", "WANDB_RESUME"):
        env.pop(var, None)
    if fault:
        env["DSA_FAULT"] = fault
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
           "-m", "dsa_train.launch.rank", "--config-name", "demo", *base, *extra, f"run_dir={run_dir}"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)


@pytest.mark.integration
@pytest.mark.slow
def test_two_rank_zero2_training_strict_devices_mfu_per_device_and_inf_gradient_caught(tmp_path):
    """Data parallel 2 x expert parallel 2 under ZeRO-2 with the demo's three stages, every
    collective checked. The logged MFU is per device: the job's model FLOP/s over 2 devices' peak.
    An inf put into rank 1's ZeRO-2 gradient partition at step 2 (the loss stays finite; `p.grad`
    is empty under ZeRO-2) is seen by the non-finite check: the step is skipped on both ranks."""
    peak = 1e12
    out = run_demo(tmp_path / "run", ["parallel=zero2", "parallel.expert_parallel=2", "logging.wandb_mode=offline",
                                      f"logging.peak_flops={peak}"], fault="step=2,kind=inf_grad,rank=1")
    assert out.returncode == 0, out.stderr[-4000:]
    assert "DSA_STRICT_DEVICES" not in out.stderr
    log = out.stdout + out.stderr
    assert "non-finite gradients at global step 2: update skipped (1 in a row)" in log, log[-3000:]
    assert "non-finite values on another rank at global step 2" in log, log[-3000:]  # rank 0's view

    import dsa_train
    from dsa_train.config import load_recipe
    from dsa_train.logging import find_run_file, read_history
    from dsa_train.stage import Stage

    ckpt = sorted((tmp_path / "run" / "checkpoints").glob("step_*"))[-1]
    config = dsa_train.DSAConfig.from_pretrained(ckpt)
    recipe = load_recipe("demo", TINY_DEMO)
    rows = [row for row in read_history(find_run_file(tmp_path / "run" / "wandb")) if "perf/mfu" in row]
    assert len(rows) == 3
    assert [row["train/nonfinite_skipped"] for row in rows] == [0, 1, 1]
    for row, (name, stage) in zip(rows, recipe.stages.items()):
        fpt = Stage.of(name, stage).flops_per_token(config, recipe.data.seq_len)
        job_flops_per_s = row["perf/tokens_per_s"] * fpt
        assert row["perf/mfu"] == pytest.approx(job_flops_per_s / (2 * peak), rel=1e-6), name
        assert row["perf/tflops_per_device"] == pytest.approx(job_flops_per_s / 2 / 1e12, rel=1e-6), name


# The demo's sparse stage at the 671B sparse recipe's lr (recipes/v3.2_sparse.yaml: 7.3e-6) in
# bf16 under ZeRO-2 (recipes/parallel/zero2.yaml): most AdamW updates are below bf16 resolution.
BF16_SPARSE = [
    "~stages.pretrain", "~stages.warmup", "model.dtype=bfloat16", "parallel=zero2", "data.seq_len=64",
    "data.micro_batch_size=1", "logging.progress_bar=false", "logging.wandb_mode=disabled", "probe_batches=0",
    "checkpoint.export=false", "checkpoint.every_n_steps=1", "stages.sparse.steps=4", "stages.sparse.global_batch_size=2",
    "stages.sparse.lr=7.3e-6", "stages.sparse.warmup_steps=0", "stages.sparse.topk=16",
]


def _losses(log):
    import re

    return {int(m.group(1)): m.group(2) for m in re.finditer(r"sparse (\d)/4  loss (\S+)", log)}


@pytest.mark.slow
@pytest.mark.integration
def test_bf16_zero2_resume_keeps_exact_fp32_masters(tmp_path):
    ref = run_demo(tmp_path / "ref", [], base=BF16_SPARSE)
    assert ref.returncode == 0, ref.stderr[-3000:]
    crashed = run_demo(tmp_path / "run", [], base=BF16_SPARSE, fault="step=3,kind=crash")
    assert crashed.returncode != 0 and (tmp_path / "run/checkpoints/step_00000002").is_dir()
    resumed = run_demo(tmp_path / "run", [], base=BF16_SPARSE)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout + resumed.stderr
    got, want = _losses(resumed.stdout + resumed.stderr), _losses(ref.stdout + ref.stderr)
    assert set(got) == {3, 4} and all(got[s] == want[s] for s in got), (got, want)
    # step 3 (the first after the resume, mid-stage: optimizer state saved): the fp32 masters,
    # AdamW moments and bf16 weights (global tensors, gathered from both ranks' pieces) equal the
    # uninterrupted run's bit for bit
    from dsa_train.checkpoint.training import read_tensors

    a = read_tensors(tmp_path / "ref/checkpoints/step_00000003", prefix="")
    b = read_tensors(tmp_path / "run/checkpoints/step_00000003", prefix="")
    assert a.keys() == b.keys() and a
    assert any(k.startswith("optim/master/") for k in a) and any(k.startswith("optim/exp_avg_sq/") for k in a)
    assert a["model/model.embed_tokens.weight"].dtype == torch.bfloat16
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, differ[:5]


def _shipped_model_recipes():
    """(name, dtype, hidden, moe_intermediate) of every model recipe under recipes/model/."""
    from omegaconf import OmegaConf

    import dsa_train

    out = []
    root = Path(dsa_train.__file__).resolve().parent.parent / "recipes" / "model"
    for path in sorted(root.glob("*.yaml")):
        spec = OmegaConf.load(path)
        arch = dict(spec.get("arch") or {})
        if spec.get("pretrained") not in (None, "???") or not arch and path.stem.startswith("v3"):
            cfg = dsa_train.DSAConfig()  # the 671B defaults (V3.1-Terminus shapes)
        else:
            cfg = dsa_train.tiny_config(**arch)
        out.append((path.stem, getattr(torch, spec.dtype), cfg.hidden_size, cfg.moe_intermediate_size))
    return out


def test_expert_gemm_path_follows_what_cuda_accepts():
    from dsa_train.model.grouped_experts import expert_gemm_path

    recipes = _shipped_model_recipes()
    assert {name for name, *_ in recipes} >= {"tiny", "small", "v3.1_terminus"}
    for name, dtype, hidden, inter in recipes:
        path = expert_gemm_path(dtype, "cuda", hidden, inter)
        if dtype == torch.float32:
            assert path == "loop", name  # CUDA's grouped GEMM is bf16-only: fp32 falls back
        else:
            aligned = hidden % 8 == 0 and inter % 8 == 0
            assert path == ("grouped" if aligned else "grouped_padded"), name
        assert expert_gemm_path(dtype, "cpu", hidden, inter) == "grouped", name
    assert expert_gemm_path(torch.bfloat16, "cuda", 7168, 2048) == "grouped"
    assert expert_gemm_path(torch.bfloat16, "cuda", 100, 36) == "grouped_padded"  # 200-byte rows: not 16-byte
    assert expert_gemm_path(torch.float32, "cuda", 7168, 2048) == "loop"


@pytest.mark.parametrize("path", ["grouped", "grouped_padded", "loop"])
def test_every_expert_gemm_path_equals_the_expert_modules(path):
    # unaligned sizes (h 20, I 12: 40- and 24-byte bf16 rows) and an idle expert
    from dsa_train.model.moe import MLP
    from dsa_train.model.grouped_experts import grouped_expert_mlp

    torch.manual_seed(0)
    experts = [MLP(20, 12) for _ in range(4)]
    counts = [3, 0, 5, 2]
    x = torch.randn(sum(counts), 20, requires_grad=True)
    offs = torch.tensor(counts, device="cpu").cumsum(0).to(torch.int32)
    stack = lambda n: torch.stack([getattr(e, n).weight for e in experts])  # noqa: E731
    y = grouped_expert_mlp(x, offs, stack("gate_proj"), stack("up_proj"), stack("down_proj"), path=path)
    assert y.shape == (10, 20)
    y.square().sum().backward()
    got = [x.grad.clone()] + [e.gate_proj.weight.grad.clone() for e in experts]
    for e in experts:
        e.zero_grad()
    x2 = x.detach().clone().requires_grad_()
    ref = torch.cat([e(part) for e, part in zip(experts, x2.split(counts))])
    ref.square().sum().backward()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    want = [x2.grad] + [e.gate_proj.weight.grad for e in experts]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_bf16_gradients_accumulate_in_fp32_by_default():
    """Two micro-batches of a bf16 model: with optim.grad_accum_dtype float32 (default) the
    step's gradient is the fp32 sum of the micro-batches' bf16 gradients; with bfloat16 it is
    their bf16 sum (rounded at the addition)."""
    from dsa_train.config import Attention, DType, OptimConfig, StageConfig, Trainable
    from dsa_train.trainer import Engine, forward_backward
    from dsa_train.model import DSAForCausalLM, tiny_config
    from dsa_train.stage import Stage

    assert OptimConfig().grad_accum_dtype == DType.float32
    stage = StageConfig(attention=Attention.dense, trainable=Trainable.all, lm_loss_coef=1.0, indexer_loss_coef=0.0,
                        lr=1e-5, steps=1)
    torch.manual_seed(0)
    model = DSAForCausalLM(tiny_config(num_hidden_layers=1, num_nextn_predict_layers=0)).to(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=g, device="cpu")
    micro = [{"input_ids": ids[i : i + 1], "labels": ids[i : i + 1].roll(-1, 1),
              "position_ids": torch.arange(32, device="cpu")[None]} for i in range(2)]
    name = "model.layers.0.self_attn.o_proj.weight"
    param = dict(model.named_parameters())[name]

    def grad_of(batches, accum):
        engine = Engine(model, Stage.of("test", stage), OptimConfig(grad_accum_dtype=accum))
        forward_backward(engine, batches, Stage.of("test", stage))
        grad = (engine.masters[name].grad if param.grad is None else param.grad).clone()
        engine.zero_grad()
        return grad

    # each micro-batch's own bf16 gradient, weighted as in the two-micro-batch step (n_i / N = 1/2:
    # a power of two, so the halved backward is exact)
    parts = [grad_of([mb], DType.bfloat16) * 0.5 for mb in micro]
    fp32 = grad_of(micro, DType.float32)
    bf16 = grad_of(micro, DType.bfloat16)
    assert fp32.dtype == torch.float32 and bf16.dtype == torch.bfloat16
    assert torch.equal(fp32, parts[0].float() + parts[1].float())
    assert torch.equal(bf16, parts[0] + parts[1])
    assert not torch.equal(fp32, bf16.float())  # the bf16 sum rounds
