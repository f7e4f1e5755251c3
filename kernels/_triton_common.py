"""Shared helpers of the Triton kernels: backend choice and block-size helpers.

Backend choice (`use_triton`):
  DSA_KERNELS=auto   (default) Triton for CUDA tensors when triton imports, else the reference
  DSA_KERNELS=triton always Triton; on the CPU this needs TRITON_INTERPRET=1 set before triton
                     is first imported (the interpreter is chosen when a kernel is decorated)
  DSA_KERNELS=ref    always the PyTorch reference
The Triton modules are imported lazily, only when a Triton path is taken, so importing
`dsa_kernels` never imports triton.
"""

from __future__ import annotations

import functools
import os

import torch


@functools.lru_cache(maxsize=None)
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # pragma: no cover - depends on the install
        return False
    return True


def kernel_mode() -> str:
    mode = os.environ.get("DSA_KERNELS", "auto").strip().lower()
    if mode in ("reference", "torch", "pytorch"):
        mode = "ref"
    if mode not in ("auto", "triton", "ref"):
        raise ValueError(f"DSA_KERNELS must be auto, triton or ref; got {mode!r}")
    return mode


def use_triton(*tensors: torch.Tensor) -> bool:
    mode = kernel_mode()
    if mode == "ref":
        return False
    if mode == "triton":
        if not triton_importable():
            raise RuntimeError("DSA_KERNELS=triton but triton cannot be imported")
        on_cpu = any(not t.is_cuda for t in tensors)
        if on_cpu and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise RuntimeError("DSA_KERNELS=triton on CPU tensors needs TRITON_INTERPRET=1 (set before importing triton)")
        return True
    return all(t.is_cuda for t in tensors) and triton_importable()


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def pow2(n: int, minimum: int = 16) -> int:
    """Next power of two >= n, at least `minimum` (tl.dot needs every dim >= 16)."""
    p = minimum
    while p < n:
        p *= 2
    return p


def interp_upcast(x: torch.Tensor) -> torch.Tensor:
    """Under TRITON_INTERPRET=1, tl.dot on bf16/fp16 operands returns garbage (measured with
    triton 3.6 and 3.9: the interpreter multiplies the raw 16-bit patterns), so interpreted runs
    feed the kernels fp32 copies. Compiled runs keep the 16-bit inputs."""
    if interpreted() and x.dtype in (torch.bfloat16, torch.float16):
        return x.float()
    return x


class Launch:
    """One kernel launch as an op's launcher builds it: the Triton kernel, its grid, every kernel
    parameter by name (constexprs included) and the launch options. The launcher runs it
    (`run()`); the compile report (`dsa_kernels.compile_report`) compiles the very same launch
    for a target GPU without running it, so the report sees the block sizes the launcher picks."""

    def __init__(self, kernel, grid: tuple, args: dict, num_warps: int = 4, num_stages: int | None = None):
        self.kernel, self.grid, self.args = kernel, tuple(grid), dict(args)
        self.num_warps, self.num_stages = num_warps, num_stages

    def options(self) -> dict:
        opts = {"num_warps": self.num_warps}
        if self.num_stages is not None:
            opts["num_stages"] = self.num_stages
        return opts

    def run(self) -> None:
        self.kernel[self.grid](**self.args, **self.options())
