"""The Triton launchers as torch custom ops (`dsa_kernels.custom_ops`), what `dsa-train plan --trace`
runs on a CUDA recipe:
  * each op's fake implementation gives exactly the shapes and dtypes the launcher returns on real
    inputs (Triton interpreter, tiny shapes);
  * under `trace_cuda_path` + FakeTensorMode the kernel Functions save the tensors a compiled CUDA
    run saves (the real run's shapes; the compiled path's dtypes), through the custom ops;
  * a traced step of a tiny recipe dispatches the kernel ops of the stage it runs (sparse: top-k,
    sparse MLA forward / backward, sparse KL; warm-up: library attention with lse, dense KL) and
    none of the CPU chunk loops, and the CPU path is still what a CPU recipe traces.

These ran in a child pytest process for a while: in the suite's process they failed at random
(`vector::reserve`, `std::bad_alloc`, SIGSEGV inside `OpOverload.__call__`) after
tests/test_checkpoint_errors.py. The cause: that file imports transformers' modeling code, whose
probe for the PyPI `kernels` package imported our ops a second time from the then root directory
`kernels/`, re-registering every `dsa_kernels::` op over the first copy's (torch destroys the old
registration) and leaving the first copy's op handles dangling. The directory is now `dsa_kernels/`
(tests/test_packaging.py checks the probe), so they run here, after that file in the suite's order."""

import contextlib
import os

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dsa_kernels import custom_ops as C  # noqa: E402

pytestmark = pytest.mark.integration  # traced training steps

DEV = "cuda" if HAS_CUDA else "cpu"
B, T, H, D, DV, K, HI, DI = 1, 9, 2, 32, 16, 4, 2, 16


def _indices():
    g = torch.Generator().manual_seed(0)
    idx = torch.full((B, T, K), -1, dtype=torch.int32)
    for t in range(T):
        n = min(K, t + 1)
        idx[0, t, :n] = torch.randperm(t + 1, generator=g)[:n].to(torch.int32)
    return idx.to(DEV)


def test_every_fake_gives_the_launchers_output_shapes_and_dtypes():
    """Each op on real inputs (the launcher) and on fake ones (the custom op): the same outputs'
    shapes and dtypes (`dsa_train.gpucheck.fakes`, also gpu-check's correctness.custom_op_fakes)."""
    from dsa_train.gpucheck.core import Options
    from dsa_train.gpucheck.fakes import compare_fakes, custom_op_fakes_check

    res = compare_fakes(DEV)
    assert {name.split("@")[0] for name in res} == {name.split("::")[1] for name in C.OPS}, "an op without a case"
    for name, r in res.items():
        assert r["ok"] and r["real"], (name, r)
    assert res["indexer_topk@positions"]["fake"] == [((B, 4, 5), "int32"), ((B, 4, 5), "float32")]
    assert custom_op_fakes_check(Options(device="cpu", small=True)).status == "pass"


def _saved(fn, *args):
    """Shapes / dtypes of the tensors autograd saves while fn(*args) runs, and the custom ops dispatched."""
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return saved, out


def test_traced_functions_save_what_the_kernel_functions_save():
    """Sparse MLA and the sparse KL, real (interpreter, fp32) and traced (fake bf16 inputs under
    trace_cuda_path): the same saved tensors by shape; the traced ones in the compiled path's
    dtypes (bf16 q / kv; the interpreter upcasts to fp32); the traced forward/backward go through
    the custom ops."""
    from dsa_kernels import sparse_indexer_kl, sparse_mla
    from dsa_train.plan.trace import MemoryTrace

    torch.manual_seed(0)
    q, kv = torch.randn(B, T, H, D, device=DEV), torch.randn(B, T, D, device=DEV)
    qi, ki, wi = torch.randn(B, T, HI, DI, device=DEV), torch.randn(B, T, DI, device=DEV), torch.rand(B, T, HI, device=DEV)
    idx = _indices()

    def step(q, kv, qi, ki, wi):
        with C.trace_cuda_path() if isinstance(q, FakeTensor) else contextlib.nullcontext():
            out, lse = sparse_mla(q, kv, idx.to(q.device), D**-0.5, DV)
            kl, _ = sparse_indexer_kl(qi, ki, wi, idx.to(q.device), q.detach(), kv.detach(), lse.detach(), D**-0.5)
        return out, kl

    os.environ["DSA_KERNELS"] = "triton"
    try:
        leaves = [x.clone().requires_grad_() for x in (q, kv, qi, ki, wi)]
        real_saved, _ = _saved(step, *leaves)
    finally:
        del os.environ["DSA_KERNELS"]
    mode, trace = FakeTensorMode(allow_non_fake_inputs=True), MemoryTrace()
    with mode, trace:
        fakes = [mode.from_tensor(x.to(torch.bfloat16) if x is not wi else x).requires_grad_() for x in (q, kv, qi, ki, wi)]
        fake_saved, (out, kl) = _saved(step, *fakes)
        with C.trace_cuda_path():
            (out.float().sum() + kl).backward()
    assert len(real_saved) == 6 + 8  # SparseMLAFunction's q, kv, idx, n_slots, out, lse; _SparseKL's eight
    assert [s for s, _ in fake_saved] == [s for s, _ in real_saved]
    compiled = [dt for _, dt in fake_saved]
    assert compiled[:2] == [torch.bfloat16, torch.bfloat16]  # SparseMLAFunction's q_c, kv_c
    assert [dt for _, dt in real_saved][:2] == [torch.float32, torch.float32]
    assert dict(trace.kernel_ops) == {f"dsa_kernels::{n}": 1 for n in
                                      ("sparse_mla_fwd", "sparse_mla_bwd", "sparse_kl_stats", "sparse_kl_grads")}


def _trace_demo(stage: str, kernels: str):
    from omegaconf import OmegaConf

    from dsa_train.config import compose_recipe
    from dsa_train.plan.estimate import model_config_of
    from dsa_train.plan.trace import trace_step

    cfg = OmegaConf.to_object(compose_recipe("demo", ["data.seq_len=64", "data.micro_batch_size=1",
                                                      "model.dtype=bfloat16"]))
    model_cfg, _ = model_config_of(cfg)
    return trace_step(cfg, model_cfg, rank=0, world=1, stage_name=stage, kernels=kernels)


@pytest.mark.parametrize("stage, ops", [
    # one process holds every head: the KL takes its target from the attention's forward (`*_target`)
    ("sparse", {"indexer_topk", "sparse_mla_fwd", "sparse_mla_bwd", "sparse_kl_stats_target", "sparse_kl_grads_target"}),
    ("warmup", {"attention_lse", "dense_kl_stats", "dense_kl_grads"}),
])
def test_traced_step_runs_the_cuda_path(stage, ops):
    """The demo model (2 layers) traced for one step on the CUDA path: each layer dispatches the
    stage's kernel ops (forward and backward once per layer), none of the CPU chunk loops."""
    t = _trace_demo(stage, "cuda")
    layers = t["layers"]
    assert t["kernels"] == "cuda"
    assert t["kernel_ops"] == {f"dsa_kernels::{n}": layers for n in ops}, t["kernel_ops"]
    assert t["peak_total"] == sum(t["peak"].values()) > 0
    assert_dsa_buffers_are_the_plans(t)


def assert_dsa_buffers_are_the_plans(t: dict) -> None:
    """The trace's DSA buffers at the peak are what the plan calls DSA buffers (top-k indices, a kernel's
    working set, the kernels' own glue in dsa_kernels/), named by site, and add up to the category."""
    sites = t["peak_dsa_sites"]
    assert sum(sites.values()) == t["peak"]["dsa_buffers"], sites
    for site in sites:
        assert (site in ("indexer_topk outputs", "indexer_topk_at_positions outputs") or site.endswith(" working set")
                or site.startswith("dsa_kernels/")), site  # the attention's / KL's outputs are activations


def test_trace_names_its_dsa_buffers_by_site():
    """The DSA buffers live at the peak, by allocation site: kept as they were at the peak (a transient
    working set included), while the live count goes on."""
    from dsa_train.plan.trace import MemoryTrace

    trace = MemoryTrace()
    q = torch.zeros(8, dtype=torch.float32)
    trace.add(q, "dsa_buffers", "indexer_topk outputs")
    trace.add(torch.zeros(4, dtype=torch.float32), "activations")
    assert trace.peak == {"dsa_buffers": 32, "activations": 16} and trace.peak_dsa_sites == {"indexer_topk outputs": 32}
    trace._bump(64, "dsa_buffers", "dsa_kernels::sparse_mla_bwd working set")  # a transient: a new peak
    assert trace.peak_dsa_sites == {"indexer_topk outputs": 32, "dsa_kernels::sparse_mla_bwd working set": 64}
    assert trace.peak["dsa_buffers"] == 96
    del q  # freed: the live count drops, the peak's breakdown stays
    import gc

    gc.collect()
    assert trace.dsa_sites["indexer_topk outputs"] == 0 and trace.peak_dsa_sites["indexer_topk outputs"] == 32


def test_cpu_recipe_traces_the_cpu_path():
    t = _trace_demo("sparse", None)  # the demo recipe runs on the CPU
    assert t["kernels"] == "cpu"
    assert not set(C.OPS) & set(t["kernel_ops"]), t["kernel_ops"]
    assert "dsa_kernels::sparse_mla_chunked_fwd" in t["kernel_ops"]
