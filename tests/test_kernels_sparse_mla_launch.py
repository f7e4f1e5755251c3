"""Sparse MLA's Triton path made safe for the first GPU run (issue 21): launch plans within CUDA's
grid limits at T = 128K, the backward's memory beyond its outputs, the index policy (out of range
= empty slot; DSA_KERNELS_CHECK=1 raises), the fp32 input policy, context-parallel shapes (fewer
queries than keys) and the deterministic backward's (token chunk, slot window) launches.

Kernels run under the Triton interpreter on the CPU at tiny shapes (H = 4, D = 32 + 16, T <= 24);
plans and memory are measured on the meta device with the launches not executed."""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dsa_kernels._triton_common as common  # noqa: E402
from dsa_kernels._triton_common import planning_for  # noqa: E402
import dsa_kernels.ops.sparse_mla.kernel as smk  # noqa: E402
from dsa_kernels import sparse_mla_ref  # noqa: E402
from dsa_kernels.ops.sparse_mla import specs  # noqa: E402
from dsa_kernels.ops.sparse_mla.function import SparseMLAFunction, kernel_inputs, sparse_mla_triton  # noqa: E402

DEV = "cuda" if HAS_CUDA else "cpu"
GRID_X, GRID_YZ = 2**31 - 1, 65535


def within_cuda_grid(grid) -> bool:
    grid = tuple(grid) + (1,) * (3 - len(grid))
    return 1 <= grid[0] <= GRID_X and 1 <= grid[1] <= GRID_YZ and 1 <= grid[2] <= GRID_YZ


# ----------------------------------------------------------------------------- launch plans
def test_T131072_plans_within_cuda_grid_limits():
    """Forward, backward and the deterministic backward at T = 131072 (the 671B shapes, meta
    tensors): tokens are on grid x, so nothing reaches y / z's 65,535."""
    fwd = specs._fwd()[0].launch
    with planning_for(90):  # Hopper: the backward's space holds the interleaved kernel too
        launches = specs.bwd_launches()  # the default, the space's other configs, the deterministic one
    (_, bwd), (_, interleaved), (_, det) = launches[0], launches[1], launches[-1]
    gluon = [launch for label, launch in launches if "gluon" in label]  # the Gluon backward (issue 31)
    assert fwd.args["Q"].shape[1] == 131072 and bwd.args["Q"].shape[1] == 131072
    for launch in (fwd, bwd, interleaved, det, *gluon):
        assert within_cuda_grid(launch.grid), launch.grid
    assert gluon and all(launch.grid == (2 * 131072, 1) for launch in gluon)  # 2 head blocks of 64 per token
    assert fwd.grid == (2 * 131072, 1)  # forward: 2 head blocks per token (the logits once per block)
    assert bwd.grid == (4 * 131072, 1)  # backward: 2 head blocks x 2 column parts per token
    assert interleaved.grid == (4 * 131072, 1)  # interleaved backward: 4 head blocks of 32 per token
    # the deterministic variant at the CP dense-at-positions shape: 128 queries over K = T = 131072
    with planning_for(90):
        dense_launches = specs.bwd_launches(T=128, K=131072)
    (_, dense), (_, dense_det) = dense_launches[0], dense_launches[-1]
    assert within_cuda_grid(dense.grid) and within_cuda_grid(dense_det.grid)
    assert dense_det.args["K_HI"] - dense_det.args["K_LO"] < 131072  # a slot window, not all of K
    assert dense_det.grid[0] == 4 * 128  # ... with all 128 queries in one chunk (not 1 token per chunk)


def test_every_registered_launch_within_cuda_grid_limits():
    from dsa_kernels.registry import cases

    bad = [(c.op, c.config) for c in cases() if not within_cuda_grid(c.launch.grid)]
    assert not bad, f"launches outside CUDA's grid limits (x <= 2^31 - 1, y, z <= 65535): {bad}"


def test_grid_beyond_cuda_limits_is_one_clear_error():
    with pytest.raises(ValueError, match="exceeds CUDA's limits"):
        smk._grid(2**31, 1, "forward")
    with pytest.raises(ValueError, match="smaller batch"):
        smk._grid(8, 70000, "backward")


def test_deterministic_plan_keeps_token_chunks_for_long_index_lists():
    # 671B: top-k 2048 and CP's dense-at-positions lists of 131072 slots give the same chunking
    for K, T in ((2048, 131072), (131072, 128)):
        chunk, window = smk.deterministic_plan(1, T, K, 576, 2, 16)
        assert chunk >= min(T, smk.DETERMINISTIC_MIN_TOKENS) and window % 16 == 0
        assert 2 * chunk * window * 576 <= smk.DETERMINISTIC_STAGE_ELEMS


# ----------------------------------------------------------------------------- backward memory
class _LiveStorages(torch.utils._python_dispatch.TorchDispatchMode):
    """Tracks the storages created by the ops run under it (meta device: sizes, no memory):
    after every op, which of them are alive. `peak_without(tensors)`: the largest total size
    alive at one time, not counting the given tensors' storages."""

    def __init__(self):
        super().__init__()
        from torch.multiprocessing.reductions import StorageWeakRef

        self._ref = StorageWeakRef
        self.live, self.snapshots, self.pre_existing, self._serial = {}, [], set(), 0

    def note_existing(self, *tensors):
        self.pre_existing |= {t.untyped_storage()._cdata for t in tensors}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if st._cdata not in self.pre_existing and st._cdata not in self.live:
                    self._serial += 1
                    self.live[st._cdata] = (self._ref(st), st.nbytes(), self._serial)
        self.snapshots.append({serial: n for _, n, serial in self.live.values()})
        return out

    def peak_without(self, *tensors) -> int:
        skip = {self.live[t.untyped_storage()._cdata][2] for t in tensors}
        return max(sum(n for s, n in snap.items() if s not in skip) for snap in self.snapshots)


def test_backward_extra_memory_at_32k_below_1gb(monkeypatch):
    """SparseMLAFunction.backward at T = 32768, H = 128, D = 576 (512 + 64), K = 2048, bf16, on the
    meta device with the kernel launch swapped out: at most 286 MB alive at once beyond its outputs
    dq [T, H, 576] bf16 (4.8 GB) and dkv [T, 576] bf16 (measured 2026-11-25): one 1024-token chunk
    of bwd_delta's fp32 product (268 MB) + delta [T, H] fp32 (17 MB); later dkv's fp32
    accumulator (75 MB). Before: two full fp32 copies of dO and O, 8.6 GB each."""
    launches = []
    monkeypatch.setattr(smk, "_launch", launches.append)
    B, T, H, D, d_v, K = 1, 32768, 128, 576, 512, 2048
    meta = dict(device="meta")
    q = torch.empty(B, T, H, D, dtype=torch.bfloat16, **meta)
    kv = torch.empty(B, T, D, dtype=torch.bfloat16, **meta)
    idx = torch.empty(B, T, K, dtype=torch.int32, **meta)
    n_slots = torch.empty(B, T, dtype=torch.int32, **meta)
    out = torch.empty(B, T, H, d_v, dtype=torch.bfloat16, **meta)
    lse = torch.empty(B, T, H, dtype=torch.float32, **meta)
    dout, dlse = torch.empty_like(out), torch.empty_like(lse)

    from types import SimpleNamespace

    Ctx = SimpleNamespace(saved_tensors=(q, kv, idx, n_slots, out, lse), scale=D**-0.5, d_v=d_v,
                          dtypes=(torch.bfloat16, torch.bfloat16))

    tracker = _LiveStorages()
    tracker.note_existing(q, kv, idx, n_slots, out, lse, dout, dlse)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)  # the atomic (default) backward; the deterministic one syncs on n_slots
    try:
        with tracker:
            dq, dkv, *_ = SparseMLAFunction.backward(Ctx, dout, dlse)
    finally:
        torch.use_deterministic_algorithms(was)
    assert len(launches) == 1 and launches[0].grid == (4 * T, 1)
    assert dq.shape == q.shape and dq.dtype == torch.bfloat16 and dkv.shape == kv.shape and dkv.dtype == torch.bfloat16
    extra = tracker.peak_without(dq, dkv)
    print(f"backward at T={T}: {extra / 1e6:.0f} MB alive at most beyond dq and dkv")
    assert 0 < extra < 1e9, f"backward allocates {extra / 1e6:.0f} MB beyond dq and dkv"


def test_bwd_delta_chunks_equal_the_full_formula(monkeypatch):
    monkeypatch.setattr(smk, "DELTA_CHUNK_ELEMS", 3 * 2 * 5 * 7)  # 3 tokens per chunk
    g = torch.Generator().manual_seed(0)
    out, dout = torch.randn(2, 10, 5, 7, generator=g).bfloat16(), torch.randn(2, 10, 5, 7, generator=g).bfloat16()
    lse, dlse = torch.randn(2, 10, 5, generator=g), torch.randn(2, 10, 5, generator=g)
    lse[0, 3] = float("-inf")  # an empty row: its dlse does not count
    want = (dout.float() * out.float()).sum(-1) - torch.where(torch.isfinite(lse), dlse, 0.0)
    torch.testing.assert_close(smk.bwd_delta(out, dout, lse, dlse), want, rtol=0, atol=1e-6)
    no_dlse = (dout.float() * out.float()).sum(-1)
    torch.testing.assert_close(smk.bwd_delta(out, dout, lse, None), no_dlse, rtol=0, atol=1e-6)


def test_slot_counts_in_token_chunks(monkeypatch):
    monkeypatch.setattr(smk, "SLOT_COUNT_CHUNK_ELEMS", 2 * 4 * 2)  # 2 tokens per chunk
    idx = torch.tensor([[[0, 2, -1, -1], [9, 1, 12, -1], [-1, -1, -1, -1], [3, 4, 5, 30]],
                        [[1, -1, 2, -1], [0, 0, 0, 0], [7, -2, -1, -1], [-1, 3, -1, 11]]], dtype=torch.int32)
    assert smk.slot_counts(idx).tolist() == [[2, 3, 0, 4], [3, 4, 1, 4]]
    assert smk.slot_counts(idx, 10).tolist() == [[2, 2, 0, 3], [3, 4, 1, 2]]  # >= 10 is empty too
    assert smk.slot_counts(idx[:, :, :0]).tolist() == [[0] * 4] * 2


# ----------------------------------------------------------------------------- interpreter: values
def cp_indices(T_q, positions, N, K, seed=0, drop=0.3):
    """Causal selections for queries at global `positions` over N keys, -1 padded (K > visible
    keys gives short rows), some slots dropped."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.full((1, T_q, K), -1, dtype=torch.int32)
    for j, t in enumerate(positions):
        n = min(K, t + 1)
        sel = torch.randperm(t + 1, generator=g)[:n].to(torch.int32)
        keep = torch.rand(n, generator=g) >= drop
        idx[0, j, :n] = torch.where(keep, sel, torch.full_like(sel, -1))
    return idx


def run_both(q, kv, idx, d_v, ref_idx=None, seed=1):
    """(triton, reference) -> each (out, lse, dq, dkv); ref_idx: the indices the reference gets."""
    scale = q.shape[-1] ** -0.5
    res = []
    for fn, ix in ((sparse_mla_triton, idx), (sparse_mla_ref, idx if ref_idx is None else ref_idx)):
        qq, kk = q.detach().clone().requires_grad_(), kv.detach().clone().requires_grad_()
        o, lse = fn(qq, kk, ix.to(DEV), scale, d_v)
        go = torch.randn(o.shape, generator=torch.Generator().manual_seed(seed)).to(DEV)
        gl = torch.randn(lse.shape, generator=torch.Generator().manual_seed(seed + 1)).to(DEV)
        loss = (o * go).sum() + (torch.where(torch.isfinite(lse), lse, 0) * gl).sum()
        res.append((o, lse, *torch.autograd.grad(loss, (qq, kk))))
    return res


def assert_matches(tri, ref):
    for a, r, name in zip(tri, ref, ("out", "lse", "dq", "dkv")):
        assert torch.isfinite(a[torch.isfinite(r)]).all(), name
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.fixture(params=[cfg[0] for cfg in smk.bwd_config_space(90, "3.6.0") if cfg[1] != "gluon"])  # Gluon: no interpreter
def bwd_config(request, monkeypatch):
    """Every config of Hopper's backward space in turn (the split kernel, the interleaved one, and
    under Triton 3.6 the split kernel at 32 keys x 3 stages; the superset is used whatever Triton
    runs the test): the autotuner's choice forced, as a GPU's timing could make it."""
    assert {c for c in smk.bwd_config_space(90, "3.9.0") if c[1] != "gluon"} <= set(smk.BWD_CONFIG_SPACE_TRITON_36[90])
    monkeypatch.setattr(smk, "bwd_config_space", lambda cap, version=None: smk.BWD_CONFIG_SPACE_TRITON_36[90])
    real_pick = smk.autotune.pick

    def pick(kernel, key, names, build, *args, **kw):
        if kernel == "sparse_mla_bwd":
            return request.param, build(request.param)
        return real_pick(kernel, key, names, build, *args, **kw)

    monkeypatch.setattr(smk.autotune, "pick", pick)
    return request.param


@pytest.mark.parametrize("where", ["last", "middle"])
def test_fewer_queries_than_keys_cp_layout(where, bwd_config):
    """Context parallelism: 8 queries at the last / middle positions of a 40-key sequence,
    indices into the whole kv (rows with fewer valid slots than K = 12 included); each backward
    config."""
    torch.manual_seed(0)
    N, T_q, H, d_v, d_r, K = 40, 8, 4, 32, 16, 12
    positions = list(range(N - T_q, N)) if where == "last" else list(range(16, 16 + T_q))
    q = torch.randn(1, T_q, H, d_v + d_r, device=DEV)
    kv = torch.randn(1, N, d_v + d_r, device=DEV)
    idx = cp_indices(T_q, positions, N, K, drop=0.4)
    idx[0, 2, 5:] = -1  # a short row
    tri, ref = run_both(q, kv, idx, d_v)
    assert_matches(tri, ref)
    assert (tri[3][0, positions[-1] + 1:] == 0).all()  # keys after the last query: never selected, no gradient


def test_out_of_range_indices_are_empty_slots(bwd_config):
    """Indices >= the kv rows or < -1 read as empty slots (forward and backward): the same as
    the reference with those slots set to -1, including a row whose tail is all out of range;
    each backward config."""
    torch.manual_seed(1)
    N, T, H, d_v, d_r, K = 24, 10, 4, 32, 16, 8
    q = torch.randn(1, T, H, d_v + d_r, device=DEV)
    kv = torch.randn(1, N, d_v + d_r, device=DEV)
    idx = cp_indices(T, list(range(N - T, N)), N, K, drop=0.2)
    bad = idx.clone()
    bad[0, 1, 0], bad[0, 4, 3], bad[0, 7, 2] = N, N + 1000, -7
    bad[0, 9, 5:] = N + 3  # tail of a row all out of range: slot_counts stops before it
    cleaned = torch.where((bad >= 0) & (bad < N), bad, -1)
    assert smk.slot_counts(bad, N)[0, 9] == smk.slot_counts(cleaned)[0, 9] <= 5
    tri, ref = run_both(q, kv, bad, d_v, ref_idx=cleaned)
    assert_matches(tri, ref)


def test_check_mode_raises_one_clear_error(monkeypatch):
    monkeypatch.setenv("DSA_KERNELS_CHECK", "1")
    q, kv = torch.randn(1, 4, 2, 48, device=DEV), torch.randn(1, 6, 48, device=DEV)
    idx = torch.tensor([[[0, -1], [1, 0], [2, 6], [3, 1]]], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match=r"sparse_mla: indices\[0, 2, 1\] = 6 is outside \[-1, 6\)") as err:
        sparse_mla_triton(q, kv, idx, 0.1, 32)
    assert "\n" not in str(err.value)


def test_fp32_inputs_computed_in_bf16_when_compiled(monkeypatch):
    """The fp32 policy of the compiled path (the interpreter is switched off for the policy only):
    fp32 q / kv go to the kernels as bf16 with one warning; DSA_KERNELS_FP32=error refuses;
    mixed 16-bit dtypes are one clear error. Interpreted, fp32 stays fp32."""
    q, kv = torch.randn(1, 3, 2, 48), torch.randn(1, 5, 48)
    assert kernel_inputs(q, kv)[0].dtype == torch.float32  # interpreted: as given
    monkeypatch.setattr(common, "interpreted", lambda: False)
    monkeypatch.setattr(common, "_FP32_WARNED", set())
    with pytest.warns(UserWarning, match="sparse_mla: fp32 inputs on the Triton path are computed in bf16"):
        q_c, kv_c = kernel_inputs(q, kv)
    assert q_c.dtype == kv_c.dtype == torch.bfloat16 and q_c.is_contiguous()
    torch.testing.assert_close(q_c, q.bfloat16(), rtol=0, atol=0)
    q_c2, _ = kernel_inputs(q, kv.bfloat16())  # mixed fp32 / bf16: both bf16 (no second warning needed)
    assert q_c2.dtype == torch.bfloat16
    q16, kvb = q.half(), kv.bfloat16()
    assert kernel_inputs(q16, q16[:, :, 0])[0].dtype == torch.float16  # 16-bit inputs: untouched
    with pytest.raises(TypeError, match="pass both in one dtype"):
        kernel_inputs(q16, kvb)
    monkeypatch.setenv("DSA_KERNELS_FP32", "error")
    with pytest.raises(TypeError, match="DSA_KERNELS_FP32=error"):
        kernel_inputs(q, kv)


@pytest.mark.slow
def test_deterministic_backward_in_slot_windows_and_token_chunks(monkeypatch):
    """Deterministic backward with index lists as wide as the keys (CP's dense-at-positions form)
    and a tiny stage budget: 16-slot windows x 8-token chunks (several of each, dq accumulated
    across windows). Equal to the reference, bit-equal across two runs, never atomics."""
    monkeypatch.setattr(smk, "DETERMINISTIC_STAGE_ELEMS", 48 * 8 * 16)  # n_hb * B * C * W * D
    monkeypatch.setattr(smk, "DETERMINISTIC_MIN_TOKENS", 8)
    launches = []
    run = smk._launch
    monkeypatch.setattr(smk, "_launch", lambda launch: launches.append(dict(launch.args)) or run(launch))
    torch.manual_seed(2)
    N, T, H, d_v, d_r = 40, 20, 4, 32, 16
    positions = list(range(N - T, N))
    q = torch.randn(1, T, H, d_v + d_r, device=DEV)
    kv = torch.randn(1, N, d_v + d_r, device=DEV)
    idx = cp_indices(T, positions, N, N, drop=0.2)  # K = N = 40: up to 3 windows of 16
    idx[0, 5, :3] = 7  # a key selected three times by one query
    idx[0, 11, 4] = N + 5  # out of range: empty
    ref_idx = torch.where(idx < N, idx, -1)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        first, ref = run_both(q, kv, idx, d_v, ref_idx=ref_idx)
        second, _ = run_both(q, kv, idx, d_v, ref_idx=ref_idx)
    finally:
        torch.use_deterministic_algorithms(was)
    bwd = [a for a in launches if "DETERMINISTIC" in a]
    assert bwd and all(a["DETERMINISTIC"] for a in bwd)
    assert {a["T0"] for a in bwd} == {0, 8, 16} and {a["K_LO"] for a in bwd} == {0, 16, 32}
    assert all(a["K_HI"] - a["K_LO"] <= 16 for a in bwd)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    assert_matches(first, ref)


def test_dense_at_positions_width_each_backward_config(bwd_config):
    """CP's dense-at-positions call: a chunk of queries whose index lists are as wide as the
    sequence (K = N = 40, several key tiles of either kernel), each backward config."""
    torch.manual_seed(3)
    N, T_q, H, d_v, d_r = 40, 6, 4, 32, 16
    positions = list(range(N - T_q, N))
    q = torch.randn(1, T_q, H, d_v + d_r, device=DEV)
    kv = torch.randn(1, N, d_v + d_r, device=DEV)
    idx = cp_indices(T_q, positions, N, N, drop=0.2)
    tri, ref = run_both(q, kv, idx, d_v)
    assert_matches(tri, ref)
