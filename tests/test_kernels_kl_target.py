"""The sparse indexer KL's target from the sparse MLA forward (issue 31 item 4): the Triton forward's
`TARGET` pass emits Sigma_h P per slot ([B, T, K] fp32), the sparse KL reads it instead of gathering
KV rows and recomputing the main logits. Interpreter (TRITON_INTERPRET=1), smallest shapes: the
emitted target against the PyTorch reference (`indexer_kl.reference.sparse_target`) at odd shapes,
masked heads, two head blocks, -1 slots and empty rows, packed documents and CP's shape; the KL's
value and gradients with the emitted target against the separate-gather path; the dispatch (Gluon
configs and deterministic runs take the target kernel after the forward) on the meta device."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dsa_kernels import doc_starts_from_position_ids, sparse_mla_ref  # noqa: E402
from dsa_kernels._triton_common import planning_for  # noqa: E402
from dsa_kernels.ops.indexer_kl.function import sparse_indexer_kl_triton  # noqa: E402
from dsa_kernels.ops.indexer_kl.kernel import _sparse_kl_target_kernel  # noqa: E402
from dsa_kernels.ops.indexer_kl.reference import sparse_target  # noqa: E402
from dsa_kernels.ops.sparse_mla import kernel as SM  # noqa: E402
from dsa_kernels.ops.sparse_mla.function import sparse_mla_triton  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _indices(ds, positions, K, n_keys, seed):
    """[B, Tq, K] int32: random visible keys (doc_start <= s <= position) of each query, dropped
    slots (-1 inside a row), -1 tails where fewer than K keys are visible, one row with none."""
    g = torch.Generator().manual_seed(seed)
    B = ds.shape[0]
    idx = torch.full((B, len(positions), K), -1, dtype=torch.int32)
    for b in range(B):
        for r, t in enumerate(positions):
            lo = int(ds[b, t])
            keys = lo + torch.randperm(t + 1 - lo, generator=g)[:K]
            slots = torch.randperm(K, generator=g)[: len(keys)] if t % 3 == 0 else torch.arange(len(keys))
            idx[b, r, slots] = keys.to(torch.int32)
    idx[-1, 0] = -1
    assert n_keys == ds.shape[1]
    return idx.to(DEV)


def _case(B, lengths, positions, H, d_v, d_r, K, seed):
    g = torch.Generator().manual_seed(seed)
    rows = [torch.cat([torch.arange(n) for n in ls]) for ls in lengths]
    ds = doc_starts_from_position_ids(torch.stack(rows)).to(DEV)
    N, D = ds.shape[1], d_v + d_r
    q = torch.randn(B, len(positions), H, D, generator=g).to(DEV)
    kv = torch.randn(B, N, D, generator=g).to(DEV)
    return q, kv, _indices(ds, positions, K, N, seed), D**-0.5, d_v


CASES = {
    # odd dims, H = 3 (a 4-row head block: one head masked), packed documents, -1 slots and tails
    "odd": (2, [[5, 6], [11]], list(range(11)), 3, 20, 8, 5),
    # CP's shape: 6 query rows (a rank's pair of chunks) over the 16 gathered key rows
    "cp": (1, [[9, 7]], [0, 1, 2, 13, 14, 15], 5, 16, 8, 7),
    # 70 heads: two head blocks of 64, the second partly masked (their sums meet in P_SUM)
    "two_head_blocks": (1, [[6]], list(range(6)), 70, 16, 8, 4),
}


@pytest.fixture(params=SM.TARGET_CONFIGS)
def how(request, monkeypatch):
    """Each way of forming the target (`kernel.TARGET_CONFIGS`), forced (off a GPU the default runs)."""
    monkeypatch.setenv("DSA_SPARSE_MLA_TARGET", request.param)
    return request.param


@pytest.mark.parametrize("name", list(CASES))
def test_forward_target_equals_the_reference(name, how):
    q, kv, idx, scale, d_v = _case(*CASES[name], seed=len(name))
    out, lse, p_sum = sparse_mla_triton(q, kv, idx, scale, d_v, return_target=True)
    ref_out, ref_lse = sparse_mla_ref(q, kv, idx, scale, d_v)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    H = q.shape[2]
    expect = sparse_target(q, kv, ref_lse, idx, scale) * H  # Sigma_h P, before the KL's 1/H
    assert p_sum.shape == idx.shape and p_sum.dtype == torch.float32 and not p_sum.requires_grad
    torch.testing.assert_close(p_sum, expect, rtol=1e-5, atol=1e-6)
    assert (p_sum[idx < 0] == 0).all()  # empty slots carry nothing
    has = (idx >= 0).any(-1)
    torch.testing.assert_close(p_sum.sum(-1)[has], torch.full_like(p_sum.sum(-1)[has], float(H)))
    assert (p_sum[~has] == 0).all()  # a row without a key: no NaN, no mass


def test_without_the_target_the_forward_is_unchanged(how):
    q, kv, idx, scale, d_v = _case(*CASES["odd"], seed=1)
    out, lse = sparse_mla_triton(q, kv, idx, scale, d_v)
    out_t, lse_t, _ = sparse_mla_triton(q, kv, idx, scale, d_v, return_target=True)
    assert torch.equal(out, out_t) and torch.equal(lse, lse_t)


@pytest.mark.parametrize("name", ["odd", "cp"])
def test_kl_with_the_forward_target_equals_the_separate_gather(name, how):
    q, kv, idx, scale, d_v = _case(*CASES[name], seed=7)
    B, T, H, _ = q.shape
    g = torch.Generator().manual_seed(3)
    HI, DI = 3, 16
    leaves = [torch.randn(B, T, HI, DI, generator=g), torch.randn(B, kv.shape[1], DI, generator=g),
              torch.randn(B, T, HI, generator=g)]
    _, lse, p_sum = sparse_mla_triton(q, kv, idx, scale, d_v, return_target=True)

    def run(target):
        qi, ki, wi = (x.to(DEV).requires_grad_() for x in leaves)
        kl, st = sparse_indexer_kl_triton(qi, ki, wi, idx, q, kv, lse, scale, target=target)
        return kl, st["kl_uniform"], torch.autograd.grad(kl * 0.7, (qi, ki, wi))

    kl_new, klu_new, g_new = run(p_sum)
    kl_old, klu_old, g_old = run(None)
    torch.testing.assert_close(kl_new, kl_old, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(klu_new, klu_old, rtol=1e-6, atol=1e-6)
    for a, b in zip(g_new, g_old):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_kl_with_the_target_gathers_no_kv(monkeypatch, how):
    # the KV rows and main logits are not touched: the target kernel never launches, and kv_main /
    # lse_main full of NaN change nothing
    q, kv, idx, scale, d_v = _case(*CASES["cp"], seed=2)
    B, T = q.shape[:2]
    _, lse, p_sum = sparse_mla_triton(q, kv, idx, scale, d_v, return_target=True)
    qi, ki, wi = torch.randn(B, T, 2, 16, device=DEV), torch.randn(B, kv.shape[1], 16, device=DEV), torch.rand(B, T, 2, device=DEV)
    launched = []
    import dsa_kernels._triton_common as C

    real_run = C.Launch.run
    monkeypatch.setattr(C.Launch, "run", lambda self: (launched.append(self.kernel), real_run(self))[1])
    kl, _ = sparse_indexer_kl_triton(qi, ki, wi, idx, q, torch.full_like(kv, float("nan")),
                                     torch.full_like(lse, float("nan")), scale, target=p_sum)
    assert torch.isfinite(kl) and _sparse_kl_target_kernel not in launched and launched
    with pytest.raises(ValueError, match="target .* must be the indices' shape"):
        sparse_indexer_kl_triton(qi, ki, wi, idx, q, kv, lse, scale, target=p_sum[:, :-1])


def test_tensor_parallel_target_summed_over_head_shards_equals_every_heads(how):
    # tensor parallelism: each rank's forward sums its own heads' P; the shards' sums added (what
    # `TensorParallelHeads.sum_heads` all-reduces) with heads=H give the KL of every head's target,
    # reading neither the other ranks' q nor their lse (NaN here)
    q, kv, idx, scale, d_v = _case(*CASES["odd"], seed=5)
    q = torch.cat([q, q.flip(2)], dim=2)  # 6 heads: two shards of 3
    B, T, H, _ = q.shape
    g = torch.Generator().manual_seed(4)
    leaves = [torch.randn(B, T, 2, 16, generator=g), torch.randn(B, kv.shape[1], 16, generator=g),
              torch.randn(B, T, 2, generator=g)]
    _, lse, p_all = sparse_mla_triton(q, kv, idx, scale, d_v, return_target=True)
    shards = [sparse_mla_triton(q[:, :, h : h + 3].contiguous(), kv, idx, scale, d_v, return_target=True)
              for h in (0, 3)]
    summed = shards[0][2] + shards[1][2]
    torch.testing.assert_close(summed, p_all, rtol=1e-6, atol=1e-6)

    def run(q_main, lse_main, target, heads=None):
        qi, ki, wi = (x.to(DEV).requires_grad_() for x in leaves)
        kl, st = sparse_indexer_kl_triton(qi, ki, wi, idx, q_main, kv, lse_main, scale, target=target, heads=heads)
        return [kl, st["kl_uniform"], *torch.autograd.grad(kl, (qi, ki, wi))]

    local_q = q[:, :, :3]
    shard = run(local_q, torch.full_like(shards[0][1], float("nan")), summed, heads=H)
    for a, b in zip(shard, run(q, lse, None)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # without heads the local shard's 3 would divide the target summed over 6: refused, not wrong
    with pytest.raises(ValueError, match="heads=6 needs the target"):
        sparse_indexer_kl_triton(*leaves, idx, local_q, kv, shards[0][1], scale, heads=H)
    with pytest.raises(ValueError, match="heads=2 is fewer than the 3 heads q_main holds; pass the layer's head count"):
        sparse_indexer_kl_triton(*leaves, idx, local_q, kv, shards[0][1], scale, target=summed, heads=2)


def test_chunked_path_refuses_heads_it_cannot_sum(monkeypatch):
    from dsa_kernels.ops.indexer_kl import sparse_indexer_kl

    monkeypatch.setenv("DSA_KERNELS", "ref")
    q, kv, idx, scale, _ = _case(*CASES["odd"], seed=5)
    B, T, H, _ = q.shape
    lse = torch.zeros(B, T, H)
    qi, ki, wi = torch.randn(B, T, 2, 16), torch.randn(B, kv.shape[1], 16), torch.rand(B, T, 2)
    with pytest.raises(ValueError, match="chunked .* every head's q and lse"):
        sparse_indexer_kl(qi, ki, wi, idx.cpu(), q.cpu(), kv.cpu(), lse, scale, heads=2 * H)


# ----------------------------------------------------------------------------- dispatch (meta device)
def _meta(H):
    q = torch.empty(1, 64, H, 576, dtype=torch.bfloat16, device="meta")
    kv = torch.empty(1, 64, 576, dtype=torch.bfloat16, device="meta")
    idx = torch.empty(1, 64, 32, dtype=torch.int32, device="meta")
    ns = torch.empty(1, 64, dtype=torch.int32, device="meta")
    p_sum = torch.empty(1, 64, 32, dtype=torch.float32, device="meta")
    return q, kv, idx, ns, p_sum


def _meta_fwd(monkeypatch, H=128, config=None):
    q, kv, idx, ns, p_sum = _meta(H)
    ran = []
    monkeypatch.setattr(SM, "_launch", lambda launch: ran.append(launch))
    with planning_for(90), SM.force_fwd_config(config):
        SM.sparse_mla_fwd(q, kv, idx, ns, 0.04, 512, p_sum)
    return ran


def test_a_triton_config_forms_the_target_by_either_way(monkeypatch):
    (seq,) = _meta_fwd(monkeypatch)  # off a GPU: the default, the forward then the target kernel
    assert [x.kernel for x in seq.launches] == [SM._sparse_mla_fwd_kernel, _sparse_kl_target_kernel]
    assert seq.launches[0].args["TARGET"] is False
    monkeypatch.setenv("DSA_SPARSE_MLA_TARGET", "forward-pass")
    (seq,) = _meta_fwd(monkeypatch)
    assert [x.kernel for x in seq.launches] == [SM._sparse_mla_fwd_kernel] and seq.launches[0].args["TARGET"] is True
    monkeypatch.setenv("DSA_SPARSE_MLA_TARGET", "bogus")
    with pytest.raises(ValueError, match="DSA_SPARSE_MLA_TARGET='bogus' is not available"):
        _meta_fwd(monkeypatch)


def test_on_a_gpu_both_ways_are_verified_then_timed(monkeypatch):
    from dsa_kernels import autotune

    seen = {}

    def pick(kernel, key, names, build, on_gpu, device_id="", bench=None, verify=None):
        if kernel == "sparse_mla_target":
            seen["names"], seen["verified"] = names, [verify(n) for n in names[1:]]
        return names[0], build(names[0])

    monkeypatch.setattr(autotune, "pick", pick)
    monkeypatch.setattr(SM, "target_verify", lambda *a: a[-1] == "forward-pass")
    _meta_fwd(monkeypatch)
    assert seen == {"names": list(SM.TARGET_CONFIGS), "verified": [True]}


def test_target_verify_compares_the_targets(how):
    q, kv, idx, scale, d_v = _case(*CASES["odd"], seed=4)
    from dsa_kernels.ops.sparse_mla.function import kernel_inputs

    qc, kvc = kernel_inputs(q, kv)
    ns = SM.slot_counts(idx, kv.shape[1])
    assert SM.target_verify(qc, kvc, idx, ns, scale, d_v, SM.fwd_config_space(90)[0], "forward-pass")
    # a target off by one part in 1e3 is refused
    real = SM.plan_with_target

    class Off(SM.LaunchSequence):
        def run(self):
            super().run()
            self.zero.mul_(1.001)

    def off(*a):
        seq = real(*a)
        return Off(seq.launches, seq.zero) if a[-1] == "forward-pass" else seq

    import unittest.mock

    with unittest.mock.patch.object(SM, "plan_with_target", off):
        assert not SM.target_verify(qc, kvc, idx, ns, scale, d_v, SM.fwd_config_space(90)[0], "forward-pass")


def test_a_gluon_config_runs_the_target_kernel_after_its_forward(monkeypatch):
    monkeypatch.setenv("DSA_SPARSE_MLA_TARGET", "forward-pass")
    with pytest.raises(ValueError, match="not available with forward config 'gluon'"):
        _meta_fwd(monkeypatch, config="gluon")
    monkeypatch.delenv("DSA_SPARSE_MLA_TARGET")
    (seq,) = _meta_fwd(monkeypatch, config="gluon")
    fwd, target = seq.launches
    assert fwd.kernel is not SM._sparse_mla_fwd_kernel and "TARGET" not in fwd.args
    assert target.kernel is _sparse_kl_target_kernel
    q, kv, idx, ns, p_sum = _meta(128)
    out, lse = torch.empty(*q.shape[:3], 512, dtype=q.dtype, device="meta"), p_sum[..., :1].expand(1, 64, 128)
    with planning_for(90), pytest.raises(ValueError, match="does not emit the KL target"):
        SM.plan_fwd(q, kv, idx, ns, out, lse, 0.04, 512, ("gluon", 64, 2), p_sum=p_sum)


class _Deterministic:
    def __enter__(self):
        self.was = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)

    def __exit__(self, *exc):
        torch.use_deterministic_algorithms(self.was)


def test_deterministic_runs_with_more_than_two_head_blocks_take_the_target_kernel():
    cfg = ("k16-s2", 16, 2)
    assert SM.fwd_target(cfg, 192) and SM.target_space(cfg, 192) == SM.TARGET_CONFIGS
    with _Deterministic():
        assert SM.fwd_target(cfg, 128)  # two head blocks: order-independent sums
        assert not SM.fwd_target(cfg, 192) and SM.target_space(cfg, 192) == ("target-kernel",)


# ----------------------------------------------------------------------------- the model's sparse stage
def _sparse_step(monkeypatch, old_path: bool, recompute: str):
    """One sparse-stage step of a tiny model on the Triton path (interpreter): loss and gradients.
    old_path: the attention's forward returns no target, so the KL forms its own (the separate gather)."""
    import dsa_kernels as K
    import dsa_train

    monkeypatch.setenv("DSA_KERNELS", "triton")
    real = K.sparse_mla
    if old_path:
        def no_target(*a, return_target=False, **kw):
            out = real(*a, **kw)
            return (*out, None) if return_target else out

        monkeypatch.setattr(K, "sparse_mla", no_target)
    calls = []
    real_kl = K.sparse_indexer_kl
    monkeypatch.setattr(K, "sparse_indexer_kl", lambda *a, **kw: (calls.append(kw.get("target")), real_kl(*a, **kw))[1])
    torch.manual_seed(0)
    cfg = dsa_train.tiny_config(index_topk=6, index_n_heads=4, num_hidden_layers=2, first_k_dense_replace=2)
    model = dsa_train.DSAForCausalLM(cfg)
    for layer in model.model.layers:
        layer.recompute = recompute
    x = torch.randint(0, 4096, (1, 14), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(9), torch.arange(5)])[None]  # two packed documents
    out = model(x, attention="sparse", labels=x, indexer_loss=True, position_ids=pos)
    (out.lm_loss + out.indexer_loss).backward()
    monkeypatch.setattr(K, "sparse_mla", real)
    assert calls and all((t is None) == old_path for t in calls)
    return out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.slow
def test_sparse_stage_loss_and_gradients_equal_the_separate_gather(monkeypatch, how):
    # with activation recompute: the recompute forward forms the target again (the KL keeps it only
    # through save_for_backward) and reuses the forward's top-k
    out_new, g_new = _sparse_step(monkeypatch, False, "full")
    out_old, g_old = _sparse_step(monkeypatch, True, "none")
    torch.testing.assert_close(out_new.lm_loss, out_old.lm_loss, rtol=0, atol=0)
    torch.testing.assert_close(out_new.indexer_loss, out_old.indexer_loss, rtol=1e-6, atol=1e-6)
    assert g_new.keys() == g_old.keys() and any("indexer" in n for n in g_new)
    for n in g_old:
        torch.testing.assert_close(g_new[n], g_old[n], rtol=1e-5, atol=1e-7, msg=n)


def test_analysis_of_the_two_ways_at_the_671b_shapes():
    """The analysis column's account (docs/kernels.md): at H = 128, K = 2048 the forward's TARGET pass
    issues the target kernel's FLOPs but gathers each row once per 64-head block (x2 its bytes)."""
    from dsa_kernels.ops.indexer_kl.kernel import plan_sparse_kl_target
    from dsa_kernels.ops.indexer_kl.specs import sparse_target_work
    from dsa_kernels.ops.sparse_mla.specs import fwd_work
    from dsa_kernels.registry import SHAPES_671B as S

    B, T, H, D, d_v, K = 1, 256, S["H"], S["D"], S["D_V"], S["K"]
    q = torch.empty(B, T, H, D, dtype=torch.bfloat16, device="meta")
    kv = torch.empty(B, T, D, dtype=torch.bfloat16, device="meta")
    idx = torch.empty(B, T, K, dtype=torch.int32, device="meta")
    ns = torch.empty(B, T, dtype=torch.int32, device="meta")
    out = torch.empty(B, T, H, d_v, dtype=torch.bfloat16, device="meta")
    lse = torch.empty(B, T, H, dtype=torch.float32, device="meta")
    p_sum = torch.empty(B, T, K, dtype=torch.float32, device="meta")
    with planning_for(90):
        cfg = SM.fwd_config_space(90)[0]
        plain = fwd_work(SM.plan_fwd(q, kv, idx, ns, out, lse, D**-0.5, d_v, cfg))
        fused = fwd_work(SM.plan_fwd(q, kv, idx, ns, out, lse, D**-0.5, d_v, cfg, p_sum))
    kernel = sparse_target_work(plan_sparse_kl_target(q, kv, idx, ns, lse, p_sum, 0, D**-0.5))
    assert fused.useful_flops - plain.useful_flops == kernel.useful_flops == 2.0 * H * K * D
    assert fused.issued_flops - plain.issued_flops == kernel.issued_flops
    assert fused.gather_bytes - plain.gather_bytes == 2 * kernel.gather_bytes  # two 64-head blocks
    assert fused.read_bytes - plain.read_bytes > kernel.read_bytes


def test_gpu_checks_kl_with_the_attention_target_rows_pass_on_the_interpreter(monkeypatch):
    # gpu-check's rows for the KL with the attention's target (each way, and TP 2's head shards),
    # which only a CUDA run executes, run here on the interpreted kernels against the reference
    from dsa_kernels import sparse_indexer_kl_ref
    from dsa_train.gpucheck.correctness import _kl_with_attention_target

    monkeypatch.setenv("DSA_KERNELS", "triton")
    q, kv, idx, scale, d_v = _case(*CASES["odd"], seed=9)
    q = torch.cat([q, q.flip(2)], dim=2)  # 6 heads
    B, T = q.shape[:2]
    g = torch.Generator().manual_seed(8)
    ins = [torch.randn(B, T, 2, 16, generator=g), torch.randn(B, kv.shape[1], 16, generator=g),
           torch.randn(B, T, 2, generator=g)]
    _, lse = sparse_mla_ref(q, kv, idx, scale, d_v)
    ref_ins = [x.clone().requires_grad_() for x in ins]
    rkl, rstats = sparse_indexer_kl_ref(*ref_ins, idx, q, kv, lse, scale)
    rgrads = torch.autograd.grad(rkl, ref_ins)
    rows = _kl_with_attention_target([x.requires_grad_() for x in ins], idx, q, kv, scale, d_v, rkl, rstats, rgrads)
    assert {k for k in rows if k.endswith("(tp2 head shards)")} == {f"{n} (tp2 head shards)" for n in
                                                                    ("kl", "kl_uniform", "dq_I", "dk_I", "dw")}
    assert all(r["ok"] for r in rows.values()), {k: r for k, r in rows.items() if not r["ok"]}
