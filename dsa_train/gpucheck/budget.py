"""Time the kernel checks leave for the sections after them (on a GPU, within the 600 s budget).

The end-to-end run (e2e.py) trains, kills and resumes a small model: it needs minutes, so the
correctness checks stop early enough to leave the selected speed checks and the end-to-end run their
time, and the speed checks leave the end-to-end run its own. Time is reserved per selected check,
not per section: `--only correctness.X speed.Y` keeps back speed.Y's seconds, not the whole speed
section's. The runner records the selected checks' names and estimated seconds as
`opts.selected_needs` (a check's estimate is `check_need_s`). `--small` reserves nothing (the CPU run
of the command has no deadline worth managing).
"""

from __future__ import annotations

from .core import Options

# seconds a section needs on a GPU: speed as measured on the first GPU run (an H200, Triton 3.6:
# 254 s; correctness took 100 s; docs/gpu-check/NVIDIA-H200/), the others estimates until a GPU
# run measures them
SECTION_NEEDS_S = {"speed": 255.0, "end-to-end": 240.0, "nccl": 60.0}


def check_need_s(check) -> float:
    """A check's estimated seconds on a GPU: what its budgeted runner declares (`run.need_s`, set
    by the speed and correctness sections' budget wrappers), else its section's figure above."""
    need = getattr(check.run, "need_s", None)
    return float(need) if need is not None else SECTION_NEEDS_S.get(check.section, 0.0)


def reserve_after(opts: Options, section: str) -> float:
    """Seconds to leave for the selected checks of the sections that run after `section`."""
    if opts.small:
        return 0.0
    from .core import SECTIONS

    later_sections = SECTIONS[SECTIONS.index(section) + 1:]
    later = {name: need for name, (sec, need) in opts.selected_needs.items() if sec in later_sections}
    training = [name for name, (sec, _) in opts.selected_needs.items()
                if name in later and sec in ("end-to-end", "nccl")]
    if training:
        from .e2e import missing_packages

        if missing_packages():  # the training runs cannot start: those checks fail in one line at once
            for name in training:
                later.pop(name)
    if "nccl.ep2" in later and opts.device == "cuda":
        import torch

        if torch.cuda.device_count() < 2:  # one GPU: the NCCL check is a skip, it needs no time
            later.pop("nccl.ep2")
    return sum(later.values())


def skip_reason(opts: Options, section: str, need_s: float) -> str | None:
    """None when a check needing need_s seconds fits before the later sections' reserve."""
    need = 0.0 if opts.small else need_s
    reserve = reserve_after(opts, section)
    left = opts.time_left()
    if left >= need + reserve:
        return None
    return (f"needs ~{need:.0f} s and {reserve:.0f} s are kept for the later sections; "
            f"{max(left, 0):.0f} s left of the budget")
