"""The Gluon sparse MLA backward (`ops/sparse_mla/gluon_bwd.py`, issue 31): what can be checked without
a GPU. Gluon kernels do not run under TRITON_INTERPRET, so the kernel itself is proven on a GPU (the
autotuner verifies it against the default before timing it; `dsa-train gpu-check`'s
correctness.sparse_mla runs every Gluon backward config explicitly; benchmarks/gluon_sparse_mla.py
times it beside the interleaved backward) and compiled by the gate (tests/test_kernels_compile.py,
sm_90a under Triton 3.6 and 3.9). Here: its arithmetic as a PyTorch model of the schedule (32-key
tiles, P from the saved lse, dS and P rounded to bf16 where the kernel rounds them, dq accumulated
across the row, dkv added per tile) against the reference's gradients, where it is admitted in the
backward's autotuning space, its launch plan, the forced-config option and the verification wiring."""

from __future__ import annotations

import math

import pytest
import torch

from dsa_kernels import autotune, sparse_mla_ref
from dsa_kernels._triton_common import planning_for
from dsa_kernels.compile_report import kernel_language
from dsa_kernels.ops.sparse_mla import gluon_bwd as G
from dsa_kernels.ops.sparse_mla import kernel as SM
from dsa_kernels.registry import calls_tl_dot


@pytest.fixture(autouse=True)
def _gluon_on(monkeypatch):
    """These tests are about the Gluon configs: a DSA_KERNELS_GLUON=0 or a forced config in the caller's
    environment must not change them."""
    monkeypatch.setenv("DSA_KERNELS_GLUON", "1")
    monkeypatch.delenv("DSA_SPARSE_MLA_BWD_CONFIG", raising=False)


# ----------------------------------------------------------------------------- the arithmetic
def bwd_schedule_model(q, kv, idx, dout, lse, delta, scale, d_v, block_k=G.BLOCK_K, block_h=G.BLOCK_H):
    """The kernel's arithmetic in PyTorch, CTA by CTA (token, 64-head block) and tile by tile: a row's
    slots up to its last valid one in `block_k`-key tiles, an empty / out-of-range slot's row
    zero-filled and its P set to 0; S and dP in fp32; P = exp2(S scale log2e - lse log2e) (lse = -inf:
    P = 0); dS = P (dP - delta) scale; dS and P rounded to bf16 (the kernel's shared-memory operands);
    dq += dS kv in fp32 across the row; dkv[idx] += dS^T q + P^T dO (latent) and dS^T q_rope (rope)
    per tile, valid slots only (the atomics' order does not change an exact-arithmetic sum)."""
    B, T, H, D = q.shape
    N = kv.shape[1]
    c = scale * G.LOG2E
    dq = torch.zeros(B, T, H, D)
    dkv = torch.zeros(B, N, D)
    for b in range(B):
        for t in range(T):
            row = idx[b, t]
            valid_all = (row >= 0) & (row < N)
            n_slots = int(valid_all.nonzero().max()) + 1 if bool(valid_all.any()) else 0
            for h0 in range(0, H, block_h):
                hs = slice(h0, h0 + block_h)
                qb, dob = q[b, t, hs], dout[b, t, hs]
                lse2 = torch.where(lse[b, t, hs] == -math.inf, math.inf, lse[b, t, hs] * G.LOG2E)
                dq_acc = torch.zeros(qb.shape[0], D)
                for k0 in range(0, -(-n_slots // block_k) * block_k, block_k):
                    sl = row[k0:k0 + block_k]
                    sl = torch.cat([sl, torch.full((block_k - sl.numel(),), -1, dtype=sl.dtype)])
                    pos = torch.arange(k0, k0 + block_k)
                    valid = (sl >= 0) & (sl < N) & (pos < n_slots)
                    rows = torch.where(valid[:, None], kv[b, sl.clamp(0, N - 1)], 0.0)
                    s = qb @ rows.T
                    dp = dob @ rows[:, :d_v].T
                    p = torch.where(valid[None, :], torch.exp2(s * c - lse2[:, None]), 0.0)
                    ds = p * (dp - delta[b, t, hs][:, None]) * scale
                    ds_b, p_b = ds.bfloat16().float(), p.bfloat16().float()
                    dq_acc += ds_b @ rows
                    contrib = ds_b.T @ qb
                    contrib[:, :d_v] += p_b.T @ dob
                    dkv[b].index_add_(0, sl[valid].long(), contrib[valid])
                dq[b, t, hs] = dq_acc
    return dq, dkv


def _bf16(x):
    return x.bfloat16().float()


def _packed_indices(T, N, K, docs, g):
    """Top-k-like lists over packed documents (a token sees its own document's keys up to itself), in
    a random order, -1 where fewer than K keys are visible; plus an out-of-range index, -1 slots in
    the middle of a row, and a row with no valid slot."""
    idx = torch.full((1, T, K), -1, dtype=torch.int32)
    start = 0
    for n in docs:
        for t in range(start, start + n):
            vis = torch.arange(start, t + 1)
            pick = vis[torch.randperm(vis.numel(), generator=g)[:K]]
            slots = torch.randperm(K, generator=g)[:pick.numel()]
            idx[0, t, slots] = pick.to(torch.int32)
        start += n
    idx[0, T - 1, 3] = N + 7  # out of range: an empty slot
    idx[0, T - 2, 10:20] = -1
    idx[0, 4] = -1  # no valid slot: dq 0, nothing added to dkv
    return idx


@pytest.mark.parametrize("H", [64, 128])
def test_schedule_model_matches_the_reference_gradients(H):
    """Odd sizes (T = 37 over two packed documents, K = 45: two tiles, the second partial), -1 slots,
    an out-of-range index, a row with no valid slot; H = 128: two head blocks adding into the same
    dkv rows. dq and dkv against the fp32 reference's autograd gradients."""
    g = torch.Generator().manual_seed(0)
    T, d_v, d_r, K = 37, 32, 16, 45
    N, D = T + 5, d_v + d_r  # kv rows past the last token: never selected (as under CP)
    q = _bf16(torch.randn(1, T, H, D, generator=g))
    kv = _bf16(torch.randn(1, N, D, generator=g))
    dout = _bf16(torch.randn(1, T, H, d_v, generator=g))
    idx = _packed_indices(T, N, K, [20, 17], g)
    scale = D**-0.5
    idx_ref = torch.where((idx >= 0) & (idx < N), idx, -1)
    qr, kvr = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out, lse = sparse_mla_ref(qr, kvr, idx_ref, scale, d_v)
    rdq, rdkv = torch.autograd.grad(out, (qr, kvr), dout)
    delta = (out.detach() * dout).sum(-1)  # kernel.bwd_delta without dlse
    dq, dkv = bwd_schedule_model(q, kv, idx, dout, lse.detach(), delta, scale, d_v)
    assert torch.equal(dq[0, 4], torch.zeros_like(dq[0, 4]))  # the row without a valid slot
    never = torch.ones(N, dtype=torch.bool)
    never[idx_ref[idx_ref >= 0].long()] = False
    assert never.any() and torch.equal(dkv[0, never], torch.zeros_like(dkv[0, never]))  # never selected: 0
    for got, ref, name in ((dq, rdq, "dq"), (dkv, rdkv, "dkv")):
        err = float((got - ref).abs().max() / ref.abs().max())
        assert err <= 2.0**-7, (name, err)  # dS and P in bf16 (the kernel's rounding), nothing else
    # without the bf16 rounding of dS / P the model is the reference up to fp32 summation order
    ref_err = float((dq - rdq).abs().max() / rdq.abs().max())
    assert ref_err > 1e-6  # the rounding is there (the check above is not vacuous)


def test_schedule_model_tile_boundaries_do_not_change_the_sum():
    """dq / dkv of the model at 16- and 32-key tiles agree (the tile is an order, not a value): a
    row of 33 slots ends one key past a 32-key tile."""
    g = torch.Generator().manual_seed(1)
    T, H, d_v, d_r, K = 9, 64, 32, 16, 33
    q = _bf16(torch.randn(1, T, H, d_v + d_r, generator=g))
    kv = _bf16(torch.randn(1, 40, d_v + d_r, generator=g))
    dout = _bf16(torch.randn(1, T, H, d_v, generator=g))
    idx = torch.randint(0, 40, (1, T, K), generator=g, dtype=torch.int32)
    lse = torch.randn(1, T, H, generator=g) + 5.0
    delta = torch.randn(1, T, H, generator=g)
    a = bwd_schedule_model(q, kv, idx, dout, lse, delta, 0.1, d_v, block_k=32)
    b = bwd_schedule_model(q, kv, idx, dout, lse, delta, 0.1, d_v, block_k=16)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- the space and the plan
def _meta(T=64, H=128, D=576, K=2048, N=None, dtype=torch.bfloat16, d_v=512):
    m = dict(device="meta")
    N = T if N is None else N
    q = torch.empty(1, T, H, D, dtype=dtype, **m)
    kv = torch.empty(1, N, D, dtype=dtype, **m)
    idx = torch.empty(1, T, K, dtype=torch.int32, **m)
    ns = torch.empty(1, T, dtype=torch.int32, **m)
    out = torch.empty(1, T, H, d_v, dtype=dtype, **m)
    lse = torch.empty(1, T, H, dtype=torch.float32, **m)
    return q, kv, idx, ns, out, lse


def test_gluon_backward_configs_follow_the_default_on_sm90_only():
    both = ["gluon-k32-c64", "gluon-k32-c64-p", "gluon-k32-c64-v2", "gluon-k32-c64-v4"]
    for version, names in (("3.6.0", both + ["gluon-k32-c128"]), ("3.9.0", both)):
        space = SM.bwd_config_space(90, version)
        assert space[0][1] == "split" and not SM.is_gluon_config(space[0])  # never the default
        gluon = [c[0] for c in space if c[1] == "gluon"]
        assert gluon == names and all(SM.is_gluon_config(c) for c in space if c[1] == "gluon")
        assert all(c[1] == "gluon" for c in space[len(space) - len(names):])  # after the Triton ones
    for cap in (80, 89, 100, 120):
        for version in ("3.6.0", "3.9.0"):
            assert not any(c[1] == "gluon" for c in SM.bwd_config_space(cap, version))


def test_call_space_drops_the_gluon_backward_where_it_does_not_apply(monkeypatch):
    q, kv, *_ = _meta()
    with planning_for(90):
        # opt-in until a GPU has run the kernel: out of the autotuned space by default, in it with
        # DSA_KERNELS_GLUON_BWD=1, always in the space a forced config is looked up in
        monkeypatch.delenv("DSA_KERNELS_GLUON_BWD", raising=False)
        assert not any(n.startswith("gluon") for n in SM.bwd_space_for(q, kv, 512))
        assert "gluon-k32-c64" in SM.bwd_space_for(q, kv, 512, unmeasured=True)
        monkeypatch.setenv("DSA_KERNELS_GLUON_BWD", "sometimes")
        with pytest.raises(ValueError, match="DSA_KERNELS_GLUON_BWD"):
            SM.bwd_space_for(q, kv, 512)
        monkeypatch.setenv("DSA_KERNELS_GLUON_BWD", "1")
        assert "gluon-k32-c64" in SM.bwd_space_for(q, kv, 512)
        for q_, kv_, d_v in (_meta(H=96)[:2] + (512,), _meta(dtype=torch.float32)[:2] + (512,),
                             _meta(D=544)[:2] + (512,)):
            assert not any(n.startswith("gluon") for n in SM.bwd_space_for(q_, kv_, d_v))
        monkeypatch.setenv("DSA_KERNELS_GLUON", "0")
        assert not any(n.startswith("gluon") for n in SM.bwd_space_for(q, kv, 512))
        monkeypatch.setenv("DSA_KERNELS_GLUON", "maybe")
        with pytest.raises(ValueError, match="DSA_KERNELS_GLUON"):
            SM.bwd_space_for(q, kv, 512)
    with planning_for(100):
        monkeypatch.setenv("DSA_KERNELS_GLUON", "1")
        assert not any(n.startswith("gluon") for n in SM.bwd_space_for(q, kv, 512))
    assert G.gluon_bwd_supported(q, kv, 512, 90) is None
    assert "H = 96" in G.gluon_bwd_supported(*_meta(H=96)[:2], 512, 90)


def _plan(name, T=300, H=128, N=1000):
    q, kv, idx, ns, out, lse = _meta(T=T, H=H, N=N)
    dout = torch.empty_like(out)
    dq = torch.empty_like(q)
    dkv = torch.empty(kv.shape, dtype=torch.float32, device="meta")
    cfg = next(c for c in SM.BWD_GLUON_CONFIGS_TRITON_36 if c[0] == name)
    return SM.plan_bwd_config(cfg, q, kv, idx, ns, dout, lse, torch.empty_like(lse), dq, dkv, 0.04, 512)


@pytest.mark.parametrize("name", ["gluon-k32-c64", "gluon-k32-c64-p", "gluon-k32-c128", "gluon-k32-c64-v2",
                                  "gluon-k32-c64-v4"])
def test_gluon_backward_plan(name):
    """One CTA per (token, 64 heads), head block fastest; 8 consumer warps + the producer warp group
    under maxnreg 168 (384 threads, one CTA per SM); 32-key tiles, 2 stages; the dkv chunk by name;
    the analysis column issues exactly the useful FLOPs and reads TileLang's bytes."""
    T, H = 300, 128
    launch = _plan(name, T, H)
    assert isinstance(launch, G.GluonLaunch) and kernel_language(launch.kernel) == "Gluon"
    assert launch.kernel is G._sparse_mla_bwd_gluon_kernel
    assert launch.grid == (T * H // 64, 1) and launch.args["N_HB"] == 2 and launch.args["N_KV"] == 1000
    assert launch.options() == {"num_warps": 8, "maxnreg": 168}
    assert launch.args["BLOCK_K"] == 32 and launch.args["STAGES"] == 2 and launch.args["DIAG"] == 0
    assert launch.args["DKV_CHUNK"] == (128 if name.endswith("c128") else 64)
    assert launch.args["PIPELINE_DKV"] == name.endswith("-p")
    # "-v2" / "-v4": gluon-k32-c64 with dkv added by 2- / 4-wide vector reductions, nothing else changed
    assert launch.args["DKV_VEC"] == {"v2": 2, "v4": 4}.get(name.split("-")[-1], 1)
    assert 168 * (launch.num_warps + launch.args["PRODUCER_WARPS"]) * 32 <= 65536
    from dsa_kernels.ops.sparse_mla.specs import _bwd_work_of, tilelang_bwd_anchor

    work = _bwd_work_of(launch)
    assert work.issued_flops == work.useful_flops  # nothing computed twice (K = 2048: no padding)
    anchor = tilelang_bwd_anchor(H, 2048, 576, 512)
    assert work.write_bytes == anchor["write_bytes"] and work.gather_bytes == anchor["gather_bytes"]


def test_shared_memory_budget_of_the_plan():
    """q (576) + dO (512) of 64 heads, two 32-key stages of 576 columns, dS / P [64, 32] bf16: within
    Hopper's 227 KB (the compile gate measures the compiled figure)."""
    e = 2
    resident = G.BLOCK_H * (576 + 512) * e
    ring = G.STAGES * G.BLOCK_K * 576 * e
    assert resident + ring + 2 * G.BLOCK_H * G.BLOCK_K * e <= 227 * 1024


def test_the_gluon_backward_counts_as_a_dot_product_kernel():
    assert calls_tl_dot(G._sparse_mla_bwd_gluon_kernel)
    assert kernel_language(G._sparse_mla_bwd_gluon_kernel) == "Gluon"


# ----------------------------------------------------------------------------- forcing and verifying
def _run_bwd_meta(monkeypatch, H=128):
    q, kv, idx, ns, out, lse = _meta(H=H)
    ran = []
    monkeypatch.setattr(SM, "_launch", lambda launch: ran.append(launch))
    monkeypatch.setattr(SM, "bwd_delta", lambda out, dout, lse, dlse: torch.empty_like(lse))
    with planning_for(90):
        dq, dkv = SM.sparse_mla_bwd(q, kv, idx, ns, out, lse, torch.empty_like(out), None, 0.04, 512)
    assert dq.shape == q.shape and dkv.shape == kv.shape and dkv.dtype == kv.dtype
    return ran


def test_forced_backward_config_runs_untimed(monkeypatch):
    monkeypatch.setattr(autotune, "pick", lambda *a, **k: pytest.fail("a forced config is not autotuned"))
    with SM.force_bwd_config("gluon-k32-c64"):
        (launch,) = _run_bwd_meta(monkeypatch)
    assert isinstance(launch, G.GluonLaunch) and launch.args["DKV_CHUNK"] == 64 and not launch.args["PIPELINE_DKV"]
    monkeypatch.setenv("DSA_SPARSE_MLA_BWD_CONFIG", "interleaved-h32-k32-s2")
    (launch,) = _run_bwd_meta(monkeypatch)
    assert launch.kernel is SM._sparse_mla_bwd_interleaved_kernel
    monkeypatch.setenv("DSA_SPARSE_MLA_BWD_CONFIG", "gluon-k32-c64")
    with pytest.raises(ValueError, match="not in this call's space") as err:
        _run_bwd_meta(monkeypatch, H=16)  # H = 16: the Gluon kernel does not take the call
    assert "\n" not in str(err.value) and "DSA_SPARSE_MLA_BWD_CONFIG" in str(err.value)


def test_backward_autotuning_verifies_the_gluon_configs_first(monkeypatch):
    seen = {}

    def fake_pick(kernel, key, names, build, on_gpu, device_id="", bench=None, verify=None):
        seen.update(kernel=kernel, names=list(names), verify=verify)
        return names[0], build(names[0])

    monkeypatch.setattr(autotune, "pick", fake_pick)
    (launch,) = _run_bwd_meta(monkeypatch)  # no opt-in: the Gluon backward is not autotuned yet
    assert seen["names"][0].startswith("split") and not any(n.startswith("gluon") for n in seen["names"])
    monkeypatch.setenv("DSA_KERNELS_GLUON_BWD", "1")
    (launch,) = _run_bwd_meta(monkeypatch)
    assert seen["kernel"] == "sparse_mla_bwd" and callable(seen["verify"])
    assert seen["names"][0].startswith("split") and "gluon-k32-c64" in seen["names"]
    assert launch.kernel is SM._sparse_mla_bwd_kernel  # the default ran


def test_gpu_check_runs_each_gluon_backward_config_against_the_reference(monkeypatch):
    """correctness.sparse_mla's Gluon backward part (`_sparse_mla_gluon_backwards`), its GPU path driven
    on the CPU: every Gluon config of the call's backward space is forced in turn, its dq (on the
    check's rows) and dkv compared with the check's reference gradients; one off by more than the
    tolerance fails, one that raises is a failed output naming the error; on the CPU: {}."""
    import dsa_kernels
    from dsa_train.gpucheck import correctness as C

    g = torch.Generator().manual_seed(2)
    T, H, D, d_v = 6, 64, 48, 32
    rows = torch.tensor([0, 3, 5])
    ref_dq = torch.randn(1, 3, H, D, generator=g)
    ref_dkv = torch.randn(1, T, D, generator=g)
    space = {"split-k16": ("split-k16", "split", None, None), "gluon-k32-c64": ("gluon-k32-c64", "gluon", 32, 2),
             "gluon-k32-c128": ("gluon-k32-c128", "gluon", 32, 2)}
    monkeypatch.setattr(SM, "bwd_space_for", lambda q, kv, d_v, unmeasured=False: space)
    calls = []

    def fake_sparse_mla(q, kv, idx, scale, d_v):
        name = SM.forced_bwd_config()
        calls.append(name)
        if name == "gluon-k32-c128":
            raise RuntimeError("out of resource: shared memory")
        out = (q[..., :d_v] * 1.0).clone()

        class Grad(torch.autograd.Function):
            @staticmethod
            def forward(ctx, q_, kv_):
                return out

            @staticmethod
            def backward(ctx, g_):
                dq = torch.zeros(q.shape)
                dq[:, rows] = ref_dq
                return dq, ref_dkv + 0.5 * ref_dkv.abs().max()  # dkv off

        return Grad.apply(q, kv), torch.zeros(q.shape[:3])

    monkeypatch.setattr(dsa_kernels, "sparse_mla", fake_sparse_mla)
    dout = torch.randn(1, T, H, d_v, generator=g)
    args = (torch.zeros(1, T, H, D), torch.zeros(1, T, D), None, 0.1, d_v, rows, dout, ref_dq, ref_dkv)
    assert C._sparse_mla_gluon_backwards(*args) == {}  # CPU tensors: nothing runs
    res = C._sparse_mla_gluon_backwards(*args, on_gpu=True)
    assert calls == ["gluon-k32-c64", "gluon-k32-c128"]
    assert res["dq_gluon-k32-c64"]["ok"] and not res["dkv_gluon-k32-c64"]["ok"]
    assert not res["dq_gluon-k32-c128"]["ok"] and "out of resource" in res["dq_gluon-k32-c128"]["note"]


def test_pipelined_dkv_needs_the_rope_sized_chunk():
    """PIPELINE_DKV runs the rope as the last chunk of the same shape and layout: a 128-column chunk
    with it is one clear error."""
    q, kv, idx, ns, out, lse = _meta()
    dkv = torch.empty(kv.shape, dtype=torch.float32, device="meta")
    with pytest.raises(ValueError, match="pipeline_dkv needs dkv_chunk"):
        G.plan_bwd_gluon(q, kv, idx, ns, torch.empty_like(out), lse, lse, torch.empty_like(q), dkv, 0.04, 512,
                         (128, 1), dkv_chunk=128, pipeline_dkv=True)


def test_vector_dkv_reductions_need_their_layout_and_alignment():
    """DKV_VEC 2 / 4 issues its reductions from a [64 columns, 32 keys] layout (DKV_CHUNK 64, 32-key
    tiles, the rope 64 wide) at 8- / 16-byte aligned addresses: anything else is one clear error."""
    q, kv, idx, ns, out, lse = _meta()
    args = (q, kv, idx, ns, torch.empty_like(out), lse, lse, torch.empty_like(q))
    dkv = torch.empty(kv.shape, dtype=torch.float32, device="meta")
    launch = G.plan_bwd_gluon(*args, dkv, 0.04, 512, (128, 1), dkv_vec=4, pipeline_dkv=True)
    assert launch.args["DKV_VEC"] == 4 and launch.args["PIPELINE_DKV"]
    with pytest.raises(ValueError, match="dkv_vec 2 needs dkv_chunk 64") as err:
        G.plan_bwd_gluon(*args, dkv, 0.04, 512, (128, 1), dkv_chunk=128, dkv_vec=2)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="dkv_vec must be 1, 2 or 4"):
        G.plan_bwd_gluon(*args, dkv, 0.04, 512, (128, 1), dkv_vec=8)
    odd = torch.empty(1, kv.shape[1], 578, dtype=torch.float32, device="meta")[..., :576]  # row stride 578
    G.plan_bwd_gluon(*args, odd, 0.04, 512, (128, 1), dkv_vec=2)  # 578 % 2 == 0: 8-byte aligned rows
    with pytest.raises(ValueError, match="16-byte aligned"):
        G.plan_bwd_gluon(*args, odd, 0.04, 512, (128, 1), dkv_vec=4)


@pytest.mark.parametrize("vec", [2, 4])
def test_vector_reductions_layout_groups_consecutive_columns_within_each_warp(vec):
    """`_red_vec` adds `vec` consecutive registers of a thread (inline asm `pack`) at the first one's
    address: the layout it is issued from (`dkv_vec_layout`) must put `vec` consecutive dkv columns of
    one key in consecutive registers, and keep each warp's part of the [64 columns, 32 keys] chunk as
    in the wgmma accumulator (the move within a warp). The accumulator itself holds consecutive keys
    (different dkv rows), which is why the move is there. Read from Triton's linear layouts."""
    from triton._C.libtriton import gluon_ir, ir
    from triton.experimental.gluon import language as gl

    ctx = ir.context()
    ir.load_dialects(ctx)
    builder = gluon_ir.GluonOpBuilder(ctx)

    def linear(layout):
        return builder.to_linear_layout(layout._to_ir(builder), [64, G.BLOCK_K])

    acc = linear(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, G.BLOCK_K // 2, 16]))
    add = linear(G.dkv_vec_layout(vec))
    assert acc.reg_bases[0] == [0, 1]  # the accumulator: two consecutive keys, not columns
    assert add.reg_bases[:vec.bit_length() - 1] == [[1 << i, 0] for i in range(vec.bit_length() - 1)]
    assert add.warp_bases == acc.warp_bases  # each warp: the same 16 columns x 16 keys
    assert len(add.reg_bases) == len(acc.reg_bases) and len(add.lane_bases) == len(acc.lane_bases)
    # every (column, key) of the chunk once: the bases span the 64 x 32 elements
    bases = add.reg_bases + add.lane_bases + add.warp_bases
    cells = {(0, 0)}
    for base in bases:
        cells |= {(c ^ base[0], k ^ base[1]) for c, k in cells}
    assert len(cells) == 64 * G.BLOCK_K
