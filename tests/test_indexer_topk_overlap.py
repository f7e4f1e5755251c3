"""The indexer top-k driver's chunk pipeline (dsa_kernels/ops/indexer_topk/pipeline.py): chunk i's
select on a side stream while chunk i + 1's scores run on the caller's stream. The same code runs on
the CPU (torch's CPU streams do nothing): outputs bitwise equal with the overlap on and off and to
the reference on every select path; the schedule (which stream, which event, how many score blocks
alive) checked with recording streams; the call's host reads and launches do not grow per chunk."""

import os
import weakref
from contextlib import contextmanager

import numpy as np
import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dsa_kernels import doc_starts_from_position_ids, indexer_topk_ref  # noqa: E402
from dsa_kernels.ops.indexer_topk import index_scores_ref, indexer_topk_at_positions_ref, topk_from_scores  # noqa: E402
from dsa_kernels.ops.indexer_topk import pipeline as P  # noqa: E402
from dsa_kernels.ops.indexer_topk.kernel import indexer_topk_triton  # noqa: E402

DEV = "cuda" if HAS_CUDA else "cpu"


def _grid(shape, seed, lo=-2, hi=2, denom=4):
    """Coarse-grid values: every score exact in fp32, so ties are real and selections exact."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(lo * denom, hi * denom + 1, shape, generator=g).float() / denom).to(DEV)


def _docs(rows):
    return doc_starts_from_position_ids(torch.stack([torch.cat([torch.arange(n) for n in r]) for r in rows])).to(DEV)


def _on_off(**kw):
    on = indexer_topk_triton(**kw, overlap=True)
    off = indexer_topk_triton(**kw, overlap=False)
    assert torch.equal(on[0], off[0]) and torch.equal(on[1], off[1])
    return on


@pytest.mark.parametrize("select", ["radix", "composite", "fix-ties", "repair", "repair-count", None])
def test_overlap_on_off_bitwise_and_exact_on_every_select_path(select):
    # B = 2 (the outputs' row slices are strided), odd T / H / D, packed documents, rows with fewer
    # than k keys, 5 chunks (the last one short)
    B, T, H, D, topk = 2, 37, 3, 20, 6
    q, k, w = _grid((B, T, H, D), 1), _grid((B, T, D), 2), _grid((B, T, H), 3)
    ds = _docs([[15, 4, 18], [37]])
    idx, val = _on_off(q=q, k=k, w=w, doc_start=ds, topk=topk, chunk_size=8, select=select)
    ridx, rval = indexer_topk_ref(q, k, w, ds, topk)
    assert torch.equal(idx, ridx) and torch.equal(val, rval)


def test_overlap_on_off_bitwise_cp_positions_and_bf16_block():
    # a CP rank's query positions (zigzag chunks) over the whole sequence, and a bf16 score block
    from dsa_train.parallel.context import local_positions

    B, T, H, D, topk = 1, 40, 2, 24, 5
    q, k, w = _grid((B, T, H, D), 4), _grid((B, T, D), 5), _grid((B, T, H), 6)
    ds = _docs([[23, 17]])
    p = local_positions(T, 2, 1, device=DEV)
    idx, val = _on_off(q=q[:, p], k=k, w=w[:, p], doc_start=ds, topk=topk, chunk_size=7, query_positions=p)
    ridx, rval = indexer_topk_at_positions_ref(q[:, p], k, w[:, p], ds, topk, p)
    assert torch.equal(idx, ridx) and torch.equal(val, rval)
    # a bf16 score block: the reference's top-k of the bf16-rounded scores (grid inputs: the fp32
    # scores are exact, so the rounding is the same)
    idx, val = _on_off(q=q, k=k, w=w, doc_start=ds, topk=topk, chunk_size=16, score_dtype=torch.bfloat16)
    ref, k0 = index_scores_ref(q, k, w, ds, 0, T)
    ridx, rval = topk_from_scores(ref.bfloat16().float(), topk, key_offset=k0)
    assert torch.equal(idx, ridx) and torch.equal(val, rval)


def test_env_switch_and_its_validation(monkeypatch):
    monkeypatch.delenv(P.OVERLAP_ENV, raising=False)  # off by default (unmeasured on a GPU)
    assert not P.overlap_enabled() and P.overlap_enabled(True) and P.live_score_blocks(16) == 1
    monkeypatch.setenv(P.OVERLAP_ENV, "1")
    assert P.overlap_enabled() and P.live_score_blocks(16) == 2 and P.live_score_blocks(1) == 1
    monkeypatch.setenv(P.OVERLAP_ENV, "0")
    assert not P.overlap_enabled() and P.overlap_enabled(True) and P.live_score_blocks(16) == 1
    monkeypatch.setenv(P.OVERLAP_ENV, "maybe")
    with pytest.raises(ValueError, match="DSA_INDEXER_OVERLAP must be 1"):
        P.overlap_enabled()


def test_chunk_windows_match_the_per_chunk_reads():
    g = torch.Generator().manual_seed(0)
    T = 50
    ds = torch.tensor([0] * 20 + [20] * 13 + [33] * 17)
    for pos in (torch.arange(T), torch.cat([torch.arange(10, 20), torch.arange(35, 45)]),
                torch.randperm(T, generator=g)[:17].sort().values):
        for chunk in (1, 6, 7, 64):
            want = []
            for r0 in range(0, pos.shape[0], chunk):
                p = pos[r0:r0 + chunk]
                want.append((r0, r0 + p.shape[0], int(ds[p].min()), int(p.max()) + 1))
            assert P.chunk_windows(pos.numpy(), ds[pos].to(torch.int32).numpy(), chunk) == want
    assert P.chunk_windows(np.arange(0), np.arange(0), 4) == []


class _Recorder:
    """A device module whose streams log what the pipeline asks of them."""

    def __init__(self):
        self.log, self.cur, self.n = [], None, 0
        self.main = _Stream(self, "main")
        self.cur = self.main

    def current_stream(self, device=None):
        return self.cur

    def Stream(self, device=None):  # noqa: N802 (torch's name)
        return _Stream(self, "side")

    @contextmanager
    def stream(self, s):
        saved, self.cur = self.cur, s
        try:
            yield
        finally:
            self.cur = saved


class _Stream:
    def __init__(self, rec, name):
        self.rec, self.name = rec, name

    def record_event(self):
        self.rec.n += 1
        ev = f"{self.name}#{self.rec.n}"
        self.rec.log.append(("record", self.name, ev))
        return ev

    def wait_event(self, ev):
        self.rec.log.append(("wait", self.name, ev))

    def wait_stream(self, other):
        self.rec.log.append(("wait_stream", self.name, other.name))


@pytest.mark.parametrize("overlap", [True, False])
def test_schedule_streams_events_and_live_blocks(monkeypatch, overlap):
    rec = _Recorder()
    monkeypatch.setattr(P.torch, "get_device_module", lambda device: rec)
    alive = weakref.WeakSet()
    most = []

    def score(win):
        block = torch.full((2,), float(win[0]))
        alive.add(block)
        most.append(len(alive))
        rec.log.append(("score", rec.cur.name, win[0]))
        return block

    def select(block, win):
        assert float(block[0]) == win[0]  # its own chunk's block
        rec.log.append(("select", rec.cur.name, win[0]))

    windows = [(r0, r0 + 4, 0, r0 + 4) for r0 in range(0, 20, 4)]
    P.run_chunks(windows, score, select, overlap, torch.device("cpu"))
    log = rec.log
    side = "side" if overlap else "main"
    assert [e[1] for e in log if e[0] == "score"] == ["main"] * 5
    assert [e[1:] for e in log if e[0] == "select"] == [(side, r0) for r0 in range(0, 20, 4)]
    for r0 in range(0, 20, 4):
        s, c = log.index(("score", "main", r0)), log.index(("select", side, r0))
        ev = log[s + 1]  # recorded on the main stream right after the chunk's scores
        assert ev[:2] == ("record", "main") and log[c - 1] == ("wait", side, ev[2])
        done = log[c + 1]  # recorded on the side stream right after the select
        assert done[:2] == ("record", side)
        # the block is released only after the main stream waits for its select: before the
        # scores two chunks on (one with the overlap off)
        nxt = r0 + (8 if overlap else 4)
        if nxt < 20:
            assert log.index(("wait", "main", done[2])) < log.index(("score", "main", nxt))
    if overlap:  # chunk i + 1's scores are issued before chunk i's select
        assert log.index(("score", "main", 4)) < log.index(("select", "side", 0))
    assert max(most) == (2 if overlap else 1)
    assert log[-1] == ("wait_stream", "main", side) and len(alive) == 0


def test_host_reads_and_launches_do_not_grow_per_chunk(monkeypatch):
    """One call reads the device once (the document starts' host copy, before the chunk loop; a
    later call with the same doc_start tensor reads nothing: `host_values`); per chunk it issues the
    score and select launches, the select's prefill, sort and gather only: no host read inside the
    loop, no concatenation of the chunks."""
    from collections import Counter

    from dsa_kernels._triton_common import Launch
    from dsa_train.trainer.op_counts import StepCounts, _kernels

    B, T, H, D, topk = 1, 24, 2, 16, 4
    q, k, w = _grid((B, T, H, D), 7), _grid((B, T, D), 8), _grid((B, T, H), 9)
    monkeypatch.setenv(P.OVERLAP_ENV, "1")
    monkeypatch.setenv("DSA_AUTOTUNE", "0")  # on a GPU: the default configs, nothing timed
    real_run = Launch.run
    got = {}
    for chunk in (24, 6):
        ds = _docs([[24]])  # a new tensor per call: its host copy is read in the call
        counts, launches = StepCounts(), []

        def run(self, counts=counts, launches=launches):  # the interpreter's own operators apart
            launches.append(self.kernel.fn.__name__)
            return counts.in_phase("launch", real_run)(self)

        monkeypatch.setattr(Launch, "run", run)
        with counts:
            indexer_topk_triton(q, k, w, ds, topk, chunk_size=chunk, select="radix")
        ops = Counter({n: c for n, c in counts.phase_ops["step"].items() if _kernels(Counter({n: c}))})
        got[chunk] = (ops, dict(counts.phase_reads["step"]), launches)
    (ops1, reads1, launches1), (ops4, reads4, launches4) = got[24], got[6]
    assert reads1 == reads4 and reads4 == {"cpu": 1, "numpy": 1}  # the one device read (a copy), before the loop
    S, R = "_index_scores_kernel", "_radix_topk_kernel"  # issued: chunk i + 1's scores before chunk i's select
    assert launches1 == [S, R] and launches4 == [S, S, R, S, R, S, R, R]
    per_chunk = ops4 - ops1
    assert per_chunk == Counter({"aten.full": 6, "aten.sort": 3, "aten.gather": 3}), per_chunk
    assert "aten.cat" not in ops4


def test_workspace_counts_the_second_score_block(monkeypatch):
    """The memory trace's stand-in (`custom._topk_workspace`): two [B, C, T] fp32 score blocks
    with the overlap on and several chunks, one otherwise."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from dsa_kernels.ops.indexer_topk.custom import _topk_workspace

    class Sizes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and "empty" in str(func.overloadpacket):
                self.shapes.append((tuple(out.shape), out.dtype))
            return out

    B, T, topk = 1, 64, 8
    q = torch.empty(B, T, 4, 16, device="meta")
    k = torch.empty(B, T, 16, device="meta")

    def blocks(chunk, overlap):
        monkeypatch.setenv(P.OVERLAP_ENV, overlap)
        with Sizes() as s:
            _topk_workspace(q, k, None, None, topk, chunk, None)
        return sum(1 for shape, dt in s.shapes if shape == (B, chunk or T, T) and dt == torch.float32)

    assert blocks(16, "1") == 2 and blocks(16, "0") == 1 and blocks(64, "1") == 1


def test_autotuner_quiets_the_device_before_timing(monkeypatch, tmp_path):
    from dsa_kernels import autotune

    monkeypatch.setenv("DSA_AUTOTUNE_CACHE", str(tmp_path / "autotune.json"))
    monkeypatch.setattr(autotune, "_MEMORY", {})
    log = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **kw: log.append("sync"))

    def bench(name):
        log.append(f"time {name}")
        return {"a": 2.0, "b": 1.0}[name]

    def verify(name):
        log.append(f"verify {name}")
        return True

    args = ("k", (1,), ["a", "b"], lambda n: n, True, "gpu", bench)
    assert autotune.pick(*args, verify=verify)[0] == "b"
    assert log == ["verify b", "sync", "time a", "time b"]
    assert autotune.pick(*args, verify=verify)[0] == "b" and len(log) == 4  # remembered: nothing timed
