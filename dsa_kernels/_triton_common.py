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

import contextlib
import contextvars
import functools
import os

import torch


def env_flag(name: str, default: str, on_means: str = "") -> bool:
    """An on / off environment switch (docs/kernels.md's switches table): 1 / true / on or 0 / false /
    off, `default` when unset; anything else is a ValueError naming the variable and its values."""
    value = os.environ.get(name, default).strip().lower()
    if value not in ("0", "1", "false", "true", "off", "on"):
        raise ValueError(f"{name} must be 1{f' ({on_means})' if on_means else ''} or 0; got {value!r}")
    return value in ("1", "true", "on")


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


# Set by `dsa_kernels.custom_ops.trace_cuda_path` (the memory trace, on fake tensors): the CUDA path
# is taken whatever the tensors' device, and the input policies are the compiled path's.
_TRACE_CUDA: contextvars.ContextVar[bool] = contextvars.ContextVar("dsa_trace_cuda_path", default=False)


def cuda_path_traced() -> bool:
    return _TRACE_CUDA.get()


def use_triton(*tensors: torch.Tensor) -> bool:
    mode = kernel_mode()
    if mode == "ref":
        return False
    if _TRACE_CUDA.get():
        return True
    if mode == "triton":
        if not triton_importable():
            raise RuntimeError("DSA_KERNELS=triton but triton cannot be imported")
        on_cpu = any(not t.is_cuda for t in tensors)
        if on_cpu and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise RuntimeError("DSA_KERNELS=triton on CPU tensors needs TRITON_INTERPRET=1 (set before importing triton)")
        return True
    return all(t.is_cuda for t in tensors) and triton_importable()


# The compute capability the launch plans are made for when the tensors are not on a GPU: the
# compile report sets it per target (`planning_for`); otherwise Hopper (sm_90), the reference GPU.
_PLAN_CAPABILITY: contextvars.ContextVar[int] = contextvars.ContextVar("dsa_plan_capability", default=90)


@contextlib.contextmanager
def planning_for(capability: int):
    """Launch plans made inside this block (on meta / CPU tensors) pick the block sizes of GPUs of
    compute capability `capability` (e.g. 90 for H100 / H200, 100 for B200)."""
    token = _PLAN_CAPABILITY.set(capability)
    try:
        yield
    finally:
        _PLAN_CAPABILITY.reset(token)


def target_capability(t: torch.Tensor) -> int:
    """The compute capability a launch on `t` runs on: its GPU's (major * 10 + minor), else the
    one set by `planning_for` (default 90)."""
    if t.is_cuda:
        major, minor = torch.cuda.get_device_capability(t.device)
        return major * 10 + minor
    return _PLAN_CAPABILITY.get()


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1" and not _TRACE_CUDA.get()


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


def kernel_input(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """x as a kernel takes it: in the compute dtype the fp32 policy chose (`compute_dtype`; None
    keeps x's), contiguous, and upcast to fp32 under the interpreter (`interp_upcast`)."""
    if dtype is not None:
        x = x.to(dtype)
    return interp_upcast(x.contiguous())


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
        if interpreted():
            interpreter_compat()
        self.kernel[self.grid](**self.args, **self.options())


@functools.lru_cache(maxsize=None)
def interpreter_compat() -> bool:
    """Make Triton 3.6's interpreter run under numpy >= 2.4 (True when it patched something).

    Its `tensor.__index__` is `int(handle.data)` on a one-element 1-D array, which numpy 2.4 refuses
    ("only 0-dimensional arrays can be converted to Python scalars"): every `range(..., runtime
    value)` loop of a kernel then fails under TRITON_INTERPRET=1. Triton 3.9 takes the scalar with
    `.squeeze()`; this gives 3.6 the same, through the interpreter's own patch scope (restored after
    each launch like its other patches). Nothing changes for compiled kernels or other versions."""
    import inspect

    try:
        from triton.runtime import interpreter
    except Exception:  # pragma: no cover - depends on the install
        return False
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:
        return False
    try:
        source = inspect.getsource(original)
    except (OSError, TypeError):
        return False
    if "int(self.handle.data))" not in source:  # not the 3.6 form (3.9 squeezes)
        return False

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_lang_tensor
    return True


def row_dot(a: torch.Tensor, b: torch.Tensor, chunk_elems: int) -> torch.Tensor:
    """[B, T, H, D] x2 -> [B, T, H] fp32 sum over D of a * b (the backward's rowsum(dO * O)), one
    token chunk at a time: the only temporary is the chunk's fp32 product (at most chunk_elems
    elements), never a full-size fp32 copy of a or b."""
    B, T, H, D = a.shape
    out = torch.empty((B, T, H), dtype=torch.float32, device=a.device)
    step = max(1, chunk_elems // max(B * H * D, 1))
    for t0 in range(0, T, step):
        prod = a[:, t0:t0 + step].to(torch.float32, copy=True)  # [B, C, H, D], the one temporary
        prod.mul_(b[:, t0:t0 + step])
        out[:, t0:t0 + step] = prod.sum(-1)
        del prod  # freed before the next chunk's copy: one chunk alive at a time
    return out


# ----------------------------------------------------------------------------- input policies
# Shared by every op's Triton entry point (decided once, documented in docs/kernels.md):
#
# Indices. The kernels mask every load of a selected row by `0 <= idx < n_keys`, so an index out
# of range (a caller bug, a corrupted top-k) is read as an empty slot, never as an illegal memory
# access. That masking is silent; DSA_KERNELS_CHECK=1 (debug mode) makes the entry points verify
# the indices on the host first and raise one clear error instead (one device sync per call).
#
# fp32 inputs. Compiled kernels take 16-bit q/kv: fp32 tiles do not fit the sparse-MLA forward's
# shared memory (~442 KB at the 671B shapes) and fp32 tl.dot runs as TF32. A compiled call with
# fp32 inputs computes in bf16 with one warning per op (outputs keep the caller's dtype);
# DSA_KERNELS_FP32=error refuses instead. Under TRITON_INTERPRET=1 fp32 stays fp32 (`interp_upcast`).


def check_mode() -> bool:
    """DSA_KERNELS_CHECK=1: entry points validate their index inputs on the host (debug mode)."""
    return os.environ.get("DSA_KERNELS_CHECK", "0").strip().lower() in ("1", "true", "yes", "on")


def check_indices(indices: torch.Tensor, n_keys: int, op: str) -> None:
    """In check mode, raise one clear ValueError if any index is outside [-1, n_keys)
    (-1 marks an empty slot). Outside check mode this does nothing (and costs nothing)."""
    if not check_mode() or indices.numel() == 0:
        return
    bad = (indices < -1) | (indices >= n_keys)
    if bool(bad.any()):
        where = torch.nonzero(bad)[0].tolist()
        value = int(indices[tuple(where)])
        raise ValueError(f"{op}: indices{where} = {value} is outside [-1, {n_keys}) (the key rows "
                         f"this call was given); fix the caller's top-k / index list "
                         f"(DSA_KERNELS_CHECK=1 is on; without it such a slot is read as empty)")


_FP32_WARNED: set[str] = set()


def compute_dtype(op: str, *tensors: torch.Tensor) -> torch.dtype | None:
    """The dtype a compiled kernel should compute in for these inputs: None = use them as they
    are; torch.bfloat16 = fp32 inputs on the compiled path (warned once per op, or refused under
    DSA_KERNELS_FP32=error). Interpreted runs (TRITON_INTERPRET=1) always return None."""
    if interpreted() or not any(t.dtype == torch.float32 for t in tensors):
        return None
    if os.environ.get("DSA_KERNELS_FP32", "cast").strip().lower() == "error":
        raise TypeError(f"{op}: fp32 inputs on the Triton path (DSA_KERNELS_FP32=error); pass bf16 "
                        f"tensors (model.to(torch.bfloat16)) or unset DSA_KERNELS_FP32 to compute in bf16")
    if op not in _FP32_WARNED:
        _FP32_WARNED.add(op)
        import warnings

        warnings.warn(f"{op}: fp32 inputs on the Triton path are computed in bf16 (fp32 tiles do not fit "
                      f"the kernels, and fp32 tl.dot would silently be TF32); pass bf16 tensors to silence "
                      f"this, or set DSA_KERNELS_FP32=error to refuse", stacklevel=3)
    return torch.bfloat16
