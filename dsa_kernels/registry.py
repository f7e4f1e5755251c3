"""Kernel registry: every Triton kernel the dispatchers can launch, at the 671B shapes.

Each op folder (`ops/<op>/`) registers, in its `specs.py`, a builder that returns the launches (`Launch`) its
launcher makes at the 671B model's shapes (`SHAPES_671B`), built by calling the launcher's own
planning function on meta-device tensors, so the block sizes are the ones the launcher picks
there. `dsa-train kernels report` (`compile_report.py`) compiles them for a GPU architecture
without a GPU.

    from dsa_kernels.registry import register, SHAPES_671B

    @register("sparse_mla_fwd")
    def _cases():
        return [KernelCase(config="...", launch=plan_fwd(...))]

Tensor cores: every registered kernel does its work in dot products (`tl.dot`) and must compile to
tensor-core instructions (the compile gate), except the kernels named in `DOT_FREE_KERNELS`.
`KernelCase.dots` says which; `tests/test_kernels_compile.py` checks the table against the kernels'
sources (a listed kernel has no `tl.dot`, an unlisted one has, counting the `@triton.jit` helpers
it calls), so a new kernel without dot products must be listed here to pass.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from dataclasses import dataclass
from typing import Callable

# The 671B model (DeepSeek-V3.2-Exp): main attention heads, MQA key dim [latent 512 | rope 64],
# value dim, MHA-form q/k and v head dims, top-k, indexer heads and head dim; T = the 128K context.
SHAPES_671B = dict(B=1, T=131072, H=128, D=576, D_V=512, D_QK_MHA=192, D_V_MHA=128, K=2048, H_I=64, D_I=128)

# Kernels (by function name) whose work is not dot products: no tensor-core instruction is required
# of them. Every other registered kernel must use tensor cores.
DOT_FREE_KERNELS = {
    "_radix_topk_kernel": "radix top-k selection: digit histograms, prefix sums and compares, no tl.dot",
    "_composite_keys_kernel": "top-k composite keys: an elementwise bit map of the scores, no tl.dot",
    "_topk_repair_kernel": "top-k repair after torch.topk: compares, prefix sums and a bit-by-bit fallback, no tl.dot",
    "_count_ties_kernel": "top-k tie count: compares and a sum per block of scores, no tl.dot",
    "_fp8_quant_kernel": "FP8 quantization of q_I / k_I: a group amax, a division and a cast per value, no tl.dot",
}

# The op names the report uses, in report order.
OPS = (
    "indexer_scores",
    "indexer_topk",
    "sparse_mla_fwd",
    "sparse_mla_bwd",
    "sparse_indexer_kl",
    "dense_indexer_kl",
    "dense_attention_fwd",
    "dense_attention_bwd",
)


@dataclass
class KernelCase:
    """One kernel launch to compile: `config` says the block sizes / warps in words."""

    config: str
    launch: object  # _triton_common.Launch
    op: str = ""
    work: object = None  # analysis.Work: per-token FLOPs and bytes of this launch (the analysis column)

    @property
    def kernel_name(self) -> str:
        return self.launch.kernel.__name__

    @property
    def dots(self) -> bool:
        """Whether the kernel's work is dot products, so the gate requires tensor-core instructions."""
        return self.kernel_name not in DOT_FREE_KERNELS


@dataclass
class _Entry:
    op: str
    build: Callable[[], list[KernelCase]]


_REGISTRY: dict[str, _Entry] = {}


def register(op: str):
    """Decorator for a function `() -> list[KernelCase]` that builds an op's launches. Whether a
    kernel must use tensor cores is decided by its source (`DOT_FREE_KERNELS`), not here."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; the report's ops are {', '.join(OPS)}")

    def deco(fn):
        _REGISTRY[op] = _Entry(op, fn)
        return fn

    return deco


def load_all() -> None:
    """Import every op folder's `specs` module (each registers its kernels)."""
    from . import ops

    for info in pkgutil.iter_modules(ops.__path__):
        if info.ispkg:
            name = f"dsa_kernels.ops.{info.name}.specs"
            try:
                importlib.import_module(name)
            except ModuleNotFoundError as err:
                if err.name != name:
                    raise


def cases(ops: list[str] | None = None) -> list[KernelCase]:
    """The kernel cases of the registered ops (all, or those named), in report order."""
    load_all()
    out = []
    for op in OPS:
        if op not in _REGISTRY or (ops is not None and op not in ops):
            continue
        entry = _REGISTRY[op]
        for case in entry.build():
            case.op = op
            out.append(case)
    return out


def registered_ops() -> list[str]:
    load_all()
    return [op for op in OPS if op in _REGISTRY]


# a dot product: Triton's tl.dot / tl.dot_scaled, or a Gluon kernel's warpgroup MMA (wgmma)
_DOT_CALL = re.compile(r"\btl\.dot(?:_scaled)?\s*\(|\bwarpgroup_mma\s*\(")
_NAME = re.compile(r"\b[A-Za-z_]\w*\b")


def calls_tl_dot(kernel) -> bool:
    """Whether a `@triton.jit` kernel's source, or the source of a `@triton.jit` function it calls
    (by name, from its module, recursively), contains a `tl.dot(...)` call."""
    from triton.runtime.jit import KernelInterface  # JITFunction, or InterpretedFunction under TRITON_INTERPRET=1

    seen, todo = set(), [kernel]
    while todo:
        fn = todo.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        py_fn = getattr(fn, "fn", fn)
        src = re.sub(r"#.*", "", inspect.getsource(py_fn))  # comments do not count
        if _DOT_CALL.search(src):
            return True
        scope = py_fn.__globals__
        for name in set(_NAME.findall(src)):
            called = scope.get(name)
            if isinstance(called, KernelInterface) and called is not fn:
                todo.append(called)
    return False
