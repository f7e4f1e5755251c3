"""Process-level settings: the heap on the CPU, which warnings a process shows, and what ranks
other than 0 log."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
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
    return os.environ.get("DSA_LOG_ALL_RANKS", "0") not in ("", "0")


RANK_LOCAL = "rank_local"  # a log record's attribute (logging's `extra`): a warning only its rank can give


def warn_rank_local(log: logging.Logger, message: str, *args) -> None:
    """Log a warning that only this rank can give (its own I/O, values only it holds): ranks other
    than 0 show it too (`OtherRanksLogFilter`), where a warning every rank gives is rank 0's to
    show. Prefixed with the rank when the job has more than one (torchrun's RANK, WORLD_SIZE)."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        message, args = "rank %s: " + message, (os.environ.get("RANK", "?"), *args)
    log.warning(message, *args, extra={RANK_LOCAL: True})


class OtherRanksLogFilter(logging.Filter):
    """What a rank other than 0 shows: errors (what failed where) and the warnings only it can give
    (`warn_rank_local`). A warning every rank gives (a doubtful recipe value, a top-k that covers the
    sequence, ...) is shown once per job by rank 0, not 1024 times at 671B; INFO is rank 0's."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or bool(getattr(record, RANK_LOCAL, False))


def filter_other_rank_logs(logger: logging.Logger | None = None) -> None:
    """Put `OtherRanksLogFilter` on every handler of `logger` (the root logger: where Hydra's job
    logging writes), once; the handlers are Hydra's, so call it after Hydra configured logging."""
    for handler in (logger or logging.getLogger()).handlers:
        if not any(isinstance(f, OtherRanksLogFilter) for f in handler.filters):
            handler.addFilter(OtherRanksLogFilter())


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
