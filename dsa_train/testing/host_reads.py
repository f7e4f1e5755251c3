"""Counts the places where code reads device values on the host, without a GPU.

On CUDA such a read blocks the host until the device has caught up (a "host sync"). On the CPU
nothing blocks, so this counter recognises them by what they are: `Tensor.tolist/item/numpy`,
Python's `int()/float()/bool()` of a tensor (aten `_local_scalar_dense`), and the ops whose output
size depends on tensor values (`nonzero`, boolean indexing, `masked_select`, `unique`, `bincount`,
`repeat_interleave` without `output_size`), which CUDA can only size after reading the device.

    with HostReads() as reads:
        loss = layer(x).sum()
    reads.total  # -> int; reads.sites: what was counted, in order
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ops whose result needs device values on the host (aten overload packets)
_DATA_DEPENDENT = {
    torch.ops.aten._local_scalar_dense, torch.ops.aten.nonzero, torch.ops.aten.masked_select,
    torch.ops.aten.bincount, torch.ops.aten._unique, torch.ops.aten._unique2, torch.ops.aten.unique_dim,
    torch.ops.aten.unique_consecutive, torch.ops.aten.argwhere,
}
# Tensor methods that read values on the host without dispatching an aten op on the CPU
_METHODS = ("tolist", "numpy")


class HostReads(TorchDispatchMode):
    """Context manager counting host reads of tensor values (see the module docstring); also sees
    the reads autograd's backward makes while the context is active."""

    def __init__(self):
        super().__init__()
        self.sites: list[str] = []
        self._originals: dict[str, object] = {}

    @property
    def total(self) -> int:
        return len(self.sites)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in _DATA_DEPENDENT:
            self.sites.append(str(func))
        elif packet is torch.ops.aten.index and any(
                i is not None and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else [])):
            self.sites.append(f"{func} (boolean mask)")
        elif packet is torch.ops.aten.repeat_interleave and kwargs.get("output_size") is None and len(args) < 3:
            self.sites.append(f"{func} (no output_size)")
        return func(*args, **kwargs)

    def __enter__(self):
        for name in _METHODS:
            original = getattr(torch.Tensor, name)
            self._originals[name] = original

            def counted(tensor, *a, _original=original, _name=name, **k):
                self.sites.append(f"Tensor.{_name}")
                return _original(tensor, *a, **k)

            setattr(torch.Tensor, name, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)
        self._originals.clear()
        return super().__exit__(*exc)
