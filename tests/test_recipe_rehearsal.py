"""A rehearsal of every shipped recipe on its own parallel layout, on this CPU.

Each top-level recipe under `recipes/` (any recipe added later included: the list is read from
disk) is composed as a user would launch it, then shrunk by `rehearsal_overrides`, a function of
the composed recipe only:
  * kept: its stages and their options (attention, trainable set, loss coefficients, MTP, recall
    probes, router bias rate, top-k relative to the sequence), its ZeRO stage and recompute mode,
    its model dtype;
  * shrunk: the model to a tiny one of the same architecture (random init instead of a
    checkpoint), the data to the bundled corpus and short sequences, every stage to 1 step of one
    sequence per data-parallel rank, and every parallel degree above 1 to 2 (the 671B sparse
    layout CP 32 x EP 256 x DP 32 becomes a 4-rank CP 2 x EP 2 x DP 2 run). A one-process recipe
    (demo, small_32k) runs on the largest shipped layout's shrunk degrees instead: one process is
    what the single-process tests run, and users scale these recipes up with `parallel.*`.
It then runs end to end through `dsa-train launch torchrun` (gloo), and the run must finish with
its export and every stage's probes in the summary.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from dsa_train.config.recipes import compose_recipe, recipes_dir
from tests.helpers import free_port

# the shrunk model: the tiny V3.2 shape (MoE + shared expert, MLA with q-LoRA, indexer, MTP), smaller
TINY_ARCH = {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_attention_heads": 4,
             "n_routed_experts": 4, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2,
             "index_n_heads": 4, "index_head_dim": 32}
SEQ_LEN = 64  # a multiple of 2 * CP (= 4) and well above the shrunk top-k
STEPS = 1


def shipped_recipes() -> list[str]:
    """Every top-level recipe on disk (a YAML with stages; base.yaml has none)."""
    names = []
    for path in sorted(recipes_dir().glob("*.yaml")):
        if "stage@stages" in path.read_text() or "\nstages:" in path.read_text():
            names.append(path.stem)
    return names


def _shrink_degree(n: int) -> int:
    return 1 if n <= 1 else 2


def _shrunk_layout(par) -> tuple[int, int, int, int]:
    """(tp, cp, ep, dp): every degree above 1 -> 2; data parallel widened if EP needs it."""
    tp, cp, ep = (_shrink_degree(int(par[k])) for k in ("tensor_parallel", "context_parallel", "expert_parallel"))
    dp = _shrink_degree(int(par.data_parallel)) if int(par.data_parallel) != -1 else 2
    while (cp * dp) % ep:  # expert parallelism spans CP x DP ranks
        dp *= 2
    return tp, cp, ep, dp


def largest_shipped_layout() -> tuple[int, int, int, int]:
    """The shipped parallel group (recipes/parallel/*.yaml) with the most ranks once shrunk."""
    from omegaconf import OmegaConf

    layouts = [_shrunk_layout(OmegaConf.load(p)) for p in sorted((recipes_dir() / "parallel").glob("*.yaml"))]
    return max(layouts, key=lambda t: (t[0] * t[1] * t[3], sum(d > 1 for d in t)))


def rehearsal_overrides(recipe: str) -> tuple[int, list[str]]:
    """(ranks, Hydra overrides) that shrink `recipe` as described in the module docstring. A
    recipe whose own layout is one process (demo, small_32k: covered by the single-process tests)
    runs its stages, ZeRO stage and recompute on the degrees of the largest shipped layout."""
    cfg = compose_recipe(recipe, ["model.pretrained=null"])  # a 671B recipe's ??? checkpoint path
    tp, cp, ep, dp = _shrunk_layout(cfg.parallel)
    if tp * cp * dp == 1:
        tp, cp, ep, dp = largest_shipped_layout()
    ranks = tp * cp * dp
    seq_len_recipe = int(cfg.data.seq_len)
    out = [
        "model=tiny", f"model.dtype={getattr(cfg.model.dtype, 'value', cfg.model.dtype)}", "model.pretrained=null",
        *[f"+model.arch.{k}={v}" for k, v in TINY_ARCH.items()],
        "data=bundled", f"data.seq_len={SEQ_LEN}", "data.micro_batch_size=1",
        f"parallel.tensor_parallel={tp}", f"parallel.context_parallel={cp}", f"parallel.expert_parallel={ep}",
        f"parallel.data_parallel={dp}", "device=cpu", "probe_batches=1",
        "logging.wandb_mode=disabled", "logging.progress_bar=false", "checkpoint.every_n_steps=0",
    ]
    for name, stage in cfg.stages.items():
        key = f"stages.{name}"
        out += [f"{key}.steps={STEPS}", f"{key}.global_batch_size={dp}",
                f"{key}.warmup_steps={min(int(stage.warmup_steps), 1)}"]
        topk = stage.topk
        if topk is not None:
            # the same fraction of the sequence, kept well below it (sparse must select)
            out.append(f"{key}.topk={min(max(8, SEQ_LEN * int(topk) // seq_len_recipe), SEQ_LEN // 4)}")
        elif stage.attention == "sparse":  # the model's index_topk would cover the short sequence
            out.append(f"{key}.topk={SEQ_LEN // 4}")
        if int(stage.topk_recall_queries):
            out.append(f"{key}.topk_recall_queries={min(int(stage.topk_recall_queries), 8)}")
    return ranks, out


RECIPES = shipped_recipes()


def test_every_shipped_recipe_is_rehearsed():
    assert {"demo", "small_32k", "v3.2_warmup", "v3.2_sparse"} <= set(RECIPES), RECIPES


@pytest.mark.parametrize("recipe", ["v3.2_sparse", "demo"])
def test_shrunk_to_cp2_ep2_on_four_ranks(recipe):
    ranks, overrides = rehearsal_overrides(recipe)
    assert ranks == 4
    for expected in ("parallel.context_parallel=2", "parallel.expert_parallel=2", "parallel.data_parallel=2"):
        assert expected in overrides


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.integration
def test_recipe_rehearsal(recipe, tmp_path):
    ranks, overrides = rehearsal_overrides(recipe)
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "dsa_train.cli", "launch", "torchrun", "--nproc-per-node", str(ranks),
           "--max-restarts", "0", "--master-port", str(free_port()), "--config-name", recipe, *overrides,
           f"run_dir={run_dir}"]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "DSA_TRAIN_BACKEND": "gloo"}
    start = time.perf_counter()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    elapsed = time.perf_counter() - start
    logs = out.stdout[-4000:] + out.stderr[-6000:]
    print(f"rehearsal {recipe}: {ranks} ranks, {elapsed:.1f} s")
    assert out.returncode == 0, logs
    assert (run_dir / "export" / "model.safetensors").is_file(), logs
    summary_files = sorted((run_dir / "checkpoints").glob("step_*/trainer_state.json"))
    stages = list(compose_recipe(recipe, ["model.pretrained=null"]).stages)
    assert summary_files, logs
    summary = json.loads(summary_files[-1].read_text())["summary"]
    evaluated = bool(compose_recipe(recipe, ["model.pretrained=null"]).eval.enabled)
    for name in stages:  # every stage ran and was probed at its start and end (and evaluated with the eval group)
        assert set(summary.get(name, {})) == {"start", "end", *(["eval"] if evaluated else [])}, (name, summary, logs)
        for when in ("start", "end", *(["eval"] if evaluated else [])):
            assert all(v == v for v in summary[name][when].values()), summary  # no NaN
