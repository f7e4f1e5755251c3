"""Where a tensor of a parallelized model sits in the single-process model: one typed record per
parameter (`Sharding`), set where the layout is applied (`parallel/tensor.py`,
`parallel/expert.py`) and read through `sharding_of` everywhere else.

    sharding_of(p).tp_dim / .tp_range   this rank's slice [start, stop) of dimension tp_dim (TP)
    sharding_of(p).expert_group         routed expert sharded over EP (its DeepSpeed group name)

A parameter without a record is whole on every rank holding it (a replica). Which models
`parallelize_model` laid out, and for which `ParallelState`, is remembered here too
(`mark_parallelized` / `parallelized_state`), so a model built parallel is not parallelized again.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

_ATTRIBUTE = "_sharding_record"  # the one attribute a parameter carries (kept by Parameter swaps)


@dataclass(frozen=True)
class Sharding:
    """How this rank holds a parameter of the single-process model."""

    tp_dim: int | None = None  # tensor parallel: the split dimension ...
    tp_range: tuple[int, int] | None = None  # ... and this rank's [start, stop) along it
    expert_group: str | None = None  # expert parallel: the routed expert's group name (DeepSpeed's)

    @property
    def tensor_parallel(self) -> bool:
        return self.tp_dim is not None

    @property
    def expert(self) -> bool:
        return self.expert_group is not None

    def slice_of(self, full: torch.Tensor) -> torch.Tensor:
        """The part of the full (single-process) tensor this rank holds."""
        if self.tp_dim is None:
            return full
        start, stop = self.tp_range
        return full.narrow(self.tp_dim, start, stop - start)

    def place(self, local_shape: tuple[int, ...], tp_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(global shape, offsets of this rank's tensor in it), TP slices being even splits over
        `tp_size` ranks; expert and replicated tensors keep their (global) shape."""
        shape, offsets = list(local_shape), [0] * len(local_shape)
        if self.tp_dim is not None:
            start, stop = self.tp_range
            shape[self.tp_dim] = (stop - start) * tp_size
            offsets[self.tp_dim] = start
        return tuple(shape), tuple(offsets)


REPLICATED = Sharding()


def sharding_of(t: torch.Tensor) -> Sharding:
    """The record of a parameter (or buffer): REPLICATED when none was set."""
    return getattr(t, _ATTRIBUTE, REPLICATED)


def set_sharding(t: torch.Tensor, sharding: Sharding) -> None:
    setattr(t, _ATTRIBUTE, sharding)


def copies_in_world(t: torch.Tensor, sizes) -> int:
    """How many ranks hold this rank's copy of `t` (`sizes`: `ParallelSizes`): the world, divided
    by the TP shards of a TP slice and by the EP shards of a routed expert."""
    record = sharding_of(t)
    copies = sizes.world
    if record.tensor_parallel:
        copies //= sizes.tensor
    if record.expert:
        copies //= sizes.expert
    return copies


_PARALLELIZED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> ParallelState


def mark_parallelized(model: torch.nn.Module, state) -> None:
    """Record that `model` was laid out for `state` (`parallelize_model`)."""
    _PARALLELIZED[model] = state


def parallelized_state(model: torch.nn.Module):
    """The ParallelState `model` was laid out for; None for a single-process model."""
    return _PARALLELIZED.get(model)
