"""The Gluon index-score kernel (`ops/indexer_topk/gluon_scores.py`, issue 31). Gluon kernels do not run
under the interpreter, so on the CPU its schedule is checked as a PyTorch model (`model_scores`): the
kernel's grid and per-CTA live range, its producer / consumer handshake over the 6-stage ring
(simulated mbarriers with the kernel's phase formulas, interleavings drawn at random: every tile read
is the tile the producer wrote there, nothing deadlocks), the consumers' tile assignment, the epilogue
(ReLU keeping NaN, weights, the head sum over a [64, BLOCK_Q, 64] reshape, -0.0 -> +0.0, the mask,
the bf16 rounding) and the dead-column stores, against the reference and the Triton kernel (under
TRITON_INTERPRET=1) at odd shapes, packed documents, a CP rank's positions and a bf16 block. Then the
wiring: the score space, the opt-in, forcing by name, the support check, the analysis column. The
GPU proves the kernel itself (gpu-check's correctness.index_scores_bf16, benchmarks/gluon_index_scores.py)."""

import os
import random

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dsa_kernels import doc_starts_from_position_ids  # noqa: E402
from dsa_kernels._triton_common import planning_for  # noqa: E402
from dsa_kernels.ops.indexer_topk import gluon_scores as G  # noqa: E402
from dsa_kernels.ops.indexer_topk import index_scores_ref  # noqa: E402
from dsa_kernels.ops.indexer_topk import kernel as TK  # noqa: E402

INT32_MAX = 2147483647


# ---------------------------------------------------------------- the model of the kernel's schedule
class _Barrier:
    """An mbarrier of arrival count 1: `wait(parity)` passes once the phase of that parity completed
    (a fresh barrier passes parity 1), as the kernel's `mbarrier.wait`."""

    def __init__(self):
        self.completed = 0

    def passes(self, parity: int) -> bool:
        return self.completed % 2 != parity

    def arrive(self):
        self.completed += 1


def _live_range(positions, doc_start, b, pid_q, pid_n, r0, r1, k0, W_LEN, block_q, span):
    """`gluon_scores._live_range`: (span0, span1, lo, hi, n_tiles)."""
    n = G.BLOCK_N
    offs_c = [pid_q * block_q + j for j in range(block_q)]
    t = [int(positions[r0 + c]) if r0 + c < r1 else -1 for c in offs_c]
    ds = [int(doc_start[b, tt]) if r0 + c < r1 else INT32_MAX for c, tt in zip(offs_c, t)]
    span0 = pid_n * span
    span1 = min(span0 + span, W_LEN)
    lo = max(span0, ((min(ds) - k0) // n) * n)
    hi = min(span1, max(t) - k0 + 1)
    return span0, span1, lo, hi, max(-(-(hi - lo) // n), 0)


def _relu_keep_nan(x):
    return torch.where(torch.isnan(x), x, x.clamp_min(0.0))


def _round_to_bf16(x):
    """The kernel's integer round-to-nearest-even of fp32 to bf16 (non-finite unchanged)."""
    u = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    r = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(torch.int64)
    r = torch.where(r >= 2**31, r - 2**32, r).to(torch.int32).view(torch.float32)
    return torch.where(torch.isfinite(x), r, x)


def _cta(q, k, w, positions, doc_start, S, b, pid_q, pid_n, r0, r1, k0, block_q, span, rng,
         stages=G.STAGES, lag=G.COPY_LAG):
    """One CTA: the producer and the two consumers as coroutines over simulated mbarriers, one step
    of a runnable party at a time, picked by `rng`; -> the (consumer, tile) order of the epilogues."""
    B, Tq, HI, DI = q.shape
    C, W_LEN = S.shape[1], S.shape[2]
    n, bhi, st = G.BLOCK_N, G.BLOCK_HI, stages
    assert 1 <= lag < st  # lag 0 would publish two groups at tile 0 (not modelled: the kernel needs >= 1)
    ready, empty, q_bar = [_Barrier() for _ in range(st)], [_Barrier() for _ in range(st)], _Barrier()
    ring = [None] * st  # (tile, k tile [64, 128]) per stage
    q_smem = torch.zeros(block_q * bhi, G.BLOCK_D)
    trace = []

    def producer():
        for qi in range(block_q):
            row = r0 + pid_q * block_q + qi
            if row < r1:
                q_smem[qi * bhi: qi * bhi + HI, :DI] = q[b, row].float()
        span0, span1, lo, hi, n_tiles = _live_range(positions, doc_start, b, pid_q, pid_n, r0, r1, k0, W_LEN,
                                                    block_q, span)
        for i in range(n_tiles):
            s = i % st
            parity = ((i // st) & 1) ^ 1
            while not empty[s].passes(parity):
                yield
            offs_w = lo + i * n + torch.arange(n)
            tile = torch.zeros(n, G.BLOCK_D)
            live = offs_w < span1
            tile[live, :DI] = k[b, k0 + offs_w[live]].float()
            ring[s] = (i, tile)
            yield
            # groups: q (0), tiles 0..i (1..i + 1); all but the last COPY_LAG landed: publish one
            g = i + 1 - lag
            if g >= 0:
                (q_bar if g == 0 else ready[(g - 1) % st]).arrive()
        for g in range(max(n_tiles + 1 - lag, 0), n_tiles + 1):  # the rest, after wait_group(0)
            (q_bar if g == 0 else ready[(g - 1) % st]).arrive()

    def consumer(cid):
        span0, span1, lo, hi, n_tiles = _live_range(positions, doc_start, b, pid_q, pid_n, r0, r1, k0, W_LEN,
                                                    block_q, span)
        offs_c = pid_q * block_q + torch.arange(block_q)
        mask_q = r0 + offs_c < r1
        t = torch.where(mask_q, positions[(r0 + offs_c).clamp_max(len(positions) - 1)].long(), -1)
        ds = torch.where(mask_q, doc_start[b, t.clamp_min(0)].long(), INT32_MAX)
        keys = torch.arange(n)

        def store(offs_w, vals, col_mask):
            m = col_mask[:, None] & mask_q[None, :]
            for kk, j in m.nonzero().tolist():
                S[b, int(offs_c[j]), int(offs_w[kk])] = vals[kk, j]

        offs_r = torch.arange(block_q * bhi)
        row_r, head_r = r0 + pid_q * block_q + offs_r // bhi, offs_r % bhi
        w_r = torch.zeros(block_q * bhi)
        ok = (row_r < r1) & (head_r < HI)
        w_r[ok] = w[b, row_r[ok], head_r[ok]].float()
        while not q_bar.passes(0):
            yield
        for i in range(cid, n_tiles, 2):
            s = i % st
            while not ready[s].passes((i // st) & 1):
                yield
            tile_i, tile = ring[s]
            assert tile_i == i, f"consumer {cid} read tile {tile_i} from stage {s}, expected {i}"
            acc = tile @ q_smem.T  # [64 keys, BLOCK_Q x 64]
            empty[s].arrive()
            yield
            x = w_r[None, :] * _relu_keep_nan(acc)
            sums = x.view(n, block_q, bhi).sum(-1)
            sums = torch.where(sums == 0.0, torch.zeros_like(sums), sums)
            offs_w = lo + i * n + keys
            offs_s = k0 + offs_w
            valid = (offs_s[:, None] <= t[None, :]) & (offs_s[:, None] >= ds[None, :])
            sums = torch.where(valid, sums, torch.full_like(sums, float("-inf")))
            if S.dtype == torch.bfloat16:
                sums = _round_to_bf16(sums)
            store(offs_w, sums, offs_w < span1)
            trace.append((cid, i))
        dead = torch.full((n, block_q), float("-inf"))
        if cid == 0:
            end = min(lo, span1)
            for n0 in range(span0, end, n):
                store(n0 + keys, dead, n0 + keys < end)
        else:
            for n0 in range(max(hi, span0), span1, n):
                store(n0 + keys, dead, n0 + keys < span1)

    parties = [producer(), consumer(0), consumer(1)]
    budget = 10_000 + 200 * W_LEN  # steps: far more than any finishing schedule takes
    while parties:
        budget -= 1
        assert budget > 0, f"deadlock: {len(parties)} parties still waiting after every step of the budget"
        p = rng.choice(parties)
        try:
            next(p)
        except StopIteration:
            parties.remove(p)
    return trace


def model_scores(q, k, w, doc_start, positions, r0, r1, k0, W_LEN, score_dtype=torch.float32, block_q=4,
                 key_span=None, seed=0):
    """The Gluon kernel's output as its schedule computes it: [B, r1 - r0, W_LEN] (NaN where no CTA
    wrote: every entry must be written)."""
    B = q.shape[0]
    span = key_span or G.KEY_SPAN_TILES * G.BLOCK_N
    S = torch.full((B, r1 - r0, W_LEN), float("nan"), dtype=score_dtype)
    rng = random.Random(seed)
    for b in range(B):
        for pid_q in range(-(-(r1 - r0) // block_q)):
            for pid_n in range(-(-W_LEN // span)):
                _cta(q, k, w, positions, doc_start, S, b, pid_q, pid_n, r0, r1, k0, block_q, span, rng)
    return S


# ---------------------------------------------------------------- inputs
def grid_values(shape, seed, denom=8):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2 * denom, 2 * denom + 1, shape, generator=g).float() / denom


def inputs(B=1, T=150, H=5, D=40, docs=(61, 23, 66)):
    q, k, w = grid_values((B, T, H, D), 1), grid_values((B, T, D), 2), grid_values((B, T, H), 3)
    pos_ids = torch.cat([torch.arange(n) for n in docs])[None].expand(B, -1)
    return q, k, w, doc_starts_from_position_ids(pos_ids)


CONFIGS = list(G.GLUON_SCORE_CONFIGS)


@pytest.mark.parametrize("config", CONFIGS)
def test_model_equals_the_reference_at_odd_shapes_packed_documents(config):
    """Grid inputs (every product exact): the schedule's scores equal the reference's bit for bit, every
    entry written, for whole rows and a chunk whose key window starts at a document; 64-key spans (one
    tile: dead spans before the document and after the causal edge) and the default span."""
    q, k, w, ds = inputs(B=2)
    T = q.shape[1]
    pos = torch.arange(T, dtype=torch.int32)
    for (q0, q1), span in (((0, T), 64), ((70, 101), 64), ((85, 150), None)):
        ref, k0 = index_scores_ref(q, k, w, ds, q0, q1)
        got = model_scores(q, k, w, ds, pos, q0, q1, k0, q1 - k0, block_q=G.GLUON_SCORE_CONFIGS[config],
                           key_span=span, seed=q0)
        assert not torch.isnan(got).any(), "an entry no CTA wrote"
        assert torch.equal(got, ref), (config, q0, q1, span)


def test_model_equals_the_reference_at_a_cp_ranks_positions():
    """Context parallelism: the local rows are two chunks of the sequence (rank r and 2 CP - 1 - r);
    each row is scored at its global position, as `indexer_topk_at_positions_ref` does."""
    q, k, w, ds = inputs(T=160, docs=(100, 60))
    chunk = 20
    pos = torch.cat([torch.arange(1 * chunk, 2 * chunk), torch.arange(6 * chunk, 7 * chunk)]).to(torch.int32)
    q_loc, w_loc = q[:, pos.long()], w[:, pos.long()]
    for r0, r1 in ((0, chunk), (chunk, 2 * chunk)):
        p = pos[r0:r1].long()
        k0, k_end = int(ds[0, p].min()), int(p.max()) + 1
        got = model_scores(q_loc, k, w_loc, ds, pos, r0, r1, k0, k_end - k0, block_q=4, key_span=64, seed=r0)
        full, _ = index_scores_ref(q, k, w, ds, 0, 160)  # k0 = 0 there: columns are key positions
        assert torch.equal(got, full[:, p, k0:k_end]), (r0, r1)


def test_model_equals_the_triton_kernel_on_a_bf16_block_and_non_finite_inputs():
    """A bf16 score block (the kernel's integer round-to-nearest-even, as the Triton kernel's), random
    inputs, a NaN in one query (kept: ReLU propagates it), and exact zeros times negative weights
    (-0.0 -> +0.0): the schedule equals the Triton kernel (interpreter on the CPU) bit for bit where
    the sums are exact, and within one bf16 rounding elsewhere (the head sums' order differs)."""
    g = torch.Generator().manual_seed(5)
    T, H, D = 100, 4, 32
    q, k = torch.randn(1, T, H, D, generator=g), torch.randn(1, T, D, generator=g)
    w = torch.randn(1, T, H, generator=g)
    q[0, 50, 1, 3] = float("nan")
    q[0, 60] = 0.0  # every logit 0: ReLU 0 times a negative weight
    w[0, 60] = -1.0
    ds = doc_starts_from_position_ids(torch.cat([torch.arange(37), torch.arange(63)])[None])
    pos = torch.arange(T, dtype=torch.int32)
    for dtype in (torch.bfloat16, torch.float32):
        want, k0 = TK.index_scores_triton(q, k, w, ds, 30, T, score_dtype=dtype)
        got = model_scores(q, k, w, ds, pos, 30, T, k0, T - k0, score_dtype=dtype, block_q=2, key_span=64)
        assert torch.equal(torch.isnan(got), torch.isnan(want)) and bool(torch.isnan(got[0, 20]).any())
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        zero = got[0, 30] == 0
        assert bool(zero.any()) and not torch.signbit(got[0, 30][zero]).any()  # +0.0 only
        fin = torch.isfinite(want)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert torch.allclose(got[fin].float(), want[fin].float(), rtol=tol, atol=tol * float(want[fin].abs().max()))


@pytest.mark.parametrize("n_tiles_keys", [1, 64, 130, 320, 640])
def test_ring_handshake_never_deadlocks_nor_overwrites(n_tiles_keys):
    """The producer / consumer handshake with the kernel's phase formulas (empty: ((i // STAGES) & 1) ^ 1,
    ready: (i // STAGES) & 1, the producer publishing COPY_LAG copy groups behind), at the kernel's ring
    and at other (stages, lag) pairs with 1 <= lag < stages: over many random interleavings
    each consumer reads, in order, exactly its tiles (c, c + 2, ...) from the stage the producer filled,
    and every CTA finishes (a deadlock would loop forever: bounded by the test's own step budget)."""
    T = n_tiles_keys
    q, k, w = grid_values((1, T, 2, 16), 1), grid_values((1, T, 16), 2), grid_values((1, T, 2), 3)
    ds = torch.zeros(1, T, dtype=torch.long)
    pos = torch.full((T,), T - 1, dtype=torch.int32)  # every row sees the whole window: all tiles live
    n_tiles = -(-n_tiles_keys // G.BLOCK_N)
    for stages, lag in ((G.STAGES, G.COPY_LAG), (2, 1), (4, 3), (3, 1)):
        for seed in range(6):
            S = torch.full((1, 1, T), float("nan"))
            trace = _cta(q, k, w, pos, ds, S, 0, 0, 0, 0, 1, 0, 1, 64 * n_tiles, random.Random(seed), stages, lag)
            assert [i for c, i in trace if c == 0] == list(range(0, n_tiles, 2))
            assert [i for c, i in trace if c == 1] == list(range(1, n_tiles, 2))


# ---------------------------------------------------------------- wiring
def _meta(HI=64, DI=128, dtype=torch.bfloat16, T=256, score_dtype=torch.float32):
    meta = dict(device="meta")
    q = torch.empty(1, T, HI, DI, dtype=dtype, **meta)
    k = torch.empty(1, T, DI, dtype=dtype, **meta)
    w = torch.empty(1, T, HI, dtype=torch.float32, **meta)
    ds = torch.empty(1, T, dtype=torch.int64, **meta)
    pos = torch.empty(T, dtype=torch.int32, **meta)
    scores = torch.empty(1, 64, T, dtype=score_dtype, **meta)
    return q, k, w, ds, pos, scores


def test_gluon_configs_join_sm90s_space_only_with_the_opt_in(monkeypatch):
    q, k, w, ds, pos, scores = _meta()
    triton_names = [n for n, _ in TK.SCORE_CONFIG_SPACE]
    assert [n for n, _ in TK.score_config_space(90)] == triton_names + CONFIGS
    assert [n for n, _ in TK.score_config_space(100)] == triton_names
    with planning_for(90):
        monkeypatch.delenv("DSA_KERNELS_GLUON_SCORES", raising=False)
        assert TK.score_space_for(q, k, scores, False, on_gpu=True) == triton_names  # off by default
        assert TK.score_space_for(q, k, scores, False, unmeasured=True, on_gpu=True) == triton_names + CONFIGS
        monkeypatch.setenv("DSA_KERNELS_GLUON_SCORES", "1")
        assert TK.score_space_for(q, k, scores, False, on_gpu=True) == triton_names + CONFIGS
        assert TK.score_space_for(q, k, scores, True, on_gpu=True) == triton_names  # FP8: the Triton kernel
        assert TK.score_space_for(q, k, scores, False, on_gpu=False) == triton_names  # never interpreted
        q2, k2, *_ = _meta(DI=192)
        assert TK.score_space_for(q2, k2, scores, False, on_gpu=True) == triton_names  # d_I > 128
        monkeypatch.setenv("DSA_KERNELS_GLUON", "0")  # the Gluon kill switch: forced checks too
        assert TK.score_space_for(q, k, scores, False, unmeasured=True, on_gpu=True) == triton_names
        monkeypatch.delenv("DSA_KERNELS_GLUON")
        monkeypatch.setenv("DSA_KERNELS_GLUON_SCORES", "yes please")
        with pytest.raises(ValueError, match="DSA_KERNELS_GLUON_SCORES must be 1 or 0"):
            TK.score_space_for(q, k, scores, False, on_gpu=True)
    with planning_for(100):
        monkeypatch.setenv("DSA_KERNELS_GLUON_SCORES", "1")
        assert TK.score_space_for(q, k, scores, False, on_gpu=True) == triton_names


@pytest.mark.parametrize("config", CONFIGS)
def test_forcing_a_gluon_config_plans_the_gluon_kernel(config):
    q, k, w, ds, pos, scores = _meta(HI=5, DI=40)
    with planning_for(90):
        launch = TK.plan_scores(q, k, w, ds, scores, pos, 0, 64, 0, config=config)
        assert launch.kernel is G._index_scores_gluon_kernel
        assert set(launch.args) == set(launch.kernel.arg_names)  # every parameter, nothing the kernel lacks
        assert launch.args["DIAG"] == 0  # the timing diagnostics only where the benchmark sets them
        assert launch.args["BLOCK_Q"] == G.GLUON_SCORE_CONFIGS[config] and launch.args["HI"] == 5
        assert launch.grid == (64 // G.GLUON_SCORE_CONFIGS[config], 1, 1)
        assert launch.options() == dict(num_warps=G.CONSUMER_WARPS, maxnreg=G.MAXNREG)
        q8 = torch.empty(q.shape, dtype=torch.float8_e4m3fn, device="meta")
        k8 = torch.empty(k.shape, dtype=torch.float8_e4m3fn, device="meta")
        qs, ks = torch.empty(*q.shape[:3], 1, device="meta"), torch.empty(*k.shape[:2], 1, device="meta")
        with pytest.raises(ValueError, match="does not take this call: FP8"):
            TK.plan_scores(q8, k8, w, ds, scores, pos, 0, 64, 0, qs, ks, config=config)
    with planning_for(100), pytest.raises(ValueError, match="sm_100"):
        TK.plan_scores(q, k, w, ds, scores, pos, 0, 64, 0, config=config)
    with pytest.raises(ValueError, match="not a score config"):
        TK.plan_scores(q, k, w, ds, scores, pos, 0, 64, 0, config="gluon-nonsense")


def test_the_env_forces_a_config_by_name(monkeypatch):
    """DSA_INDEX_SCORES_CONFIG forces a config wherever the score kernel runs (here a Triton one, run by
    the interpreter: the same scores as the reference); a Gluon one off the GPU fails with its reason."""
    q, k, w, ds = inputs(T=45, H=3, D=24, docs=(19, 7, 19))
    planned = []
    real = TK.plan_scores
    monkeypatch.setattr(TK, "plan_scores", lambda *a, **kw: planned.append(a[-1]) or real(*a, **kw))
    monkeypatch.setenv("DSA_INDEX_SCORES_CONFIG", "keys-rows")
    got, k0 = TK.index_scores_triton(q, k, w, ds, 0, 45)
    ref, _ = index_scores_ref(q, k, w, ds, 0, 45)
    assert planned == ["keys-rows"] and torch.equal(got, ref)
    monkeypatch.setenv("DSA_INDEX_SCORES_CONFIG", "gluon-keys-rows")
    with planning_for(100), pytest.raises(ValueError, match="unset DSA_INDEX_SCORES_CONFIG"):
        TK.index_scores_triton(q, k, w, ds, 0, 45)


def test_supported_calls_and_the_analysis_column():
    q, k, w, ds, pos, scores = _meta()
    assert G.gluon_scores_supported(q, k, scores, False, 90) is None
    assert "sm_80" in G.gluon_scores_supported(q, k, scores, False, 80)
    assert "H_I = 128" in G.gluon_scores_supported(*_meta(HI=128)[:2], scores, False, 90)
    assert "d_I = 36" in G.gluon_scores_supported(*_meta(DI=36)[:2], scores, False, 90)
    assert "16-bit" in G.gluon_scores_supported(*_meta(dtype=torch.float32)[:2], scores, False, 90)
    with planning_for(90):
        for config, bq in G.GLUON_SCORE_CONFIGS.items():
            launch = TK.plan_scores(q, k, w, ds, scores, pos, 192, 256, 0, config=config)
            work = TK.gluon_scores_work(launch)
            causal = sum(t + 1 for t in range(192, 256)) / 64
            assert work.useful_flops == pytest.approx(2 * 64 * 128 * causal)
            assert work.issued_flops == 2 * 64 * 128 * 256  # every live 64-key tile in full: 4 of them
            # q once per CTA (64 heads x 128 x 2 B per query and key span), k per live tile / BLOCK_Q queries
            assert work.read_bytes == pytest.approx(64 * 128 * 2 + 256 * 128 * 2 / bq, rel=0.05)


def test_gpu_check_forces_every_config_of_the_calls_space(monkeypatch):
    """correctness.index_scores_bf16's config loop, its GPU path driven on the CPU: every config of the
    call's space (`score_space_for(..., unmeasured=True)`: the Gluon ones on an sm_90 GPU) after the
    default is forced in turn and compared with the reference; one that raises (a launch failure) is a
    failed output naming the error, one that is wrong fails its output, the others pass."""
    from dsa_train.gpucheck import correctness as C
    from dsa_train.gpucheck.core import Options

    real = TK.index_scores_triton
    forced, asked = [], []

    def space(q, k, scores, fp8, unmeasured=False, on_gpu=None):
        asked.append(unmeasured)
        return ["heads-rows", "keys-rows", *CONFIGS]

    def fake(q, k, w, ds, q0, q1, fp8=False, config=None, **kw):
        forced.append(config)
        if config == CONFIGS[0]:
            raise RuntimeError("unspecified launch failure")
        out, k0 = real(q, k, w, ds, q0, q1, fp8=fp8, config=None if config in CONFIGS else config, **kw)
        return (out + 1.0 if config == CONFIGS[1] else out), k0

    monkeypatch.setattr(TK, "score_space_for", space)
    monkeypatch.setattr(TK, "index_scores_triton", fake)
    outcome = C.index_scores_check(64, fp8=False)(Options(device="cpu", small=True))
    res = outcome.metrics["outputs"]
    assert True in asked  # the forced configs: the space with or without the opt-in
    assert forced == [None, "keys-rows", *CONFIGS] * 2  # the autotuned call, then each config; 2 blocks
    assert outcome.status == "fail"
    assert res["last_keys-rows"]["ok"] and res["doc_keys-rows"]["ok"]
    assert not res[f"last_{CONFIGS[0]}"]["ok"] and "launch failure" in res[f"last_{CONFIGS[0]}"]["note"]
    assert not res[f"doc_{CONFIGS[1]}"]["ok"]


@pytest.mark.integration  # the benchmark measures in a child process
def test_benchmark_smoke_run_on_the_cpu(tmp_path):
    """`--small` under the interpreter: the Triton configs' rows (block, bf16 block, the whole causal
    pass) with their errors against the default and the reference; the Gluon configs reported as not
    run (they run only compiled on an sm_90 GPU)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gluon_index_scores.py"
    out = tmp_path / "r.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(path), str(out), "--small"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert result["status"] == "ok" and rows[0]["kind"] == "env"
    blocks = {r["config"]: r for r in rows if r["kind"] == "block"}
    assert set(blocks) == {n for n, _ in TK.score_config_space(90)}
    assert blocks["heads-rows"]["ref_err"] < 1e-5 and blocks["keys-rows"]["verify_pass"]
    assert all("not run" in blocks[n]["note"] for n in CONFIGS)
    assert {r["config"] for r in rows if r["kind"] == "full"} == {"heads-rows", "keys-rows"}
