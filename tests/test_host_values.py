"""The kernels' host planning reads each index tensor once, not once per layer
(dsa_kernels/host_values.py): the indexer's key windows and query positions, the library
attention's packed documents (cu_seqlens, the longest document, the context-parallel run's first
document). The values equal the per-call reads they replace; a second call with the same tensor
reads nothing; a tensor changed in place is read again; the memo goes with the tensor."""

import gc
import os

import numpy as np
import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")

from dsa_kernels import doc_starts_from_position_ids, indexer_topk_ref  # noqa: E402
from dsa_kernels import host_values as HV  # noqa: E402
from dsa_kernels.ops.dense_attention import library  # noqa: E402
from dsa_kernels.ops.indexer_topk.kernel import indexer_topk_triton  # noqa: E402
from dsa_train.trainer.op_counts import StepCounts  # noqa: E402


def _docs(rows):
    return doc_starts_from_position_ids(torch.stack([torch.cat([torch.arange(n) for n in r]) for r in rows]))


def _segments_by_reading(doc_start, a, C):
    """The per-call form these replace: nonzero and max read from the device every call."""
    B = doc_start.shape[0]
    ds = (doc_start[:, a:a + C] - a).clamp_min(0)
    starts = (ds == torch.arange(C)).flatten().nonzero().flatten()
    cu = torch.cat([starts, starts.new_full((1,), B * C)]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


@pytest.mark.parametrize("rows", [[[16]], [[4, 9, 3], [2, 14]], [[1] * 5 + [11], [7, 1, 8]], [[3, 13], [13, 3]]])
def test_doc_segments_equal_the_per_call_reads(rows):
    ds = _docs(rows)
    T = ds.shape[1]
    for a, C in [(0, T), (0, 5), (3, 9), (T - 1, 1), (7, T - 7)]:
        cu, max_len = library.doc_segments(ds, a, C)
        want_cu, want_max = _segments_by_reading(ds, a, C)
        assert cu.dtype == torch.int32 and torch.equal(cu, want_cu) and max_len == want_max, (a, C)
        first = ds[:, a]
        want_rows = list(zip(first.tolist(), (ds[:, a:a + C] == first[:, None]).sum(1).tolist()))
        assert library.first_document_rows(ds, a, C) == want_rows
    assert library.doc_segments(ds)[1] == _segments_by_reading(ds, 0, T)[1]


def test_the_library_attention_reads_doc_start_once_for_every_layer_and_run(monkeypatch):
    """The warm-up's attention on CUDA (the library op replaced by a CPU stand-in of its contract,
    as in test_dense_attention_library): a first call reads doc_start once; the same doc_start in
    later calls -- the other layers, the other context-parallel runs -- reads nothing and asks for
    no data-dependent operator (`nonzero`)."""
    from tests.test_dense_attention_library import _efficient_contract, _mla

    monkeypatch.setattr(library, "_efficient", lambda *a: _efficient_contract("packed")(*a))
    monkeypatch.setattr(library, "backend_for", lambda q: "efficient")
    ds = _docs([[4, 9, 3], [2, 14]])
    q, latent, k_rope, w_kv, nope = _mla(2, 16, 2, seed=1)
    k, v = library._up_project(latent, k_rope, w_kv, 2, nope)
    counts = []
    for _ in range(3):  # three "layers"
        with StepCounts() as c:
            library._library_or_triton(q, k, v, 0.3, ds)
            for a, C in [(0, 8), (8, 8), (10, 4)]:
                library._rows_efficient(q[:, a:a + C], latent, k_rope, w_kv, 0.3, ds, a, nope, 3)
        counts.append(c)
    ours = [_kernel_reads(c) for c in counts]  # the stand-in's own reads (a CPU loop) left out
    assert ours[0] == {"host_values.py": 2}  # one device-to-host copy (.cpu(), then .numpy() of the copy)
    assert ours[1:] == [{}, {}]
    assert counts[0].ops["aten.nonzero"] == 0 and counts[0].ops["aten.nonzero_static"] == 4  # 1 + 3 runs
    assert all(c.ops["aten.nonzero_static"] == 0 and c.ops["aten.nonzero"] == 0 for c in counts[1:])


def _kernel_reads(counts):
    return {f.rsplit("/", 1)[-1]: n for f, n in counts.read_files.items() if "/dsa_kernels/" in f}


def test_the_indexer_reads_doc_start_and_positions_once_per_tensor():
    """indexer_topk_triton with the forward's doc_start and context-parallel positions: the first
    call reads each once, the next (another layer) nothing; the result equals the reference."""
    g = torch.Generator().manual_seed(0)
    B, T, H, D, topk = 2, 24, 2, 16, 4
    ds = _docs([[10, 14], [24]])
    positions = torch.tensor([2, 3, 4, 5, 18, 19, 20, 21])  # a CP rank's two chunks
    q = torch.randn(B, positions.shape[0], H, D, generator=g)
    k, w = torch.randn(B, T, D, generator=g), torch.randn(B, positions.shape[0], H, generator=g)
    got = []
    for layer in range(2):
        with StepCounts() as c:
            idx, _ = indexer_topk_triton(q, k, w, ds, topk, chunk_size=3, query_positions=positions, select="radix")
        got.append((c, idx))
    assert dict(got[0][0].reads) == {"cpu": 2, "numpy": 2}  # doc_start and the positions, one copy each
    assert got[1][0].host_reads == 0 and torch.equal(got[0][1], got[1][1])
    q_full = torch.zeros(B, T, H, D)
    q_full[:, positions] = q
    w_full = torch.zeros(B, T, H)
    w_full[:, positions] = w
    ref_idx, _ = indexer_topk_ref(q_full, k, w_full, ds, topk)
    assert torch.equal(got[0][1].long(), ref_idx[:, positions].long())


def test_a_tensor_changed_in_place_is_read_again_and_the_memo_goes_with_it():
    ds = _docs([[8, 8]])
    assert library.doc_segments(ds)[1] == 8
    ds.copy_(_docs([[3, 13]]))  # the same tensor, new values: its version moved
    cu, max_len = library.doc_segments(ds)
    assert max_len == 13 and cu.tolist() == [0, 3, 16]
    n = len(HV._MEMO)
    del ds, cu
    gc.collect()
    assert len(HV._MEMO) == n - 1


def test_an_inference_mode_tensor_is_read_at_every_call():
    """No version counter under inference mode: no memo (an in-place change there is still seen)."""
    with torch.inference_mode():
        ds = _docs([[8, 8]])
        with StepCounts() as c:
            assert library.doc_segments(ds)[1] == 8
            ds.copy_(_docs([[3, 13]]))
            assert library.doc_segments(ds)[1] == 13
    assert _kernel_reads(c) == {"host_values.py": 8}  # 2 copies a call (the count, then cu_seqlens), each .cpu + .numpy
    assert ds not in HV._MEMO


def test_host_values_refuse_a_tensor_without_values():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.zeros(2, 4, dtype=torch.int64)
    with pytest.raises(Exception):
        HV.host_values(fake)
    with pytest.raises(Exception):
        HV.host_values(torch.zeros(2, 4, dtype=torch.int64, device="meta"))
    assert isinstance(HV.host_values(torch.arange(3)), np.ndarray)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_next_layer_makes_no_host_sync():
    """On a GPU the first call of a forward reads doc_start (one sync); the next layers' calls --
    the indexer (radix select) and the warm-up's library attention, whole and as CP runs -- make
    none (CUDA's sync debug mode raises on a sync)."""
    g = torch.Generator().manual_seed(0)
    B, T, H, D, topk = 1, 256, 2, 64, 16
    dev = "cuda"
    ds = _docs([[100, 156]]).to(dev)
    q = torch.randn(B, T, H, D, generator=g).to(dev, torch.bfloat16)
    k = torch.randn(B, T, D, generator=g).to(dev, torch.bfloat16)
    w = torch.randn(B, T, H, generator=g).to(dev)
    qa, ka, va = (torch.randn(B, T, 4, d, generator=g).to(dev, torch.bfloat16) for d in (192, 192, 128))

    def layer():
        idx, _ = indexer_topk_triton(q, k, w, ds, topk, select="radix")
        out, lse = library._library_or_triton(qa, ka, va, 0.1, ds)
        cu, _ = library.doc_segments(ds, 128, 128)
        return idx, out, cu

    first = layer()  # compiles, reads doc_start
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        second = layer()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert library.LAST_BACKEND[0] == "efficient"
