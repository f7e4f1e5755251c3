"""The index-score kernel's autotuning space (`kernel.SCORE_CONFIG_SPACE`): every config against the
PyTorch reference (bf16-representable inputs, so every path computes the same products; packed
documents, odd sizes, a CP rank's positions, FP8 and a bf16 score block), and the driver's
verify-then-time choice driven as on a GPU. Triton interpreter on the CPU, tiny shapes."""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dsa_kernels import doc_starts_from_position_ids  # noqa: E402
from dsa_kernels.ops.indexer_topk import index_scores_fp8_block, index_scores_ref, quantize_fp8_groups  # noqa: E402
from dsa_kernels.ops.indexer_topk import kernel as TK  # noqa: E402

DEV = "cuda" if HAS_CUDA else "cpu"
CONFIGS = [name for name, _ in TK.SCORE_CONFIG_SPACE]


def grid_values(shape, seed, denom=8):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-2 * denom, 2 * denom + 1, shape, generator=g).float() / denom).to(DEV)


def inputs(B=1, T=45, H=3, D=24):
    q, k, w = grid_values((B, T, H, D), 1), grid_values((B, T, D), 2), grid_values((B, T, H), 3)
    pos_ids = torch.cat([torch.arange(n) for n in (19, 7, 19)])[None].expand(B, -1)
    return q, k, w, doc_starts_from_position_ids(pos_ids).to(DEV)


@pytest.mark.parametrize("config", CONFIGS)
def test_score_configs_equal_the_reference(config):
    q, k, w, ds = inputs()
    T = q.shape[1]
    pos = torch.arange(T, device=DEV, dtype=torch.int32)
    for q0, q1 in ((0, 45), (20, 33)):  # the whole row; a chunk with a key window starting at a document
        ref, k0 = index_scores_ref(q, k, w, ds, q0, q1)
        got = TK._score_chunk(q, k, w, ds, pos, q0, q1, k0, q1, config=config)
        assert torch.equal(got.cpu(), ref.cpu()), (config, q0)  # grid inputs: exact in fp32
        got16 = TK._score_chunk(q, k, w, ds, pos, q0, q1, k0, q1, score_dtype=torch.bfloat16, config=config)
        assert torch.equal(got16.float().cpu(), ref.bfloat16().float().cpu()), (config, q0)


@pytest.mark.parametrize("config", CONFIGS)
def test_score_configs_fp8_and_context_parallel_positions(config):
    from dsa_train.parallel.context import local_positions

    q, k, w, ds = inputs(T=64, H=2, D=16)
    p = local_positions(64, 2, 1, device=DEV)  # a CP rank's zigzag chunks
    qp, wp = q[:, p].contiguous(), w[:, p].contiguous()
    q8, qs = quantize_fp8_groups(qp)
    k8, ks = quantize_fp8_groups(k)
    pos = p.to(torch.int32)
    r0, r1 = 3, 29  # local rows
    k0 = int(ds[0, p[r0:r1]].min())
    k1 = int(p[r0:r1].max()) + 1
    got = TK._score_chunk(q8, k8, wp, ds, pos, r0, r1, k0, k1, qs, ks, config=config)
    want = index_scores_fp8_block(q8[:, r0:r1], qs[:, r0:r1], k8[:, k0:k1], ks[:, k0:k1], wp[:, r0:r1])
    s = torch.arange(k0, k1, device=DEV)
    valid = (s[None, None, :] <= p[r0:r1, None][None]) & (s[None, None, :] >= ds[:, p[r0:r1], None])
    want = want.masked_fill(~valid, float("-inf"))
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    fin = torch.isfinite(want)
    assert torch.allclose(got[fin], want[fin], rtol=1e-6, atol=1e-6), config


def test_score_autotuning_as_on_a_gpu(monkeypatch, tmp_path):
    """`_score_chunk` driven as on a GPU: the other config verified against the default, both timed
    into the real block, the faster (by a fake clock) kept; a config that disagrees is left out."""
    from dsa_kernels import autotune

    monkeypatch.setenv("DSA_AUTOTUNE_CACHE", str(tmp_path / "autotune.json"))
    monkeypatch.setattr(autotune, "_MEMORY", {})
    timed = []
    real_pick = autotune.pick

    def pick_as_on_a_gpu(kernel, key, names, build, on_gpu, device_id="", bench=None, verify=None):
        def fake_bench(launch):
            launch.run()
            timed.append(bool(launch.args["KEYS_MAJOR"]))
            return 1.0 if launch.args["KEYS_MAJOR"] else 2.0

        return real_pick(kernel, key, names, build, True, "test GPU", fake_bench, verify)

    monkeypatch.setattr(TK.autotune, "pick", pick_as_on_a_gpu)
    q, k, w, ds = inputs()
    pos = torch.arange(45, device=DEV, dtype=torch.int32)
    ref, k0 = index_scores_ref(q, k, w, ds, 0, 45)
    got = TK._score_chunk(q, k, w, ds, pos, 0, 45, k0, 45)
    assert torch.equal(got.cpu(), ref.cpu()) and sorted(timed) == [False, True]
    assert list(autotune.choices("indexer_scores").values()) == ["keys-rows"]
