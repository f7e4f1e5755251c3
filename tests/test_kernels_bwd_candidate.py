"""The candidate sparse MLA backward (benchmarks/candidates/sparse_mla_bwd_transposed.py: keys on
the rows, q / dO rows interleaved, 32- or 16-head blocks, 64-key tiles), measured by
benchmarks/kernel_variants.py beside the shipped one. The gradients it would be timed on equal
the reference's, under the interpreter on the CPU (compiled on a GPU), at odd shapes: head counts
that do not fill a block, more than one key tile, no rope dims, empty rows, out-of-range slots,
bf16 output against an fp32 oracle. At the 671B shapes for sm_90a it compiles to wgmma only (no
mma.sync), what it is a candidate for."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dsa_kernels import sparse_mla_ref  # noqa: E402
from dsa_kernels._triton_common import interp_upcast  # noqa: E402
from dsa_kernels.ops.sparse_mla import kernel as SM  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "candidates" / "sparse_mla_bwd_transposed.py"


def _candidate():
    spec = importlib.util.spec_from_file_location("sparse_mla_bwd_transposed", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def _grads(q, kv, idx, dout, d_v, scale, candidate):
    """(dq, dkv) from the candidate kernel (after the shipped forward) or from the reference."""
    if candidate is None:
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
    candidate.plan_bwd(q, kv, idx, n_slots, dout, lse, delta, dq, dkv, scale, d_v).run()
    return dq, dkv


@pytest.mark.parametrize("B,T,H,d_v,d_r,K", [(2, 21, 3, 32, 16, 70), (1, 9, 40, 64, 0, 9)])
def test_candidate_equals_the_reference(B, T, H, d_v, d_r, K):
    q, kv, idx, dout = _case(B, T, H, d_v, d_r, K, torch.float32)
    scale = (d_v + d_r) ** -0.5
    dq, dkv = _grads(q, kv, idx, dout, d_v, scale, _candidate())
    rdq, rdkv = _grads(q, kv, idx, dout, d_v, scale, None)
    assert (dq[0, 3] == 0).all()  # the empty row gets no gradient
    torch.testing.assert_close(dq, rdq, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dkv, rdkv, rtol=1e-4, atol=1e-5)


def test_candidate_bf16_against_an_fp32_oracle():
    B, T, H, d_v, d_r, K = 1, 17, 5, 32, 16, 12
    q, kv, idx, dout = _case(B, T, H, d_v, d_r, K, torch.bfloat16, seed=1)
    scale = (d_v + d_r) ** -0.5
    dq, dkv = _grads(q, kv, idx, dout, d_v, scale, _candidate())
    rdq, rdkv = _grads(q.float(), kv.float(), idx, dout.float(), d_v, scale, None)
    assert dq.dtype == torch.bfloat16
    for got, ref in ((dq.float(), rdq), (dkv, rdkv)):
        err = (got - ref).abs().max() / ref.abs().max()
        assert err < 2e-2, err


COMPILE = """
import importlib.util, json, sys, torch
from dsa_kernels import compile_report
from dsa_kernels.registry import KernelCase
from dsa_kernels.ops.sparse_mla.specs import _tensors
spec = importlib.util.spec_from_file_location("candidate", sys.argv[1])
cand = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cand)
q, kv, idx, lse, scale, d_v = _tensors()
meta = dict(device="meta")
for config in sys.argv[2:]:
    block_h, stages = map(int, config.split(","))
    launch = cand.plan_bwd(q, kv, idx, torch.empty(idx.shape[:2], dtype=torch.int32, **meta),
                           torch.empty(*q.shape[:3], d_v, dtype=q.dtype, **meta), lse, torch.empty_like(lse),
                           torch.empty_like(q), torch.empty(kv.shape, dtype=torch.float32, **meta), scale, d_v,
                           block_h=block_h, num_stages=stages)
    row = compile_report.compile_case(KernelCase("candidate", launch, op="sparse_mla_bwd"), 90)
    row["gate"] = compile_report.gate_failures(row, 90, True)
    print(json.dumps({k: row[k] for k in ("error", "wgmma", "mma_sync", "registers", "spill_bytes", "gate")}))
"""


def test_candidate_compiles_for_hopper_to_wgmma_only():
    """Compiled (not interpreted: a subprocess without TRITON_INTERPRET) for sm_90a at the 671B
    shapes: every product a wgmma, none on mma.sync, at 32 heads (1 stage) and 16 heads (2 stages);
    the 16-head config passes the compile gate's rules (no spill, fits in shared memory). (The
    32-head one spills: docs/kernels.md "Backward v2".)"""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", COMPILE, str(PATH), "32,1", "16,2"], capture_output=True,
                         text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    h32, h16 = (json.loads(line) for line in run.stdout.strip().splitlines()[-2:])
    for row in (h32, h16):
        assert row["error"] is None, row["error"]
        assert row["wgmma"] > 0 and row["mma_sync"] == 0, row
    assert h16["gate"] == [], h16
