"""A resumed run's checkpoints hold the same optimizer state as the uninterrupted run's: no AdamW
state appears at load time for parameters that never get a gradient (the MTP layer of a stage
without the MTP loss). It used to: the resume made zeros for every trainable parameter to load into,
and every later checkpoint wrote them (+47% on the demo model; docs/reliability.md)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dsa_train.checkpoint.sharded_state import optimizer_pieces
from dsa_train.config import Attention, OptimConfig, StageConfig, Trainable
from dsa_train.model import DSAForCausalLM, tiny_config
from dsa_train.stage import Stage
from dsa_train.trainer import Engine
from tests.reliability_helpers import TINY

SPARSE = StageConfig(attention=Attention.sparse, trainable=Trainable.all, lm_loss_coef=1.0, indexer_loss_coef=1.0,
                     lr=1e-3, steps=4, topk=8)


def _stepped_engine():
    """An engine after one step in which the MTP layer had no gradient (as with mtp_loss_coef = 0)."""
    torch.manual_seed(0)
    model = DSAForCausalLM(tiny_config(vocab_size=64))
    engine = Engine(model, Stage.of("sparse", SPARSE), OptimConfig())
    mtp = {id(p) for layer in model.mtp_layers() for p in layer.parameters()}
    assert mtp, "the tiny model has an MTP layer"
    for _, p in engine.trainable:
        p.grad = None if id(p) in mtp else torch.ones_like(p)
    engine.step()
    return model, engine, mtp


def test_loading_makes_state_only_where_the_checkpoint_has_some():
    model, engine, mtp = _stepped_engine()
    saved = set(optimizer_pieces(engine))  # what a checkpoint of this engine holds
    assert saved and not any(".layers.2." in k for k in saved if "exp_avg" in k)  # no moments for the MTP layer
    resumed = Engine(model, Stage.of("sparse", SPARSE), OptimConfig())  # the resumed run's engine
    pieces = {k: v for k, v in optimizer_pieces(resumed, create=saved).items() if k in saved}
    assert set(pieces) == saved
    with_state = {id(p) for _, p in resumed.optimized if resumed.optimizer.state[p]}
    assert with_state == {id(p) for _, p in resumed.optimized if id(p) not in mtp}
    assert set(optimizer_pieces(resumed)) == saved  # its next checkpoint: the same keys
    # the old call made state for every trainable parameter, the MTP layer's included
    old = Engine(model, Stage.of("sparse", SPARSE), OptimConfig())
    assert set(optimizer_pieces(old, create=True)) > saved


DRIVER = Path(__file__).with_name("reliability_driver.py")
REPO = Path(__file__).resolve().parents[1]
# reliability_helpers.TINY (the demo recipe, two tiny stages, a checkpoint after every step) with 3 sparse
# steps: warm-up global steps 1-2, sparse 3-5; the sparse stage's checkpoints 3 and 4 hold optimizer
# state (a stage's last one does not)
OVERRIDES = [o for o in TINY if not o.startswith("stages.sparse.steps=")] + [
    "stages.sparse.steps=3", "deterministic=true", "checkpoint.keep_last=4"]


def _run(run_dir: Path, fault: str | None = None) -> int:
    env = {k: v for k, v in os.environ.items() if k not in ("DSA_FAULT", "RANK", "TORCHELASTIC_RESTART_COUNT")}
    if fault:
        env["DSA_FAULT"] = fault
    out = run_dir.parent / f"{run_dir.name}-{time.monotonic_ns()}.json"
    proc = subprocess.run([sys.executable, str(DRIVER), str(out), "demo", f"run_dir={run_dir}", *OVERRIDES],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stderr[-3000:]


def _files(ckpt: Path) -> dict[str, int]:
    return {str(p.relative_to(ckpt)): p.stat().st_size for p in ckpt.rglob("*") if p.is_file()}


@pytest.mark.integration
def test_a_resumed_runs_checkpoint_equals_the_uninterrupted_runs(tmp_path):
    """SIGTERM during global step 3 (checkpoint of step 3, exit 75), resume: the checkpoint of step 4
    has the uninterrupted run's keys, size and values (deterministic mode)."""
    from dsa_train.checkpoint.training import read_tensors

    code, err = _run(tmp_path / "ref")
    assert code == 0, err
    code, err = _run(tmp_path / "cut", "step=3,kind=sigterm")
    assert code == 75, err
    code, err = _run(tmp_path / "cut")
    assert code == 0, err
    ref, cut = (tmp_path / name / "checkpoints" / "step_00000004" for name in ("ref", "cut"))
    a, b = read_tensors(ref, prefix=""), read_tensors(cut, prefix="")
    assert sorted(b) == sorted(a), sorted(set(b) ^ set(a))[:8]
    assert any(k.startswith("optim/exp_avg/") for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    sizes = {name: sum(_files(c).values()) for name, c in (("ref", ref), ("cut", cut))}
    assert sizes["cut"] == sizes["ref"], sizes
