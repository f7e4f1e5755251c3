"""Process-level settings for running on the CPU."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_MMAP_THRESHOLD = -3


def limit_heap_fragmentation(threshold_bytes: int = 1 << 20) -> bool:
    """Serve allocations above `threshold_bytes` with mmap and keep that threshold fixed.

    The chunked DSA ops allocate blocks whose size grows with the key window. glibc's default
    *dynamic* mmap threshold moves such blocks onto the heap after the first few are freed, and the
    fragmented heap is never returned: at T = 4096 the resident size of the warm-up indexer loss
    reached 1.3 GB instead of 0.47 GB (benchmarks/indexer_loss_memory.py). Setting the threshold
    explicitly disables the dynamic adjustment. No-op (returns False) outside glibc.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, int(threshold_bytes)))
    except (OSError, AttributeError):
        return False


def quiet_third_party(rank: int = 0) -> None:
    """Silence warnings a user cannot act on, and on ranks other than 0 all warnings (rank 0 prints
    each once per job; `DSA_LOG_ALL_RANKS=1` keeps them): megatron-core's import-time "Transformer Engine and Apex are not installed"
    (it falls back to torch implementations, which dsa_train does not use for its optimizer anyway)."""
    import warnings

    warnings.filterwarnings("ignore", message=r".*Transformer Engine and Apex are not installed.*")
    warnings.filterwarnings("ignore", category=UserWarning, module=r"(megatron|transformer_engine|apex)(\..*)?$")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"(megatron|transformer_engine|apex|deepspeed)(\..*)?$")
    if rank != 0 and not log_all_ranks():
        warnings.simplefilter("ignore")


def log_all_ranks() -> bool:
    """`DSA_LOG_ALL_RANKS=1`: every rank shows its warnings (logged and Python warnings), not rank 0
    only (dsa_train/launch/rank.py)."""
    import os

    return os.environ.get("DSA_LOG_ALL_RANKS", "0") not in ("", "0")


def require_train_extra(*packages: str, purpose: str = "training") -> None:
    """Raise one clear DSATrainError when a package of the `train` extra (pyproject.toml) is not
    installed: a core install (`pip install dsa-train`, what `dsa-train gpu-check` needs on a
    cluster image) has no datasets / wandb / matplotlib."""
    import importlib.util

    missing = [name for name in packages if importlib.util.find_spec(name) is None]
    if missing:
        from dsa_train.errors import DSATrainError

        extra = "data" if missing == ["datasets"] else "train"
        raise DSATrainError(f"{purpose} needs {', '.join(missing)}, which this installation lacks (a core install) — "
                            f"install the {extra} extra: pip install \"dsa-train[{extra}]\" (offline on a cluster "
                            f"image: the wheelhouse of docs/install.md with EXTRAS={extra})")
