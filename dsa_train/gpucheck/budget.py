"""Time the kernel checks leave for the sections after them (on a GPU, within the 600 s budget).

The end-to-end run (e2e.py) trains, kills and resumes a small model: it needs minutes, so the
correctness checks stop early enough to leave the speed section and the end-to-end run their time,
and the speed checks leave the end-to-end run its own. Only sections that were selected (`--only`)
are reserved for: the runner records them as `opts.selected_sections`. `--small` reserves nothing
(the CPU run of the command has no deadline worth managing).
"""

from __future__ import annotations

from .core import Options

# seconds a section needs on a GPU: speed as measured on the first GPU run (an H200, Triton 3.6:
# 254 s; correctness took 100 s; docs/gpu-check/NVIDIA-H200/), the others estimates until a GPU
# run measures them
SECTION_NEEDS_S = {"speed": 255.0, "end-to-end": 240.0, "nccl": 60.0}


def reserve_after(opts: Options, section: str) -> float:
    """Seconds to leave for the selected sections that run after `section`."""
    if opts.small:
        return 0.0
    from .core import SECTIONS

    selected = opts.selected_sections
    later = [s for s in SECTIONS[SECTIONS.index(section) + 1:] if s in selected]
    if "end-to-end" in later or "nccl" in later:
        from .e2e import missing_packages

        if missing_packages():  # the training runs cannot start: those checks fail in one line at once
            later = [s for s in later if s not in ("end-to-end", "nccl")]
    need = sum(SECTION_NEEDS_S.get(s, 0.0) for s in later)
    if "nccl" in later and "nccl" in selected and opts.device == "cuda":
        import torch

        if torch.cuda.device_count() < 2:  # one GPU: the NCCL check is a skip, it needs no time
            need -= SECTION_NEEDS_S["nccl"]
    return need


def skip_reason(opts: Options, section: str, need_s: float) -> str | None:
    """None when a check needing need_s seconds fits before the later sections' reserve."""
    need = 0.0 if opts.small else need_s
    reserve = reserve_after(opts, section)
    left = opts.time_left()
    if left >= need + reserve:
        return None
    return (f"needs ~{need:.0f} s and {reserve:.0f} s are kept for the later sections; "
            f"{max(left, 0):.0f} s left of the budget")
