"""The analytic plan's kernel working-set term (`dsa_train.plan.kernel_workspace`): on a CUDA recipe
the largest transient working set of the CUDA path's kernel launchers, from their own `workspace`
functions at the rank's shapes; on a CPU recipe the reference kernels' chunk blocks, as before.

The per-op figures are checked against `dsa-train plan --trace` (`trace_step` on the CUDA path,
which offers every launcher's workspace at the shapes the model's real call produces): the same ops,
the same bytes, at small shapes, for the three paths the demo's stages take (dense pre-training,
the frozen dense warm-up, sparse training) under DP, CP 2 and TP 2. Unit tier: ~10 s in all here."""

import json

import pytest

from dsa_train.plan.estimate import GiB, KERNEL_CHUNK_ELEMS, main as plan_main


def _demo(overrides):
    from omegaconf import OmegaConf

    from dsa_train.config import compose_recipe

    composed = compose_recipe("demo", ["model.dtype=bfloat16", "data.seq_len=64", "data.micro_batch_size=1",
                                       *overrides])
    return OmegaConf.to_object(composed)


# the pre-training stage with the indexer's KL on (the dense KL / the sparse KL over visible keys) under
# DP and CP, off (the demo's) under TP
@pytest.mark.parametrize("layout", [["parallel.data_parallel=-1", "stages.pretrain.indexer_loss_coef=0.1"],
                                    ["parallel.context_parallel=2", "stages.pretrain.indexer_loss_coef=0.1"],
                                    ["parallel.tensor_parallel=2"]])
def test_kernel_workspace_equals_the_traced_workspaces(layout, monkeypatch):
    """Per stage: the ops `kernel_workspace` dispatches are the ones the traced step dispatches, and
    each op's working set is the largest one the trace measured for it, byte for byte."""
    from dsa_train.config import resolve_sizes
    from dsa_train.plan import trace as T
    from dsa_train.plan.estimate import model_config_of
    from dsa_train.plan.kernel_workspace import kernel_workspace
    from dsa_train.stage import Stage

    traced: dict[str, int] = {}
    chunk_workspace = T.MemoryTrace.chunk_workspace

    def recording(self, key, run):
        chunk_workspace(self, key, run)
        if type(self) is T.MemoryTrace:  # the trace's own counter (not kernel_workspace's subclass)
            traced[key[0]] = max(traced.get(key[0], 0), self._workspace_cache[key])

    monkeypatch.setattr(T.MemoryTrace, "chunk_workspace", recording)
    cfg = _demo(layout)
    c, _ = model_config_of(cfg)
    sizes = resolve_sizes(cfg.parallel, 2)
    for name in ("pretrain", "warmup", "sparse"):
        traced.clear()
        t = T.trace_step(cfg, c, world=2, stage_name=name, kernels="cuda")
        ws = kernel_workspace(c, Stage.of(name, cfg.stages[name]), sizes, cfg.data.seq_len, cfg.data.micro_batch_size)
        assert set(ws["ops"]) == set(t["kernel_ops"]), (name, ws["ops"], t["kernel_ops"])
        assert {op: n for op, n in ws["ops"].items() if n} == traced, (name, ws["ops"], traced)
        assert ws["bytes"] == max(traced.values()) > 0 and traced[ws["op"]] == ws["bytes"], (name, ws, traced)


def test_topk_working_set_is_its_score_block_and_select_buffers():
    """The sparse stage's top-k term at small shapes equals its launcher's working set written out:
    the [B, C, T] fp32 score block (C = the driver's score budget over B x T), the radix select's
    candidates (int32 + fp32) and its prefilled selection (int32 + fp32) and sort order (int64)."""
    from dsa_kernels.ops.indexer_topk.kernel import CANDIDATE_CAP, DEFAULT_SCORE_BUDGET

    from dsa_train.config import resolve_sizes
    from dsa_train.plan.estimate import model_config_of
    from dsa_train.plan.kernel_workspace import kernel_workspace
    from dsa_train.stage import Stage

    cfg = _demo(["parallel.context_parallel=2"])
    c, _ = model_config_of(cfg)
    stage = Stage.of("sparse", cfg.stages["sparse"])
    B, T, k = 1, cfg.data.seq_len, stage.topk_for(c)
    ws = kernel_workspace(c, stage, resolve_sizes(cfg.parallel, 2), T, B)
    C = min(T // 2, DEFAULT_SCORE_BUDGET // (B * T))  # T / CP local queries, all in one chunk here
    assert ws["ops"]["dsa_kernels::indexer_topk"] == 4 * B * C * T + 8 * B * C * CANDIDATE_CAP + 16 * B * C * k


def _plan(args, capsys):
    plan_main([*args, "--json"])
    return json.loads(capsys.readouterr().out)["stages"][0]


def test_cuda_recipe_counts_the_topk_score_block_cpu_recipe_the_reference_chunks(capsys):
    """v3.2_sparse on its CUDA path: the kernel term is the largest CUDA working set (the top-k's
    2^26-element fp32 score block is one, 256 MiB: the old term, 3 x 2^24 fp32 = 192 MiB, was
    smaller); the same recipe on `device=cpu` counts the PyTorch path's (its reference kernels'
    query chunks, each block within 2^24 fp32 elements), and the two plans' DSA
    buffers differ by exactly the two terms' difference."""
    from dsa_kernels.ops.indexer_topk.kernel import DEFAULT_SCORE_BUDGET

    from dsa_train.plan.kernel_workspace import CPU_PATH_OP

    cuda = _plan(["--config-name", "v3.2_sparse"], capsys)
    cpu = _plan(["--config-name", "v3.2_sparse", "device=cpu"], capsys)
    ws, ref = cuda["kernel_workspace"], cpu["kernel_workspace"]
    assert ws["path"] == "cuda" and ref["path"] == "cpu"
    assert ws["ops"]["dsa_kernels::indexer_topk"] >= 4 * DEFAULT_SCORE_BUDGET, ws
    assert ws["bytes"] == max(ws["ops"].values()) >= 4 * DEFAULT_SCORE_BUDGET > 4 * KERNEL_CHUNK_ELEMS * 3
    assert {"dsa_kernels::sparse_mla_bwd", "dsa_kernels::indexer_topk"} <= set(ws["ops"])
    # the PyTorch path's chunk loops at these shapes (the largest: the sparse MLA backward's)
    assert ref["bytes"] == ref["ops"][CPU_PATH_OP] >= ref["ops"]["dsa_kernels::sparse_mla_chunked_bwd"] > 0, ref
    diff = cuda["gib"]["dsa_buffers"] - cpu["gib"]["dsa_buffers"]
    assert diff == pytest.approx((ws["bytes"] - ref["bytes"]) / GiB, rel=1e-9), (cuda["gib"], cpu["gib"])


def test_overlap_switch_adds_a_second_score_block(capsys, monkeypatch):
    """`DSA_INDEXER_OVERLAP=1` (the top-k's opt-in pipeline) keeps two score blocks alive: the plan's
    top-k figure follows the launcher's workspace (2^26 fp32 elements more at v3.2_sparse's shapes,
    where the local queries take several chunks)."""
    from dsa_kernels.ops.indexer_topk.kernel import DEFAULT_SCORE_BUDGET
    from dsa_kernels.ops.indexer_topk.pipeline import OVERLAP_ENV

    monkeypatch.setenv(OVERLAP_ENV, "0")
    off = _plan(["--config-name", "v3.2_sparse"], capsys)["kernel_workspace"]["ops"]["dsa_kernels::indexer_topk"]
    monkeypatch.setenv(OVERLAP_ENV, "1")
    on = _plan(["--config-name", "v3.2_sparse"], capsys)["kernel_workspace"]
    assert on["ops"]["dsa_kernels::indexer_topk"] - off == 4 * DEFAULT_SCORE_BUDGET
    assert on["op"] == "dsa_kernels::indexer_topk" and on["bytes"] == off + 4 * DEFAULT_SCORE_BUDGET
