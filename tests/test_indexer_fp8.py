"""FP8 index scores (issue 31 item 5): the quantizer against DeepSeek-V3.2's act_quant rules, the
Triton kernel's FP8 path against the inference-order reference (interpreter, odd shapes, packed
documents, a context-parallel rank's queries), and the recipe switch end to end in a tiny model."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dsa_kernels as K  # noqa: E402
from dsa_kernels import doc_starts_from_position_ids  # noqa: E402
from dsa_kernels.ops.indexer_topk import (  # noqa: E402
    SCORINGS,
    fp8_emulated,
    index_scores_fp8_block,
    index_scores_fp8_ref,
    index_scores_ref,
    indexer_topk_ref,
    quantize_fp8_groups,
    quantize_index_inputs,
    scoring_mode,
    topk_from_scores,
)
from dsa_kernels.ops.indexer_topk.kernel import index_scores_triton, indexer_topk_triton  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def doc_start(lengths_per_row):
    rows = [torch.cat([torch.arange(n) for n in lengths]) for lengths in lengths_per_row]
    return doc_starts_from_position_ids(torch.stack(rows)).to(DEV)


def grid(shape, step, lo=-2.0, hi=2.0, seed=0):
    """Multiples of `step` in [lo, hi]: with power-of-two (ue8m0) scales every FP8 value, product
    and (short) sum below is exact in fp32, so any two summation orders give the same scores."""
    g = torch.Generator().manual_seed(seed)
    n = torch.randint(int(lo / step), int(hi / step) + 1, shape, generator=g)
    return (n.float() * step).to(DEV)


# ----------------------------------------------------------------------------- the quantizer
@pytest.mark.parametrize("ue8m0", [False, True])
def test_quantizer_follows_v32_act_quant(ue8m0):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 160, generator=g) * torch.logspace(-3, 2, 5)[None, :, None]  # two groups, one partial
    x[0, 0, :128] = 0.0  # an all-zero group: the 1e-4 amax floor
    x[1, 2, 128:] = 1e-6  # a group below the floor
    q8, s = quantize_fp8_groups(x, ue8m0=ue8m0)
    assert q8.dtype == torch.float8_e4m3fn and q8.shape == x.shape and s.shape == (3, 5, 2)
    amax = torch.stack([x[..., :128].abs().amax(-1), x[..., 128:].abs().amax(-1)], -1).clamp_min(1e-4)
    raw = amax / 448.0
    if ue8m0:  # the next power of two at or above amax / 448
        assert torch.equal(torch.exp2(torch.log2(s).round()), s)
        assert (s >= raw).all() and (s < 2 * raw).all()
    else:
        assert torch.equal(s, raw)
        # the largest element of each group lands on +-448 exactly (the other groups' maxima too)
        big = x[..., :128].abs().argmax(-1, keepdim=True)
        got = q8[..., :128].float().gather(-1, big).abs()
        assert torch.equal(got[amax[..., :1] > 1e-4], torch.full_like(got[amax[..., :1] > 1e-4], 448.0))
    assert torch.equal(q8[0, 0, :128].float(), torch.zeros(128))
    # each value is e4m3's round-to-nearest-even of x / scale (torch's cast; an independent check:
    # the dequantized error is at most half a step of e4m3 at that magnitude, 2^(e - 4) for normals)
    scale = s.repeat_interleave(128, -1)[..., :160]
    y = (x / scale).clamp(-448, 448)
    assert torch.equal(q8.float(), y.to(torch.float8_e4m3fn).float())
    e = torch.floor(torch.log2(y.abs().clamp_min(2.0**-6)))
    assert ((q8.float() - y).abs() <= torch.exp2(e - 4)).all()
    deq = fp8_emulated(x, ue8m0)
    assert torch.equal(deq, q8.float() * scale)


def test_ue8m0_rounding_is_exact_at_powers_of_two():
    # amax / 448 exactly a power of two keeps its scale; one ulp above goes to the next power
    amax = torch.tensor([448.0 * 2.0**-10, torch.nextafter(torch.tensor(448.0 * 2.0**-10), torch.tensor(1.0)).item()])
    x = torch.zeros(2, 128)
    x[:, 0] = amax
    _, s = quantize_fp8_groups(x, ue8m0=True)
    assert s[:, 0].tolist() == [2.0**-10, 2.0**-9]


def test_scoring_names_are_checked():
    assert [scoring_mode(s) for s in SCORINGS] == [(False, False), (True, False), (True, True)]
    with pytest.raises(ValueError, match=r"index scoring must be one of bf16, fp8, fp8_ue8m0; got 'fp16'"):
        K.indexer_topk(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 4), torch.zeros(1, 2, 1),
                       torch.zeros(1, 2, dtype=torch.long), 1, scoring="fp16")


# ----------------------------------------------------------------------------- scores
@pytest.mark.parametrize("B,T,H,D,ue8m0", [(2, 37, 3, 64, False), (1, 33, 5, 160, True), (2, 21, 4, 128, True)])
def test_fp8_kernel_scores_match_the_inference_order_reference(B, T, H, D, ue8m0):
    # odd T and H_I, a head dim below one group, two groups (the second partial), packed documents
    g = torch.Generator().manual_seed(D)
    q, k = torch.randn(B, T, H, D, generator=g).to(DEV), torch.randn(B, T, D, generator=g).to(DEV)
    w = torch.randn(B, T, H, generator=g).to(DEV)
    ds = doc_start([[T - 13, 13]] + [[T]] * (B - 1))
    for q0, q1 in ((0, T), (7, T - 3)):
        got, k0 = index_scores_triton(q, k, w, ds, q0, q1, fp8=True, ue8m0=ue8m0)
        ref, rk0 = index_scores_fp8_ref(q, k, w, ds, q0, q1, ue8m0=ue8m0)
        assert k0 == rk0 and torch.equal(torch.isfinite(got), torch.isfinite(ref))
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # the emulated (dequantized) reference is the same scores up to fp32 rounding order
    emu, _ = index_scores_ref(fp8_emulated(q, ue8m0), fp8_emulated(k, ue8m0), w, ds, 0, T)
    ref, _ = index_scores_fp8_ref(q, k, w, ds, 0, T, ue8m0=ue8m0)
    torch.testing.assert_close(emu, ref, rtol=1e-5, atol=1e-5)
    # and FP8 is an approximation of the bf16/fp32 scores (e4m3: 3 mantissa bits), not them
    exact, _ = index_scores_ref(q, k, w, ds, 0, T)
    f = torch.isfinite(exact)
    err = (ref - exact)[f].abs().max() / exact[f].abs().max()
    assert 0 < err < 0.1


def test_fp8_block_reference_is_v32_fp8_index():
    # one group: ks * sum_j (w qs)_j ReLU(q8_j . k8), spelled out with loops over heads
    B, C, S, H, D = 1, 3, 5, 2, 16
    g = torch.Generator().manual_seed(1)
    q8, qs, k8, ks = quantize_index_inputs(torch.randn(B, C, H, D, generator=g), torch.randn(B, S, D, generator=g))
    w = torch.randn(B, C, H, generator=g)
    got = index_scores_fp8_block(q8, qs, k8, ks, w)
    want = torch.zeros(B, C, S)
    for t in range(C):
        for s in range(S):
            acc = sum(float(w[0, t, j] * qs[0, t, j, 0]) * max(float(q8[0, t, j].float() @ k8[0, s].float()), 0.0)
                      for j in range(H))
            want[0, t, s] = acc * float(ks[0, s, 0])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- top-k
def test_fp8_topk_kernel_equals_reference_on_exact_inputs_with_a_cp_rank(monkeypatch):
    # grid inputs + ue8m0 scales: the quantization rounds (values on a 1/64 grid need 7 bits), but
    # every score is exact, so the Triton selection equals the emulated reference's exactly,
    # ties included; packed documents, short rows (fewer valid keys than k), a CP rank's queries
    from dsa_train.parallel.context import local_positions

    B, T, H, D, topk = 2, 36, 3, 48, 10
    q, k = grid((B, T, H, D), 1 / 64, seed=1), grid((B, T, D), 1 / 64, seed=2)
    w = grid((B, T, H), 0.5, lo=0.0, hi=1.0, seed=3)
    ds = doc_start([[20, 3, 13], [36]])
    ref_idx, ref_val = indexer_topk_ref(fp8_emulated(q, True), fp8_emulated(k, True), w, ds, topk)
    sc, k0 = index_scores_fp8_ref(q, k, w, ds, 0, T, ue8m0=True)
    assert torch.equal(topk_from_scores(sc, topk, k0)[0], ref_idx)  # the emulation is the inference order here
    bf_idx, _ = indexer_topk_ref(q, k, w, ds, topk)
    assert not torch.equal(bf_idx, ref_idx)  # the quantization changes some selections
    idx, val = indexer_topk_triton(q, k, w, ds, topk, chunk_size=7, fp8=True, ue8m0=True)
    assert torch.equal(idx, ref_idx) and torch.equal(val, ref_val)
    assert (idx[0, 20] == -1).sum() == topk - 1  # the first token of a document: one key
    p = local_positions(T, 3, 1, device=DEV)
    monkeypatch.setenv("DSA_KERNELS", "triton")
    idx, val = K.indexer_topk(q[:, p], k, w[:, p], ds, topk, query_positions=p, scoring="fp8_ue8m0")
    assert torch.equal(idx, ref_idx[:, p]) and torch.equal(val, ref_val[:, p])
    monkeypatch.delenv("DSA_KERNELS")
    idx, _ = K.indexer_topk(q[:, p], k, w[:, p], ds, topk, query_positions=p, scoring="fp8_ue8m0")  # the op path
    assert torch.equal(idx, ref_idx[:, p])


# ----------------------------------------------------------------------------- the recipe switch
def test_stage_switch_reaches_the_selection_and_leaves_the_kl_gradient(monkeypatch):
    from dsa_train.config import Attention, StageConfig, Trainable
    from dsa_train.config.schema import IndexScores
    from dsa_train.model import DSAForCausalLM, tiny_config
    from dsa_train.stage import Stage

    torch.manual_seed(0)
    model = DSAForCausalLM(tiny_config(vocab_size=64))
    stage = Stage.of("sparse", StageConfig(attention=Attention.sparse, trainable=Trainable.all, lm_loss_coef=1.0,
                                           topk=8, index_scores=IndexScores.fp8_ue8m0))
    kwargs = stage.forward_kwargs()
    assert kwargs["index_scores"] == "fp8_ue8m0"
    assert "index_scores" not in Stage.of("s", StageConfig(attention=Attention.sparse)).forward_kwargs()
    calls, real = [], K.indexer_topk

    def spy(q, k, w, doc_start, topk, chunk_size=None, query_positions=None, scoring="bf16"):
        out = real(q, k, w, doc_start, topk, chunk_size, query_positions, scoring)
        expected = indexer_topk_ref(fp8_emulated(q, True), fp8_emulated(k, True), w, doc_start, topk)[0]
        calls.append((scoring, torch.equal(out[0], expected)))
        return out

    monkeypatch.setattr(K, "indexer_topk", spy)
    ids = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(15), torch.arange(9)])[None]  # two packed documents
    out = model(ids, labels=ids, position_ids=pos, **kwargs)
    assert calls and all(c == ("fp8_ue8m0", True) for c in calls)
    out.indexer_loss.backward()  # the KL's gradient reaches the indexer through the unquantized scores
    main = [f"model.layers.{i}.self_attn.indexer.wq_b.weight" for i in range(model.config.num_hidden_layers)]
    grads = dict(model.named_parameters())
    assert all(grads[n].grad is not None and grads[n].grad.abs().sum() > 0 for n in main)


def test_recipe_key_is_validated():
    from dsa_train.config.recipes import load_recipe
    from dsa_train.config.validate import validate
    from dsa_train.errors import DSATrainError

    cfg = load_recipe("demo", ["stages.sparse.index_scores=fp8"])
    validate(cfg)
    assert cfg.stages["sparse"].index_scores.value == "fp8"
    with pytest.raises(DSATrainError, match=r"stages\.warmup\.index_scores: fp8 scoring selects keys, which a dense "
                                            r"stage does not; set stages\.warmup\.attention=sparse"):
        validate(load_recipe("demo", ["stages.warmup.index_scores=fp8"]))
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="index_scores=fp9"):  # the CLI prints it in one line
        load_recipe("demo", ["stages.sparse.index_scores=fp9"])


def test_eval_sparse_fp8_mode_selects_on_fp8_scores(monkeypatch):
    from dsa_train.eval.run import EvalError, EvalOptions, check_options, mode_logits
    from dsa_train.model import DSAForCausalLM, tiny_config

    torch.manual_seed(0)
    model = DSAForCausalLM(tiny_config(vocab_size=64))
    check_options(EvalOptions(modes=["dense", "sparse_fp8"]))
    with pytest.raises(EvalError, match="sparse_fp8"):
        check_options(EvalOptions(modes=["sparse_fp9"]))
    seen, real = [], K.indexer_topk

    def spy(*args, **kwargs):
        seen.append(kwargs.get("scoring", "bf16"))
        return real(*args, **kwargs)

    monkeypatch.setattr(K, "indexer_topk", spy)
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(1))
    sparse = mode_logits(model, "sparse", 8, ids)
    fp8 = mode_logits(model, "sparse_fp8", 8, ids, fp8_ue8m0=True)
    assert seen == ["bf16"] * (len(seen) // 2) + ["fp8_ue8m0"] * (len(seen) // 2) and seen
    assert fp8.shape == sparse.shape and torch.isfinite(fp8).all()


def test_quantizing_a_slice_of_tokens_at_a_time_is_the_same():
    from dsa_kernels.ops.indexer_topk.fp8 import quantize_rows

    x = torch.randn(2, 11, 3, 160, generator=torch.Generator().manual_seed(3))
    whole = quantize_fp8_groups(x, ue8m0=True)
    parts = quantize_rows(x, ue8m0=True, chunk_elems=2 * 3 * 160 * 4)  # 4 tokens at a time
    assert all(torch.equal(a.float(), b.float()) for a, b in zip(whole, parts))
