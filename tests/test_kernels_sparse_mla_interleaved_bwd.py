"""The interleaved sparse MLA backward (`_sparse_mla_bwd_interleaved_kernel`: 32 heads a program, q /
dO resident as 64 interleaved rows, keys on the products' N), the second config of the backward's
autotuning space on Hopper: its gradients equal the reference's, under the interpreter on the CPU
(compiled on a GPU), at odd shapes: head counts below one block, between blocks and above, more
than one key tile, no rope dims, empty rows, out-of-range slots, bf16 output against an fp32 oracle;
at 16- and 32-key tiles (the 32-key one is timed by benchmarks/kernel_variants.py). Its compile for
sm_90a at the 671B shapes is in the gate (tests/test_kernels_compile.py: every config of the space)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dsa_kernels import sparse_mla_ref  # noqa: E402
from dsa_kernels._triton_common import interp_upcast  # noqa: E402
from dsa_kernels.ops.sparse_mla import kernel as SM  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(B, T, H, d_v, d_r, K, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    D = d_v + d_r
    q = torch.randn(B, T, H, D, generator=g).to(DEV, dtype)
    kv = torch.randn(B, T, D, generator=g).to(DEV, dtype)
    idx = torch.full((B, T, K), -1, dtype=torch.int32)
    for b in range(B):
        for t in range(T):
            n = min(K, t + 1)
            idx[b, t, :n] = torch.randperm(t + 1, generator=g)[:n].to(torch.int32)
    idx[:, :, 1::5] = -1  # empty slots inside the rows
    idx[0, 3] = -1  # an empty row
    idx[-1, -1, 0] = T + 7  # out of range: an empty slot, never an address
    dout = torch.randn(B, T, H, d_v, generator=g).to(DEV, dtype)
    return q, kv, idx.to(DEV), dout


def _grads(q, kv, idx, dout, d_v, scale, block_k=None):
    """(dq, dkv) from the interleaved kernel at `block_k` keys a tile (after the forward kernel) or,
    with block_k None, from the reference."""
    if block_k is None:
        q, kv = q.detach().requires_grad_(), kv.detach().requires_grad_()
        idx = torch.where(idx < kv.shape[1], idx, -1)  # out of range = empty, the kernels' rule
        out, _ = sparse_mla_ref(q, kv, idx, scale, d_v)
        return torch.autograd.grad((out.float() * dout.float()).sum(), (q, kv))
    dq = torch.empty_like(q)  # in q's dtype: the bf16 store path runs under the interpreter too
    # the interpreter's tl.dot is wrong on 16-bit operands: interpreted runs take fp32 copies
    q, kv, dout = interp_upcast(q), interp_upcast(kv), interp_upcast(dout)
    n_slots = SM.slot_counts(idx, kv.shape[1])
    out, lse = SM.sparse_mla_fwd(q, kv, idx, n_slots, scale, d_v)
    delta = SM.bwd_delta(out, dout, lse, None)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    SM.plan_bwd_interleaved(q, kv, idx, n_slots, dout, lse, delta, dq, dkv, scale, d_v, block_k=block_k).run()
    return dq, dkv


@pytest.mark.parametrize("B,T,H,d_v,d_r,K,block_k", [(2, 21, 3, 32, 16, 70, 16), (1, 9, 40, 64, 0, 9, 32),
                                                     (1, 40, 33, 64, 32, 37, 16), (1, 12, 64, 32, 16, 12, 32)])
def test_interleaved_equals_the_reference(B, T, H, d_v, d_r, K, block_k):
    q, kv, idx, dout = _case(B, T, H, d_v, d_r, K, torch.float32)
    scale = (d_v + d_r) ** -0.5
    dq, dkv = _grads(q, kv, idx, dout, d_v, scale, block_k)
    rdq, rdkv = _grads(q, kv, idx, dout, d_v, scale)
    assert (dq[0, 3] == 0).all()  # the empty row gets no gradient
    torch.testing.assert_close(dq, rdq, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dkv, rdkv, rtol=1e-4, atol=1e-5)


def test_interleaved_bf16_against_an_fp32_oracle():
    B, T, H, d_v, d_r, K = 1, 17, 5, 32, 16, 12
    q, kv, idx, dout = _case(B, T, H, d_v, d_r, K, torch.bfloat16, seed=1)
    scale = (d_v + d_r) ** -0.5
    dq, dkv = _grads(q, kv, idx, dout, d_v, scale, 16)
    rdq, rdkv = _grads(q.float(), kv.float(), idx, dout.float(), d_v, scale)
    assert dq.dtype == torch.bfloat16
    for got, ref in ((dq.float(), rdq), (dkv, rdkv)):
        err = (got - ref).abs().max() / ref.abs().max()
        assert err < 2e-2, err


def test_backward_autotuning_times_into_dkv_then_runs_zeroed(monkeypatch, tmp_path):
    """sparse_mla_bwd's autotuning, driven as on a GPU (timing forced; the interpreter runs the
    launches): the interleaved config is verified against the default, both are timed into the
    real dq / dkv (whose atomics then hold several runs' sums), the faster (here: the interleaved,
    by a fake clock) is chosen, and the gradients returned are still exactly one run's."""
    from dsa_kernels import autotune

    monkeypatch.setenv("DSA_AUTOTUNE_CACHE", str(tmp_path / "autotune.json"))
    monkeypatch.setattr(autotune, "_MEMORY", {})
    timed, verified = [], []
    real_pick = autotune.pick

    def pick_as_on_a_gpu(kernel, key, names, build, on_gpu, device_id="", bench=None, verify=None):
        if kernel != "sparse_mla_bwd":  # the forward as usual (the default, off the GPU)
            return real_pick(kernel, key, names, build, on_gpu, device_id, bench, verify)

        def fake_bench(launch):  # runs the launch (into dq / dkv), reports the interleaved one faster
            launch.run()
            timed.append(launch.kernel.__name__)
            return 1.0 if "interleaved" in launch.kernel.__name__ else 2.0

        def verify_logged(name):
            verified.append(name)
            return verify(name)

        return real_pick(kernel, key, names, build, True, "test GPU", fake_bench, verify_logged)

    monkeypatch.setattr(SM.autotune, "pick", pick_as_on_a_gpu)
    q, kv, idx, dout = _case(1, 13, 4, 32, 16, 9, torch.float32, seed=2)
    scale = 48**-0.5
    q, kv = q.requires_grad_(), kv.requires_grad_()
    from dsa_kernels.ops.sparse_mla.function import sparse_mla_triton

    out, _ = sparse_mla_triton(q, kv, idx, scale, 32)
    dq, dkv = torch.autograd.grad((out * dout).sum(), (q, kv))
    assert verified == ["interleaved-h32-k32-s2"]
    assert sorted(timed) == ["_sparse_mla_bwd_interleaved_kernel", "_sparse_mla_bwd_kernel"]
    rdq, rdkv = _grads(q.detach(), kv.detach(), idx, dout, 32, scale)
    torch.testing.assert_close(dq, rdq, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dkv, rdkv, rtol=1e-4, atol=1e-5)


def test_backward_autotuning_leaves_out_a_config_whose_dq_disagrees(monkeypatch, tmp_path):
    """The verify step compares dq (on probed tokens) as well as dkv: a config whose dkv is right
    but whose dq is not (here: the interleaved launch followed by a corruption of dq) is left out
    with a warning, never timed, and the gradients are the default's."""
    from dsa_kernels import autotune
    from dsa_kernels.ops.sparse_mla.function import sparse_mla_triton

    monkeypatch.setenv("DSA_AUTOTUNE_CACHE", str(tmp_path / "autotune.json"))
    monkeypatch.setattr(autotune, "_MEMORY", {})
    real_plan, real_pick, timed = SM.plan_bwd_config, autotune.pick, []

    class WrongDq:
        def __init__(self, launch):
            self.launch, self.kernel = launch, launch.kernel

        def run(self):
            self.launch.run()
            self.launch.args["DQ"].add_(1.0)

    def plan(config, *args, **kw):
        launch = real_plan(config, *args, **kw)
        return WrongDq(launch) if config[1] == "interleaved" else launch

    def pick_as_on_a_gpu(kernel, key, names, build, on_gpu, device_id="", bench=None, verify=None):
        def fake_bench(launch):
            launch.run()
            timed.append(launch.kernel.__name__)
            return 1.0
        if kernel != "sparse_mla_bwd":
            return real_pick(kernel, key, names, build, on_gpu, device_id, bench, verify)
        return real_pick(kernel, key, names, build, True, "test GPU", fake_bench, verify)

    monkeypatch.setattr(SM, "plan_bwd_config", plan)
    monkeypatch.setattr(SM.autotune, "pick", pick_as_on_a_gpu)
    q, kv, idx, dout = _case(1, 11, 4, 32, 16, 8, torch.float32, seed=3)
    scale = 48**-0.5
    q, kv = q.requires_grad_(), kv.requires_grad_()
    out, _ = sparse_mla_triton(q, kv, idx, scale, 32)
    with pytest.warns(RuntimeWarning, match="interleaved-h32-k32-s2 disagrees with the default"):
        dq, dkv = torch.autograd.grad((out * dout).sum(), (q, kv))
    assert timed == ["_sparse_mla_bwd_kernel"]  # only the default was timed
    rdq, rdkv = _grads(q.detach(), kv.detach(), idx, dout, 32, scale)
    torch.testing.assert_close(dq, rdq, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dkv, rdkv, rtol=1e-4, atol=1e-5)
