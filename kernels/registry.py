"""Kernel registry: every Triton kernel the dispatchers can launch, at the 671B shapes.

Each op folder (`ops/<op>/`) registers, in its `specs.py`, a builder that returns the launches (`Launch`) its
launcher makes at the 671B model's shapes (`SHAPES_671B`), built by calling the launcher's own
planning function on meta-device tensors, so the block sizes are the ones the launcher picks
there. `dsa-train kernels report` (`compile_report.py`) compiles them for a GPU architecture
without a GPU.

    from dsa_kernels.registry import register, SHAPES_671B

    @register("sparse_mla_fwd", attention=True)
    def _cases():
        return [KernelCase(config="...", launch=plan_fwd(...))]

`attention=True` marks tensor-core attention kernels: on sm_90a they must compile to wgmma.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Callable

# The 671B model (DeepSeek-V3.2-Exp): main attention heads, MQA key dim [latent 512 | rope 64],
# value dim, MHA-form q/k and v head dims, top-k, indexer heads and head dim; T = the 128K context.
SHAPES_671B = dict(B=1, T=131072, H=128, D=576, D_V=512, D_QK_MHA=192, D_V_MHA=128, K=2048, H_I=64, D_I=128)

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
    attention: bool = False

    @property
    def kernel_name(self) -> str:
        return self.launch.kernel.__name__


@dataclass
class _Entry:
    op: str
    attention: bool
    build: Callable[[], list[KernelCase]]


_REGISTRY: dict[str, _Entry] = {}


def register(op: str, attention: bool = False):
    """Decorator for a function `() -> list[KernelCase]` that builds an op's launches."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; the report's ops are {', '.join(OPS)}")

    def deco(fn):
        _REGISTRY[op] = _Entry(op, attention, fn)
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
            case.op, case.attention = op, entry.attention
            out.append(case)
    return out


def registered_ops() -> list[str]:
    load_all()
    return [op for op in OPS if op in _REGISTRY]
