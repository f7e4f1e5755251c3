"""Device-strict collectives: the collective NCCL would reject on a GPU, caught on the CPU.

NCCL runs collectives on CUDA tensors only ("no backend for device cpu"); gloo accepts CPU
tensors. On a CPU-only run the model lives on the CPU too, so a tensor made without a device
(`torch.tensor([x])`) and handed to a collective works there and fails at the first step of a
GPU run. Switch the check on with the environment variable

    DSA_STRICT_DEVICES=1      (the test suite sets it for every multi-rank run it launches)

and, from `init_parallel` to `destroy_parallel`, this process:

* marks every tensor a factory function (`torch.tensor`, `zeros`, `ones`, `empty`, `full`,
  `arange`, ..., `from_numpy`) makes without an explicit `device=` as a *host* tensor, with the
  line that made it. The mark follows the tensor through operations as the CPU placement would
  on a GPU run: an operation on host tensors gives a host tensor, a 0-dim host tensor combined
  with device tensors gives a device tensor (CUDA accepts CPU scalars). An explicit move
  (`.to(device)`, `.to(other_tensor)`, `.cuda()`, `.cpu()`) drops it: CPU tensors made on
  purpose (`device="cpu"`) are allowed; on GPUs they belong on the one gloo group,
  `groups.cpu_group()` (the world and megatron-core's groups are NCCL only);
* checks every tensor of every `torch.distributed` collective (all_reduce, all_gather,
  reduce_scatter, broadcast, all_to_all, send/recv, ...): a host-marked tensor, or a tensor on
  a device other than the compute device (or the CPU), raises `DeviceStrictError` naming the
  collective's call site and the line that made the tensor.

The cost is a Python hook on every torch call (a few microseconds each): a test mode, not for
production runs.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

ENV = "DSA_STRICT_DEVICES"
_MARK = "_dsa_made_without_device"

# Collectives whose tensor arguments are checked (in torch.distributed and distributed_c10d).
COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "_all_gather_base",
    "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast", "reduce",
    "all_to_all", "all_to_all_single", "gather", "scatter", "send", "recv", "isend", "irecv",
)


class DeviceStrictError(RuntimeError):
    """A collective got a tensor that is not on the compute device (NCCL would reject it)."""


def enabled() -> bool:
    return os.environ.get(ENV, "0") not in ("", "0", "false", "False")


def _factories() -> frozenset:
    from torch.utils._device import _device_constructors

    return frozenset(_device_constructors()) | {torch.from_numpy, torch.frombuffer}


def _site(skip_torch: bool = True) -> str:
    """`file:line (function)` of the innermost frame outside torch and this module."""
    here = __file__
    torch_dir = os.path.dirname(torch.__file__)
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if name != here and not (skip_torch and name.startswith(torch_dir)):
            return f"{_short(name)}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "<unknown>"


def _project_site() -> str | None:
    """The innermost dsa_train frame (a collective called from DeepSpeed or torch on our behalf)."""
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(pkg) and name != __file__:
            return f"{_short(name)}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return None


def _short(path: str) -> str:
    cwd = os.getcwd() + os.sep
    if path.startswith(cwd):
        return path[len(cwd):]
    for marker in ("/dsa_train/", "/site-packages/", "/dsa_kernels/"):
        i = path.rfind(marker)
        if i >= 0:
            return path[i + 1 :]
    return path


def mark_of(t: torch.Tensor) -> str | None:
    """Where `t` was made without a device (None: made with one, moved explicitly, or unmarked)."""
    return getattr(t, _MARK, None)


def _set_mark(t, site: str | None) -> None:
    try:
        setattr(t, _MARK, site)
    except (AttributeError, RuntimeError):  # tensors that take no Python attributes
        pass


def _tensors(values):
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            for u in v:
                if isinstance(u, torch.Tensor):
                    yield u


def _outputs(out):
    if isinstance(out, torch.Tensor):
        return (out,)
    if isinstance(out, (list, tuple)):
        return tuple(o for o in out if isinstance(o, torch.Tensor))
    return ()


def _explicit_move(func, args, kwargs) -> bool:
    """Tensor.to / .cuda / .cpu / .type with a device named: the caller chose the placement."""
    if func in (torch.Tensor.cuda, torch.Tensor.cpu):
        return True
    if func is torch.Tensor.to:
        if "device" in kwargs or "other" in kwargs:
            return True
        return any(isinstance(a, (torch.device, str, int, torch.Tensor)) for a in args[1:])
    return False


class _MarkHostTensors(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.factories = _factories()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in self.factories:
            from_tensor = func in (torch.as_tensor, torch.asarray) and args and isinstance(args[0], torch.Tensor)
            if kwargs.get("device") is None and not from_tensor:
                for o in _outputs(out):
                    _set_mark(o, _site())
            return out
        inputs = list(_tensors(args)) + list(_tensors(kwargs.values()))
        if not inputs:
            return out
        if kwargs.get("device") is not None or _explicit_move(func, args, kwargs):
            for o in _outputs(out):
                _set_mark(o, None)
            return out
        marked = [mark_of(t) for t in inputs]
        host = [m for m in marked if m is not None]
        if not host:
            return out
        # as on CUDA: host tensors give a host result; a 0-dim host tensor with device tensors does not
        all_host = len(host) == len(inputs)
        any_host_nd = any(m is not None and t.dim() > 0 for t, m in zip(inputs, marked))
        if all_host or any_host_nd:
            same = {id(t) for t in inputs}
            for o in _outputs(out):
                if id(o) not in same and mark_of(o) is None:
                    _set_mark(o, host[0])
        return out


class StrictDevices:
    """Installed by `install(device)`: the host-tensor marks and the checked collectives."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.mode = _MarkHostTensors()
        self.saved: list[tuple[object, str, object]] = []

    def check(self, name: str, args, kwargs) -> None:
        for t in _tensors(list(args) + list(kwargs.values())):
            made = mark_of(t)
            wrong_device = t.device != self.device and t.device.type != "cpu"
            if made is None and not wrong_device:
                continue
            site = _site()
            ours = _project_site()
            where = site if ours is None or ours == site else f"{site}, called from {ours}"
            if made is not None:
                raise DeviceStrictError(
                    f"{ENV}: torch.distributed.{name} at {where} got a tensor made without a device at {made}; "
                    f"NCCL rejects CPU tensors: create it with device= the compute device ({self.device}), "
                    "or device='cpu' explicitly for gloo-side bookkeeping"
                )
            raise DeviceStrictError(
                f"{ENV}: torch.distributed.{name} at {where} got a tensor on {t.device}, not on the compute "
                f"device {self.device}; move it there before the collective"
            )

    def _wrap(self, name: str, fn):
        def checked(*args, **kwargs):
            self.check(name, args, kwargs)
            return fn(*args, **kwargs)

        checked.__name__ = getattr(fn, "__name__", name)
        checked.__wrapped__ = fn
        return checked

    def __enter__(self) -> "StrictDevices":
        from torch.distributed import distributed_c10d

        for module in (dist, distributed_c10d):
            for name in COLLECTIVES:
                fn = getattr(module, name, None)
                if fn is not None:
                    self.saved.append((module, name, fn))
                    setattr(module, name, self._wrap(name, fn))
        self.mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.mode.__exit__(None, None, None)
        for module, name, fn in reversed(self.saved):
            setattr(module, name, fn)
        self.saved.clear()


_ACTIVE: StrictDevices | None = None


def compute_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def install(device: torch.device | None = None) -> StrictDevices | None:
    """Switch the check on for this process when DSA_STRICT_DEVICES is set (idempotent)."""
    global _ACTIVE
    if _ACTIVE is None and enabled():
        _ACTIVE = StrictDevices(device if device is not None else compute_device()).__enter__()
    return _ACTIVE


def uninstall() -> None:
    global _ACTIVE
    if _ACTIVE is not None:
        _ACTIVE.__exit__(None, None, None)
        _ACTIVE = None
