"""The Gluon sparse MLA forward (`ops/sparse_mla/gluon_fwd.py`, issue 31): what can be checked without
a GPU. Gluon kernels do not run under TRITON_INTERPRET, so the kernel itself is proven on a GPU
(`dsa-train gpu-check`'s correctness.sparse_mla runs every Gluon config of the space explicitly;
benchmarks/gluon_sparse_mla.py) and compiled by the gate (tests/test_kernels_compile.py, sm_90a under
Triton 3.6 and 3.9). Here: its arithmetic as a PyTorch model of the schedule (64-key tiles, stale
running max, bf16 P) against the reference, where it is admitted in the forward's autotuning space,
its launch plan, the forced-config option, and the verification the autotuner runs before timing it."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from dsa_kernels import autotune, sparse_mla_ref
from dsa_kernels._triton_common import planning_for
from dsa_kernels.compile_report import kernel_language
from dsa_kernels.ops.sparse_mla import gluon_fwd as G
from dsa_kernels.ops.sparse_mla import kernel as SM
from dsa_kernels.registry import calls_tl_dot


@pytest.fixture(autouse=True)
def _gluon_on(monkeypatch):
    """These tests are about the Gluon configs: a DSA_KERNELS_GLUON=0 in the caller's environment
    must not turn them off (the default is tested in test_call_space_drops_...)."""
    monkeypatch.setenv("DSA_KERNELS_GLUON", "1")


# ----------------------------------------------------------------------------- the arithmetic
def schedule_model(q, kv, idx, scale, d_v, block_k=G.BLOCK_K, threshold=G.RESCALE_THRESHOLD, stats=None):
    """The kernel's arithmetic in PyTorch, tile by tile: logits in fp32 over all dims, masked keys at
    -inf (their rows zero-filled), the running max kept stale until it grows by more than
    `threshold` (log2 units), P rounded to bf16 for the value product, l summed from the fp32 P,
    lse = (m + log2 l) ln 2; a row with no valid slot walks one empty tile: out 0, lse -inf."""
    B, T, H, D = q.shape
    N = kv.shape[1]
    out = torch.zeros(B, T, H, d_v)
    lse = torch.empty(B, T, H)
    c = scale * G.LOG2E
    for b in range(B):
        for t in range(T):
            row = idx[b, t]
            valid_all = (row >= 0) & (row < N)
            n_slots = int(valid_all.nonzero().max()) + 1 if bool(valid_all.any()) else 0
            m = torch.full((H,), -1.0e30)
            l_sum = torch.zeros(H)
            acc = torch.zeros(H, d_v)
            for k0 in range(0, max(-(-n_slots // block_k), 1) * block_k, block_k):
                sl = row[k0:k0 + block_k]
                sl = torch.cat([sl, torch.full((block_k - sl.numel(),), -1, dtype=sl.dtype)])
                pos = torch.arange(k0, k0 + block_k)
                valid = (sl >= 0) & (sl < N) & (pos < n_slots)
                rows = torch.where(valid[:, None], kv[b, sl.clamp(0, N - 1)], 0.0)  # zero-filled
                s = (q[b, t] @ rows.T) * c + torch.where(valid, 0.0, -math.inf)[None, :]
                m_new = torch.maximum(m, s.max(1).values)
                m_use = torch.where(m_new > m + threshold, m_new, m)
                if stats is not None and k0 > 0:  # after the first tile: a rescale, or a stale max used
                    stats["rescaled"] = stats.get("rescaled", 0) + int((m_new > m + threshold).sum())
                    stats["stale"] = stats.get("stale", 0) + int(((m_new > m) & (m_new <= m + threshold)).sum())
                alpha = torch.exp2(m - m_use)
                p = torch.exp2(s - m_use[:, None])
                l_sum = l_sum * alpha + p.sum(1)
                acc = acc * alpha[:, None] + p.to(torch.bfloat16).float() @ rows[:, :d_v]
                m = m_use
            has = l_sum > 0
            out[b, t] = acc / torch.where(has, l_sum, 1.0)[:, None]
            lse[b, t] = torch.where(has, (m + torch.log2(torch.where(has, l_sum, 1.0))) * math.log(2), -math.inf)
    return out, lse


@pytest.mark.parametrize("logit_scale", [1.0, 6.0])
def test_schedule_model_matches_the_reference(logit_scale):
    """Three tiles a row, empty slots in the middle and at the tail, an out-of-range index, a row with
    no valid slot; at logit_scale 6 the running max grows by more than the threshold between tiles
    (the rescale path) and P reaches 2^8 before it (the stale-max path)."""
    g = torch.Generator().manual_seed(0)
    B, T, H, d_v, d_r, N, K = 1, 5, 64, 32, 16, 90, 150
    q = (torch.randn(B, T, H, d_v + d_r, generator=g) * logit_scale).bfloat16().float()
    kv = torch.randn(B, N, d_v + d_r, generator=g).bfloat16().float()
    idx = torch.randint(0, N, (B, T, K), generator=g, dtype=torch.int32)
    idx[0, 1, 40:70] = -1
    idx[0, 2, 100:] = -1
    idx[0, 3, 7] = N + 5  # out of range: an empty slot
    idx[0, 4] = -1  # no valid slot
    # the later tiles of row 0 hold the largest logits: the max jumps by more than the threshold
    kv_big = kv.clone()
    kv_big[0, :10] *= 3.0
    idx[0, 0, 128:138] = torch.arange(10, dtype=torch.int32)
    scale = (d_v + d_r) ** -0.5
    idx_ref = torch.where((idx >= 0) & (idx < N), idx, -1)
    stats = {}
    out, lse = schedule_model(q, kv_big, idx, scale, d_v, stats=stats)
    ref_out, ref_lse = sparse_mla_ref(q, kv_big, idx_ref, scale, d_v)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)) and bool(torch.isinf(lse[0, 4]).all())
    assert torch.equal(out[0, 4], torch.zeros_like(out[0, 4]))
    fin = torch.isfinite(ref_lse)
    assert (lse[fin] - ref_lse[fin]).abs().max() <= 1e-4 * max(1.0, float(ref_lse[fin].abs().max()))
    err = float((out - ref_out).abs().max() / ref_out.abs().max())
    assert err <= 2.0**-7, err  # P in bf16 (the kernel's rounding), nothing else
    assert stats["stale"] > 0  # rows whose max grew within the threshold kept the stale one
    if logit_scale > 1:
        assert stats["rescaled"] > 0  # and here some grew by more: O was rescaled after tile 0

# ----------------------------------------------------------------------------- the space and the plan
def _meta(T=64, H=128, D=576, K=2048, N=None, dtype=torch.bfloat16):
    m = dict(device="meta")
    N = T if N is None else N
    q = torch.empty(1, T, H, D, dtype=dtype, **m)
    kv = torch.empty(1, N, D, dtype=dtype, **m)
    idx = torch.empty(1, T, K, dtype=torch.int32, **m)
    return q, kv, idx


def test_gluon_configs_follow_the_default_on_sm90_only():
    for version, names in (("3.6.0", ["gluon", "gluon-pv"]), ("3.9.0", ["gluon"])):
        space = SM.fwd_config_space(90, version)
        assert not SM.is_gluon_config(space[0])  # never the default
        assert [c[0] for c in space if SM.is_gluon_config(c)] == names
        assert all(SM.is_gluon_config(c) for c in space[len(space) - len(names):])  # after the Triton ones
    for cap in (80, 89, 100, 120):
        assert not any(SM.is_gluon_config(c) for c in SM.fwd_config_space(cap, "3.6.0"))


def test_gluon_admits_only_the_shapes_it_is_built_for():
    q, kv, _ = _meta()
    assert G.gluon_fwd_supported(q, kv, 512, 90) is None
    q2, kv2, _ = _meta(D=320)
    assert G.gluon_fwd_supported(q2, kv2, 256, 90) is None  # d_v 256 + rope 64
    cases = [(_meta(H=96), 512, 90, "H = 96"), (_meta(H=16), 512, 90, "H = 16"),
             (_meta(dtype=torch.float32), 512, 90, "16-bit"), (_meta(), 512, 100, "sm_100"),
             (_meta(D=544), 512, 90, "rope 32"), (_meta(D=512 + 64 + 32), 544, 90, "d_v = 544")]
    for (q_, kv_, _), d_v, cap, word in cases:
        why = G.gluon_fwd_supported(q_, kv_, d_v, cap)
        assert why is not None and word in why, (word, why)


def test_call_space_drops_gluon_where_it_does_not_apply(monkeypatch):
    q, kv, _ = _meta()
    with planning_for(90):
        monkeypatch.delenv("DSA_KERNELS_GLUON", raising=False)  # on by default since measured on an H200
        assert "gluon" in SM.fwd_space_for(q, kv, 512)
        q16, kv16, _ = _meta(H=16)
        assert not any(n.startswith("gluon") for n in SM.fwd_space_for(q16, kv16, 512))
        monkeypatch.setenv("DSA_KERNELS_GLUON", "0")
        assert not any(n.startswith("gluon") for n in SM.fwd_space_for(q, kv, 512))
        monkeypatch.setenv("DSA_KERNELS_GLUON", "maybe")
        with pytest.raises(ValueError, match="DSA_KERNELS_GLUON"):
            SM.fwd_space_for(q, kv, 512)
    with planning_for(100):
        assert not any(n.startswith("gluon") for n in SM.fwd_space_for(q, kv, 512))


@pytest.mark.parametrize("name", ["gluon", "gluon-pv"])
def test_gluon_plan(name):
    """One CTA per (token, 64 heads), head block fastest; 8 consumer warps + the producer warp group
    under maxnreg 168 (384 threads, one CTA per SM); the analysis column's arguments present."""
    T, H = 300, 128
    q, kv, idx = _meta(T=T, H=H, N=1000)
    out = torch.empty(1, T, H, 512, dtype=q.dtype, device="meta")
    lse = torch.empty(1, T, H, dtype=torch.float32, device="meta")
    ns = torch.empty(1, T, dtype=torch.int32, device="meta")
    launch = SM.plan_fwd(q, kv, idx, ns, out, lse, 0.04, 512, (name, 64, 2))
    assert isinstance(launch, G.GluonLaunch) and kernel_language(launch.kernel) == "Gluon"
    assert launch.grid == (T * H // 64, 1) and launch.args["N_HB"] == 2 and launch.args["N_KV"] == 1000
    assert launch.options() == {"num_warps": 8, "maxnreg": 168}
    assert launch.args["PIPELINE_PV"] == (name == "gluon-pv") and launch.args["BLOCK_K"] == 64
    assert 168 * (launch.num_warps + launch.args["PRODUCER_WARPS"]) * 32 <= 65536
    from dsa_kernels.ops.sparse_mla.specs import fwd_work

    work = fwd_work(launch)  # the analysis column: issued = useful (the logits once, no padding at k = 2048)
    assert work.issued_flops == work.useful_flops


def test_the_gluon_kernel_counts_as_a_dot_product_kernel():
    """The gate requires wgmma of every dot-product kernel: the registry's source scan finds the Gluon
    kernel's warpgroup_mma (in its partition helpers)."""
    assert calls_tl_dot(G._sparse_mla_fwd_gluon_kernel)
    assert kernel_language(G._sparse_mla_fwd_gluon_kernel) == "Gluon"
    assert kernel_language(SM._sparse_mla_fwd_kernel) == "Triton"


# ----------------------------------------------------------------------------- forcing and verifying
def _run_fwd_meta(monkeypatch, H=128):
    q, kv, idx = _meta(H=H)
    ns = torch.empty(1, q.shape[1], dtype=torch.int32, device="meta")
    ran = []
    monkeypatch.setattr(SM, "_launch", lambda launch: ran.append(launch))
    with planning_for(90):
        SM.sparse_mla_fwd(q, kv, idx, ns, 0.04, 512)
    return ran


def test_forced_config_runs_untimed(monkeypatch):
    monkeypatch.setattr(autotune, "pick", lambda *a, **k: pytest.fail("a forced config is not autotuned"))
    with SM.force_fwd_config("gluon"):
        (launch,) = _run_fwd_meta(monkeypatch)
    assert isinstance(launch, G.GluonLaunch)
    monkeypatch.setenv("DSA_SPARSE_MLA_FWD_CONFIG", "gluon")
    (launch,) = _run_fwd_meta(monkeypatch)
    assert isinstance(launch, G.GluonLaunch)
    with pytest.raises(ValueError, match="not in this call's space") as err:
        _run_fwd_meta(monkeypatch, H=16)  # H = 16: the Gluon kernel does not take the call
    assert "\n" not in str(err.value) and "DSA_SPARSE_MLA_FWD_CONFIG" in str(err.value)


def test_forward_autotuning_verifies_each_config_first(monkeypatch):
    seen = {}

    def fake_pick(kernel, key, names, build, on_gpu, device_id="", bench=None, verify=None):
        seen.update(kernel=kernel, names=list(names), verify=verify)
        return names[0], build(names[0])

    monkeypatch.setattr(autotune, "pick", fake_pick)
    _run_fwd_meta(monkeypatch)
    assert seen["kernel"] == "sparse_mla_fwd" and callable(seen["verify"]) and "gluon" in seen["names"]


def test_verify_compares_probe_tokens_with_the_default(monkeypatch):
    """fwd_verify runs the default and the candidate on the last and the first FWD_VERIFY_TOKENS
    tokens: equal outputs pass, an output off by more than the tolerance, a NaN, a changed -inf lse
    or a launch that raises fail (the last with a warning)."""
    T, H, d_v = 300, 64, 32
    q = torch.zeros(1, T, H, 48)
    kv = torch.zeros(1, T, 48)
    idx = torch.zeros(1, T, 8, dtype=torch.int32)
    ns = torch.full((1, T), 8, dtype=torch.int32)
    space = {"k16-s2": ("k16-s2", 16, 2), "cand": ("cand", 32, 2)}
    probes = []

    def make(mode):
        def fake_launch(launch):
            out, lse = launch.args["O"], launch.args["LSE"]
            probes.append(out.shape[1])
            g = torch.Generator().manual_seed(out.shape[1])
            out.copy_(torch.randn(out.shape, generator=g))
            lse.copy_(torch.randn(lse.shape, generator=g))
            lse[:, 0] = -math.inf
            if launch.args["BLOCK_K"] == 32:
                if mode == "off":
                    out.add_(0.1)
                elif mode == "nan":
                    out[0, 0, 0, 0] = math.nan
                elif mode == "inf":
                    lse[:, 0] = 0.0
                elif mode == "raise":
                    raise RuntimeError("PassManager::run failed")
        return fake_launch

    for mode, want in (("same", True), ("off", False), ("nan", False), ("inf", False), ("raise", False)):
        monkeypatch.setattr(SM, "_launch", make(mode))
        probes.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert SM.fwd_verify(q, kv, idx, ns, 0.1, d_v, space, "cand") is want, mode
        if mode == "raise":
            assert any("PassManager" in str(w.message) for w in caught)
        if mode == "same":
            assert probes == [SM.FWD_VERIFY_TOKENS] * 4  # two probes x (default, candidate)


def test_gpu_check_runs_each_gluon_config_against_the_reference(monkeypatch):
    """correctness.sparse_mla's Gluon part (`_sparse_mla_gluon_forwards`), its GPU path driven on the
    CPU: every Gluon config of the call's space is forced in turn and compared on the check's rows
    with the check's reference; a config off by more than the tolerance fails its output, one that
    raises is a failed output naming the error; the Triton configs are not rerun; on the CPU: {}."""
    import dsa_kernels
    from dsa_train.gpucheck import correctness as C

    g = torch.Generator().manual_seed(1)
    T, H, d_v = 6, 64, 32
    rows = torch.tensor([0, 3, 5])
    ref_out = torch.randn(1, 3, H, d_v, generator=g)
    ref_lse = torch.randn(1, 3, H, generator=g)
    ref_lse[0, 0] = -math.inf
    space = {"k32-s2": ("k32-s2", 32, 2), "gluon": ("gluon", 64, 2), "gluon-pv": ("gluon-pv", 64, 2)}
    monkeypatch.setattr(SM, "fwd_space_for", lambda q, kv, d_v: space)
    calls = []

    def fake_sparse_mla(q, kv, idx, scale, d_v):
        name = SM.forced_fwd_config()
        calls.append(name)
        if name == "gluon-pv":
            raise RuntimeError("out of resource: shared memory")
        out = torch.zeros(1, T, H, d_v)
        lse = torch.zeros(1, T, H)
        out[:, rows], lse[:, rows] = ref_out + 0.5 * ref_out.abs().max(), ref_lse
        return out, lse

    monkeypatch.setattr(dsa_kernels, "sparse_mla", fake_sparse_mla)
    args = (torch.zeros(1, T, H, 48), torch.zeros(1, T, 48), None, 0.1, d_v, rows, ref_out, ref_lse)
    assert C._sparse_mla_gluon_forwards(*args) == {}  # CPU tensors: nothing runs
    res = C._sparse_mla_gluon_forwards(*args, on_gpu=True)
    assert calls == ["gluon", "gluon-pv"]
    assert res["lse_gluon"]["ok"] and not res["out_gluon"]["ok"]
    assert not res["out_gluon-pv"]["ok"] and "out of resource" in res["out_gluon-pv"]["note"]
