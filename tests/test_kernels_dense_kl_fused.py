"""The fused dense KL (eq. 3 in one pass, `indexer_kl/fused.py`, issue 32 item 5) under the Triton
interpreter at the smallest shapes, against `reference.py`: value, KL to uniform and the gradients
of q_I, k_I and w; MHA and MQA forms, odd shapes, packed documents, fp32 and bf16 inputs, the CP
shape (fewer queries than keys, at a query offset), without the attention's lse, chunked launches,
the recompute (`row_stats`), the `DSA_DENSE_KL` switch and checkpointing. Then its analysis column:
the formulas against a walk of the kernels' loops, and the step's FLOP budget at the 671B shapes."""

import gc
import math
import os

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dsa_kernels as K  # noqa: E402
from dsa_kernels import dense_attention_ref, dense_indexer_kl_ref, doc_starts_from_position_ids  # noqa: E402
from dsa_kernels import registry  # noqa: E402
from dsa_kernels.ops.indexer_kl import fused  # noqa: E402
from dsa_kernels.ops.indexer_kl import fused_specs  # noqa: E402
from dsa_kernels.ops.indexer_kl.fused import dense_indexer_kl_fused  # noqa: E402
from dsa_kernels.ops.indexer_kl.function import dense_indexer_kl_triton  # noqa: E402
from dsa_kernels.ops.indexer_kl.reference import _dense_kl_chunk  # noqa: E402
# the analysis column's walks, their tools and shapes (B_W, T_W, H_W) are test_kernels_analysis.py's
from tests.test_kernels_analysis import B as B_W, H as H_W, T as T_W  # noqa: E402
from tests.test_kernels_analysis import (Tally, assert_work, causal_valid, count, dense_kl_tensors,  # noqa: E402
                                         query_blocks, walk_dense_tiles, walk_indexer_tile, with_blocks)

DEV = "cuda" if HAS_CUDA else "cpu"


def _doc_start(B, lengths):
    row = torch.cat([torch.arange(n) for n in lengths])
    return doc_starts_from_position_ids(row.expand(B, -1).contiguous()).to(DEV)


def _inputs(B, T, H, D, HI, DI, form, seed, dtype=torch.float32, N=None, lengths=None):
    g = torch.Generator().manual_seed(seed)
    N = N or T

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(DEV)

    q_full = r(B, N, H, D).to(dtype)
    k_main = (r(B, N, 1, D) if form == "mqa" else r(B, N, H, D)).to(dtype)
    ds = _doc_start(B, lengths or [N])
    # the attention's lse on the values the KL sees (as the model's forward gives it)
    _, lse_full = dense_attention_ref(q_full.float(), k_main.float(), r(B, N, k_main.shape[2], 4), D**-0.5, ds)
    qi, ki = r(B, N, HI, DI).to(dtype), r(B, N, DI).to(dtype)
    wi = torch.rand(B, N, HI, generator=g).to(DEV)
    return q_full, k_main, ds, lse_full, qi, ki, wi


def _grads(fn, xs):
    leaves = [x.detach().clone().requires_grad_() for x in xs]
    value, stats = fn(*leaves)
    return value, stats, torch.autograd.grad(value, leaves)


def _close(got, want, dtype):
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("form", ["mha", "mqa"])
def test_fused_equals_the_reference_on_packed_documents(form, dtype):
    B, T, H, D, HI, DI = 2, 13, 3, 12, 2, 8  # odd T (partial tiles), D and d_I below the 16-wide dot
    qm, km, ds, lse, qi, ki, wi = _inputs(B, T, H, D, HI, DI, form, seed=1, dtype=dtype, lengths=[5, 8])
    scale = D**-0.5
    kl, stats, got = _grads(lambda a, b, c: dense_indexer_kl_fused(a, b, c, qm, km, scale, ds, lse_main=lse),
                            (qi, ki, wi))
    rkl, rstats, want = _grads(lambda a, b, c: dense_indexer_kl_ref(a, b, c, qm, km, scale, ds, lse_main=lse),
                               (qi, ki, wi))
    torch.testing.assert_close(kl, rkl, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats["kl_uniform"], rstats["kl_uniform"], rtol=1e-5, atol=1e-5)
    assert stats["queries"].item() == B * T
    for g, w, x in zip(got, want, (qi, ki, wi)):
        assert g.shape == x.shape and g.dtype == x.dtype
        _close(g, w, dtype)
    lse_i, p_sum = stats["row_stats"]
    assert lse_i.shape == p_sum.shape == (B, T) and torch.isfinite(lse_i).all()
    torch.testing.assert_close(p_sum, torch.ones_like(p_sum), rtol=0, atol=1e-5)  # the target's mass


@pytest.mark.parametrize("form", ["mha", "mqa"])
def test_fused_at_a_query_offset_equals_the_reference_rows(form):
    """CP's shape: T query rows at positions [a, a + T) over N key rows (the gathered sequence),
    packed documents; the reference's own chunk function over the same rows, gradients of all N
    key rows."""
    B, N, T, a, H, D, HI, DI = 2, 21, 6, 11, 2, 12, 3, 8
    q_full, km, ds, lse_full, qi_full, ki, wi_full = _inputs(B, N, H, D, HI, DI, form, seed=2, N=N, lengths=[9, 12])
    scale = D**-0.5
    qm, lse = q_full[:, a:a + T], lse_full[:, a:a + T]
    kl, stats, got = _grads(lambda x, y, z: dense_indexer_kl_fused(x, y, z, qm, km, scale, ds, lse_main=lse, q_offset=a),
                            (qi_full[:, a:a + T], ki, wi_full[:, a:a + T]))
    leaves = [x.detach().clone().requires_grad_() for x in (qi_full, ki, wi_full)]
    rkl, rklu = _dense_kl_chunk(leaves[0], leaves[1], leaves[2], q_full, km, scale, ds, a, a + T, lse_full)
    want = torch.autograd.grad(rkl, leaves)
    torch.testing.assert_close(kl, rkl, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats["kl_uniform"], rklu, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[0], want[0][:, a:a + T], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-5)  # all N key rows
    torch.testing.assert_close(got[2], want[2][:, a:a + T], rtol=1e-4, atol=1e-5)
    assert got[1][:, a + T:].abs().max() == 0  # keys after the run's last query get no gradient


def test_fused_without_lse_runs_the_dense_lse_pass_and_equals_the_reference():
    B, T, H, D, HI, DI = 1, 11, 2, 10, 2, 8
    qm, km, ds, _, qi, ki, wi = _inputs(B, T, H, D, HI, DI, "mha", seed=3, lengths=[4, 7])
    kl, _, got = _grads(lambda a, b, c: dense_indexer_kl_fused(a, b, c, qm, km, D**-0.5, ds), (qi, ki, wi))
    rkl, _, want = _grads(lambda a, b, c: dense_indexer_kl_ref(a, b, c, qm, km, D**-0.5, ds), (qi, ki, wi))
    torch.testing.assert_close(kl, rkl, rtol=1e-5, atol=1e-5)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_chunked_launches_recompute_and_value_only_agree(monkeypatch):
    """Several launches (a scratch for 1 query block), the pre-pass skipped with the forward's
    lse_I (a checkpoint's recompute), and the value-only launch under no_grad: same numbers."""
    B, T, H, D, HI, DI = 1, 70, 2, 8, 2, 8  # 2 query blocks of 64 rows
    qm, km, ds, lse, qi, ki, wi = _inputs(B, T, H, D, HI, DI, "mha", seed=4, lengths=[47, 23])
    args = (qm, km, D**-0.5, ds)
    kl, stats, ref = _grads(lambda a, b, c: dense_indexer_kl_fused(a, b, c, *args, lse_main=lse), (qi, ki, wi))
    blocks = fused.fused_blocks(T, D)
    assert -(-T // blocks["BLOCK_M"]) > 1
    monkeypatch.setattr(fused, "SCRATCH_ELEMS", B * HI * blocks["BLOCK_M"] * blocks["BLOCK_N"])
    kl2, _, got = _grads(lambda a, b, c: dense_indexer_kl_fused(a, b, c, *args, lse_main=lse,
                                                                row_stats=stats["row_stats"]), (qi, ki, wi))
    torch.testing.assert_close(kl2, kl, rtol=1e-6, atol=1e-6)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        kl3, _ = dense_indexer_kl_fused(qi, ki, wi, *args, lse_main=lse)
    torch.testing.assert_close(kl3, kl, rtol=1e-6, atol=1e-6)


def test_switch_selects_the_fused_pass(monkeypatch):
    B, T, H, D, HI, DI = 1, 9, 2, 8, 2, 8
    qm, km, ds, lse, qi, ki, wi = _inputs(B, T, H, D, HI, DI, "mqa", seed=5)
    monkeypatch.setenv("DSA_KERNELS", "triton")
    calls = []
    real = fused._FusedDenseKL.apply
    monkeypatch.setattr(fused._FusedDenseKL, "apply", lambda *a: calls.append(1) or real(*a))
    split = K.dense_indexer_kl(qi, ki, wi, qm, km, D**-0.5, ds, lse_main=lse)[0]
    assert not calls  # the default: the split path
    monkeypatch.setenv("DSA_DENSE_KL", "fused")
    one = K.dense_indexer_kl(qi, ki, wi, qm, km, D**-0.5, ds, lse_main=lse)[0]
    assert calls
    torch.testing.assert_close(one, split, rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("DSA_DENSE_KL", "fast")
    with pytest.raises(ValueError, match="DSA_DENSE_KL must be one of split, fused, fused-keep; got .fast."):
        dense_indexer_kl_triton(qi, ki, wi, qm, km, D**-0.5, ds, lse_main=lse)


def test_fused_keeps_only_its_gradients_and_checkpoints_cleanly():
    """The Function saves its three gradients (in the inputs' dtypes), never a copy of its inputs:
    no storage made inside the region survives the forward, with or without checkpointing, and the
    checkpointed run's loss and gradients equal the plain run's."""
    B, T, H, D, HI, DI = 1, 9, 2, 8, 2, 8
    qm, km, ds, lse, qi, ki, wi = _inputs(B, T, H, D, HI, DI, "mha", seed=6, lengths=[3, 6])

    def run(use_checkpoint):
        leaves = [x.detach().clone().requires_grad_() for x in (qi, ki, wi)]
        probe, saved = [], []

        def region(a, b, c):
            copies = [x * 1 for x in (a, b, c, qm, km, lse)]
            probe.extend(StorageWeakRef(x.untyped_storage()) for x in copies)
            kl = dense_indexer_kl_fused(*copies[:3], copies[3], copies[4], D**-0.5, ds, lse_main=copies[5])[0]
            if not use_checkpoint:
                saved.extend(kl.grad_fn.saved_tensors)
            return kl

        loss = checkpoint(region, *leaves, use_reentrant=False) if use_checkpoint else region(*leaves)
        gc.collect()
        alive = sum(not r.expired() for r in probe)
        loss.backward()
        return alive, loss.detach(), [x.grad for x in leaves], saved

    alive_plain, loss_plain, grads_plain, saved = run(False)
    alive_ckpt, loss_ckpt, grads_ckpt, _ = run(True)
    assert alive_plain == 0 and alive_ckpt == 0
    assert [(t.shape, t.dtype) for t in saved] == [(x.shape, x.dtype) for x in (qi, ki, wi)]
    torch.testing.assert_close(loss_ckpt, loss_plain, rtol=0, atol=0)
    for a, b, s_ in zip(grads_ckpt, grads_plain, saved):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(b, s_, rtol=0, atol=0)  # the backward scales the kept gradient by 1


def test_an_offset_without_lse_fails_clearly():
    qm, km, ds, _, qi, ki, wi = _inputs(1, 8, 2, 8, 2, 8, "mqa", seed=7)
    with pytest.raises(ValueError, match=r"positions \[5, 8\) of 8 key rows need lse_main"):
        dense_indexer_kl_fused(qi[:, 5:], ki, wi[:, 5:], qm[:, 5:], km, 0.3, ds, q_offset=5)


def test_warmup_check_fails_when_the_fused_pass_disagrees(monkeypatch):
    """gpu-check's `speed.warmup_layer` compares the fused KL with the split one before timing it
    as a speed-up: a fused pass with a wrong gradient makes `_fused_kl_rows` report disagreement."""
    from dsa_train.gpucheck import speed
    from dsa_train.gpucheck.core import Options

    monkeypatch.setenv("DSA_KERNELS", "triton")
    qm, km, ds, lse, qi, ki, wi = _inputs(1, 9, 2, 8, 2, 8, "mha", seed=8)
    qi, ki, wi = (x.requires_grad_() for x in (qi, ki, wi))
    args = (qi, ki, wi, qm, km, 8**-0.5, ds)

    def split():
        return dense_indexer_kl_triton(*args, lse_main=lse)[0]

    def attention():
        return None, lse

    opts = Options(device="cpu", small=True)
    flops = {"kl fwd+bwd": 1.0, "layer step": 1.0}
    good = speed._fused_kl_rows(speed.Table(opts, ""), opts, None, split, args, lse, flops, attention)
    assert good["agree"], good
    real = fused._FusedDenseKL.backward

    def wrong(ctx, *grads):
        dq, dk, dw, *rest = real(ctx, *grads)
        return (dq, dk * 1.1, dw, *rest)

    monkeypatch.setattr(fused._FusedDenseKL, "backward", staticmethod(wrong))
    bad = speed._fused_kl_rows(speed.Table(opts, ""), opts, None, split, args, lse, flops, attention)
    assert not bad["agree"] and bad["worst"].startswith("dk_I"), bad


# ---------------------------------------------------------------- analysis column
def _launches(D, key_heads, grad):
    x = dense_kl_tensors(D, key_heads)  # the dense KL walks' shapes: B_W, T_W
    qi, ki, wi, ds, rows = x["qi"], x["ki"], x["wi"], x["ds"], x["rows"]
    blocks = fused.fused_blocks(T_W, D)
    n = -(-T_W // blocks["BLOCK_M"])
    scratch = torch.empty(B_W, n, qi.shape[2], blocks["BLOCK_M"], blocks["BLOCK_N"], dtype=torch.bfloat16,
                          device="meta")
    pre = fused.plan_indexer_lse(qi, ki, wi, ds, rows)
    main = fused.plan_fused_dense_kl(x["qm"], x["km"], qi, ki, wi, ds, x["lse2"], rows, scratch, rows, rows, rows,
                                     x["dq"], x["dk"], x["dw"], D**-0.5, grad)
    return pre, main


def walk_indexer_lse(launch) -> Tally:
    a, t = launch.args, Tally()
    T, bn = a["T"], a["BLOCK_N"]
    ds = [0] * T
    for offs_m, rows, key_tiles in query_blocks(a, B_W, ds):
        t.load(rows, a["DS"])
        for n0 in key_tiles:
            walk_indexer_tile(a, t, rows, count(n0, bn, T))
            t.useful += causal_valid(offs_m, range(n0, n0 + bn), T, ds) * 2 * a["HI"] * a["DI"]
        t.store(rows, a["LSEI"])
    return t


def walk_fused(launch) -> Tally:
    a, t = launch.args, Tally()
    T, H, D, bm, bn = a["T"], a["H"], a["D"], a["BLOCK_M"], a["BLOCK_N"]
    di = count(0, a["BLOCK_DI"], a["DI"])
    ds = [0] * T
    for offs_m, rows, key_tiles in query_blocks(a, B_W, ds):
        t.load(rows, a["DS"]), t.load(rows, a["LSEI"])
        for _h in range(H):
            t.load(rows, a["LSE2"])  # each row's target mass: 1 where some head has keys
        for n0 in key_tiles:
            keys = count(n0, bn, T)
            walk_dense_tiles(a, t, rows, keys, scratch=a["GRAD"])  # the a_j tiles kept with GRAD
            pairs = causal_valid(offs_m, range(n0, n0 + bn), T, ds)
            t.useful += pairs * 2 * (H * D + a["HI"] * a["DI"] * (3 if a["GRAD"] else 1))
            if not a["GRAD"]:
                continue
            for _j in range(a["HI"]):
                t.load(rows * di, a["QI"]), t.load(rows, a["WI"]), t.load(bm * bn, a["SCR"])
                t.load(rows, a["DWI"]), t.store(rows, a["DWI"])
                t.dot(bm, a["BLOCK_DI"], bn), t.store(rows * di, a["DQI"])  # da k_I, atomic add
                t.dot(a["BLOCK_DI"], bn, bm)  # q_I^T da
            t.store(keys * di, a["DKI"])
        t.store(rows, a["KL"]), t.store(rows, a["KLU"]), t.store(rows, a["PSUM"])
    return t


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "value"])
@pytest.mark.parametrize("D, key_heads", [(40, H_W), (96, 1)], ids=["mha", "mqa"])
def test_fused_formulas_equal_a_walk_of_the_kernels(D, key_heads, grad):
    pre, main = _launches(D, key_heads, grad)
    for launch in (main, with_blocks(main, BLOCK_M=16, BLOCK_N=32, BLOCK_D=32)):
        assert_work(fused_specs.fused_kl_work(launch), walk_fused(launch), B_W * T_W)
    for launch in (pre, with_blocks(pre, BLOCK_M=16, BLOCK_N=32)):
        assert_work(fused_specs.indexer_lse_work(launch), walk_indexer_lse(launch), B_W * T_W)


def test_the_fused_step_issues_at_most_1_3x_one_pass_at_the_671b_shapes():
    """Issue 32 item 5: pre-pass + fused pass <= 1.3 x (one pass of the main scores plus the
    indexer's products, 2 (H D + 3 H_I d_I) per pair), in both of MLA's forms, as the compile
    report's analysis column shows it; the split path (statistics forward + gradient-only
    backward) issues more."""
    cases = {c.config: c for c in registry.cases(["dense_indexer_kl"])}
    pre = next(c for c in cases.values() if c.kernel_name == "_indexer_lse_kernel")
    fused_rows = {cfg.split(" D=")[0]: c for cfg, c in cases.items() if c.kernel_name == "_dense_kl_fused_kernel"}
    assert set(fused_rows) == {"fused mha", "fused mqa", "fused value-only mha"}
    ratios = {}
    for form in ("mha", "mqa"):
        w = fused_rows[f"fused {form}"].work
        step = pre.work.issued_flops + w.issued_flops
        assert math.isclose(w.anchor["issued_over_useful"], step / w.useful_flops)
        ratios[form] = step / w.useful_flops
        split = sum(c.work.issued_flops for cfg, c in cases.items()
                    if cfg.startswith((f"{form} fwd", f"{form} bwd")))
        assert step < split
    assert ratios["mha"] <= 1.3 and ratios["mqa"] <= 1.3, ratios
    assert math.isclose(ratios["mha"], (128 * 192 + 4 * 64 * 128) / (128 * 192 + 3 * 64 * 128), rel_tol=1e-3)


# ---------------------------------------------------------------- the model's warm-up step
def _split_step(monkeypatch):
    """The tiny model (Triton kernels) and its dense warm-up step on the split path, no recompute
    -> (model, its layers, (loss, KL to uniform, indexer gradients))."""
    from tests.test_model_warmup_step import _step, _tiny

    monkeypatch.setenv("DSA_KERNELS", "triton")
    model = _tiny()
    return model, len(model.main_layers()), _step(model, "none", frozen=True)


def _assert_same_step(got, want):
    (loss_f, klu_f, grads_f), (loss_s, klu_s, grads_s) = got, want
    torch.testing.assert_close(loss_f, loss_s, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(klu_f, klu_s, rtol=1e-5, atol=1e-6)
    assert grads_f.keys() == grads_s.keys() and grads_s
    for name in grads_s:
        torch.testing.assert_close(grads_f[name], grads_s[name], rtol=1e-4, atol=1e-6, msg=name)


def test_model_warmup_step_on_the_fused_pass_equals_the_split_path(monkeypatch):
    """The tiny model's dense warm-up step (main model frozen, eq. 3 on the Triton path under the
    interpreter) with DSA_DENSE_KL=fused: loss, KL to uniform and every indexer gradient equal the
    split path's, without recompute and under `recompute: full` (where the checkpoint's re-run
    reuses the forward's lse_I: one pre-pass per layer, two fused passes)."""
    from tests.test_model_warmup_step import _step

    model, n, split = _split_step(monkeypatch)
    monkeypatch.setenv("DSA_DENSE_KL", "fused")
    launches = []
    for name in ("plan_indexer_lse", "plan_fused_dense_kl"):
        real = getattr(fused, name)
        monkeypatch.setattr(fused, name, lambda *a, _real=real, _name=name, **k: launches.append(_name) or _real(*a, **k))
    for recompute, want in (("none", {"plan_indexer_lse": n, "plan_fused_dense_kl": n}),
                            ("full", {"plan_indexer_lse": n, "plan_fused_dense_kl": 2 * n})):
        launches.clear()
        got = _step(model, recompute, frozen=True)
        assert {k: launches.count(k) for k in want} == want, (recompute, launches)
        _assert_same_step(got, split)


def test_fused_keep_runs_one_fused_pass_per_layer_under_recompute(monkeypatch):
    """DSA_DENSE_KL=fused-keep: the checkpoint's recompute takes the forward's gradients from
    `row_stats` and launches nothing, so `recompute: full` runs one pre-pass and one fused pass per
    layer, with the split path's loss and gradients."""
    from tests.test_model_warmup_step import _step

    model, n, split = _split_step(monkeypatch)
    monkeypatch.setenv("DSA_DENSE_KL", "fused-keep")
    launches = []
    real = fused.plan_fused_dense_kl
    monkeypatch.setattr(fused, "plan_fused_dense_kl", lambda *a, **k: launches.append(1) or real(*a, **k))
    got = _step(model, "full", frozen=True)
    assert len(launches) == n, launches
    _assert_same_step(got, split)
