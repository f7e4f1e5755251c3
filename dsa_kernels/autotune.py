"""Autotuning over a small, documented config space per kernel, with the choice cached on disk.

An op's launcher names the configs of its space for the GPU's compute capability (e.g.
`sparse_mla.kernel.fwd_config_space`; the first is the default) and a function planning one
config's launch. `pick` returns the launch to run, planning only that one (all of them while timing):

- the default, without timing anything, when the tensors are not on a GPU (the interpreter, the
  CPU), when the space has one config, when `DSA_AUTOTUNE=0`, under
  `torch.use_deterministic_algorithms(True)` (a timed choice can differ between runs and ranks,
  and another key tile sums the online softmax in another order), or inside `untimed()` (work
  several ranks must do with the same bits: the indexer's top-k replicated over tensor
  parallelism, `dsa_train.parallel.tensor.TensorParallelHeads.replicated`);
- otherwise the fastest candidate by `triton.testing.do_bench` (CUDA events, after the device has
  finished what is queued on every stream: `_quiet_device`; the candidates only
  write the launch's own outputs, so timing them is harmless for kernels that overwrite them; a
  kernel that accumulates, like the sparse MLA backward's dkv atomics, zeroes its accumulator
  before the run that counts), timed once per (kernel, GPU name, capability, Triton
  version, shape key, the space's config names: a config that joins the space, such as an opt-in
  Gluon kernel, is timed against the rest rather than hidden behind an earlier choice) and remembered in memory and in a JSON file:
  `$DSA_AUTOTUNE_CACHE`, by default `~/.cache/dsa_train/autotune.json`.

The compile gate compiles every config of every space (each op's `specs.py` registers one case
per config for the target architecture), so whatever `pick` chooses has passed the gate.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import os
from pathlib import Path
from typing import Callable, Sequence

from ._triton_common import env_flag

_MEMORY: dict[str, str] = {}
_UNTIMED: contextvars.ContextVar[bool] = contextvars.ContextVar("dsa_autotune_untimed", default=False)


@contextlib.contextmanager
def untimed():
    """Within it `pick` returns every space's default, untimed, as off the GPU: for work whose bits
    must be the same on several ranks. A timed choice can differ between ranks (timing noise, a
    cache written by another rank), and configs agree only within their verification tolerance
    (the index score configs sum in other orders: last-bit differences, which reorder close scores)."""
    token = _UNTIMED.set(True)
    try:
        yield
    finally:
        _UNTIMED.reset(token)


def cache_path() -> Path:
    return Path(os.environ.get("DSA_AUTOTUNE_CACHE") or Path.home() / ".cache" / "dsa_train" / "autotune.json")


def enabled() -> bool:
    return env_flag("DSA_AUTOTUNE", "1")


def _load() -> dict:
    try:
        return json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}


def _store(entry: str, name: str) -> None:
    path = cache_path()
    try:  # a failed write only costs a later process one more timing
        data = _load()
        data[entry] = name
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_suffix(f".{os.getpid()}.part")
        part.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(part, path)
    except OSError:
        pass


def _bench(launch) -> float:
    import triton.testing

    return triton.testing.do_bench(launch.run, warmup=5, rep=20)


def pick(kernel: str, key: tuple, names: Sequence[str], build: Callable[[str], object], on_gpu: bool,
         device_id: str = "", bench: Callable[[object], float] | None = None,
         verify: Callable[[str], bool] | None = None):
    """(config name, launch): `names` are the configs of the space (the first: the default),
    `build(name)` plans that config's launch; only the launch that runs is planned, unless the
    configs are being timed. `device_id`: the GPU's name and capability; `key`: what else decides
    the best config (shapes); `bench`: launch -> milliseconds (default: `triton.testing.do_bench`);
    `verify(name)`: whether a config's output agrees with the default's, asked once per timing
    for every other config: one that does not is left out (with a warning) and never chosen."""
    if not names:
        raise ValueError(f"{kernel}: no config to choose from")
    import torch

    if (not on_gpu or len(names) == 1 or not enabled() or _UNTIMED.get()
            or torch.are_deterministic_algorithms_enabled()):
        return names[0], build(names[0])
    import triton

    # the space is part of the entry: a config that joins it (an opt-in such as DSA_KERNELS_GLUON_BWD)
    # is timed against the rest, not hidden behind a choice made without it
    entry = "|".join([kernel, device_id, f"triton {triton.__version__}", *map(str, key), "space " + ",".join(names)])
    name = _MEMORY.get(entry) or _load().get(entry)
    if name not in names:  # not timed yet for this space: time every config
        bench = bench or _bench
        agree = [n for n in names[1:] if verify is None or _verified(kernel, n, verify)]
        _quiet_device()
        times = {n: bench(build(n)) for n in [names[0], *agree]}
        name = min(times, key=times.get)
        _store(entry, name)
    _MEMORY[entry] = name
    return name, build(name)


def _quiet_device() -> None:
    """Before timing: the GPU finishes what is queued on every stream (a caller may have work in
    flight on another one, e.g. the indexer top-k's select overlapping the next chunk's scores),
    so no timing shares the GPU with it."""
    import torch

    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def choices(kernel: str | None = None) -> dict[str, str]:
    """{cache entry: config name} chosen by timing in this process (only `kernel`'s when given):
    what `dsa-train gpu-check` reports beside its timings."""
    return {e: n for e, n in _MEMORY.items() if kernel is None or e.split("|", 1)[0] == kernel}


def _verified(kernel: str, name: str, verify: Callable[[str], bool]) -> bool:
    if verify(name):
        return True
    import warnings

    warnings.warn(f"{kernel}: config {name} disagrees with the default on this GPU; it is left out of the "
                  "autotuning (please report it with `dsa-train gpu-check`)", RuntimeWarning, stacklevel=3)
    return False


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    import torch

    props = torch.cuda.get_device_properties(index)
    return f"{props.name} sm_{props.major}{props.minor}"


def device_id(t) -> str:
    """The GPU a tensor lives on, for the cache key: its name and compute capability (looked up
    once per device)."""
    return _device_name(t.device.index if t.device.index is not None else 0)
