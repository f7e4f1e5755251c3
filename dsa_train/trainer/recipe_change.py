"""Resume with a changed recipe: compare the recipe given with the one the checkpoint was written
under (saved in its trainer_state.json), apply the deliberate, safe changes and say so, refuse the
rest naming the keys and how to proceed.

Applied (each logged as `resume: ...`):
  * any key of logging, checkpoint, fault_tolerance, cluster, run_name, run_dir, probe_batches,
    device: they do not change what is trained;
  * the parallel layout (parallel.*: world size, TP, CP, EP, DP, ZeRO stage, recompute): sharded
    checkpoints hold global tensors and each rank reads its own pieces (checkpoint/sharded_state.py);
    the data position carries over when the global batch stays (data/loader.py);
  * the steps of the stage in progress (more, or fewer but still more than it has done): the
    stage's LR schedule is recomputed for the new length;
  * stages added, or not-yet-started stages removed or changed, after the stage in progress.
Refused (`RecipeChanged`, a ConfigError):
  * any other change to the stage in progress or to a finished stage (lr, schedule, attention,
    top-k, batch size, ...): the optimizer, schedule and data position in the checkpoint belong
    to the old values, so the run would silently keep the old ones or mix them;
  * stages renamed, removed or reordered up to the stage in progress;
  * model, data, optimizer, seed and deterministic changes.
A finished run (every stage done) says so instead of training nothing.
"""

from __future__ import annotations

import logging
from typing import Any

from dsa_train.config import ConfigError

log = logging.getLogger(__name__)

FREE_SECTIONS = ("logging", "checkpoint", "fault_tolerance", "cluster", "run_name", "run_dir", "probe_batches", "device",
                 "deterministic", "parallel")


class RecipeChanged(ConfigError):
    """The recipe differs from the checkpoint's in a way a resume cannot apply."""


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


# keys added to the recipe after checkpoints were first written: absent from an older checkpoint's
# recipe means this default (not a change)
ADDED_KEYS = {"data.allow_tokenizer_mismatch": False}


def _diff(old: Any, new: Any, prefix: str) -> list[str]:
    a, b = _flatten(old, prefix), _flatten(new, prefix)
    for key, default in ADDED_KEYS.items():
        if key in b and key not in a:
            a[key] = default
    return [f"{k}: {a.get(k, '<absent>')!r} (checkpoint) -> {b.get(k, '<absent>')!r}"
            for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def compare(saved: dict, current: dict, stage_index: int, stage_step: int, path) -> list[str]:
    """Check `current` (the recipe given) against `saved` for a checkpoint at `stage_index` /
    `stage_step`; returns the applied changes (log lines), raises RecipeChanged for the rest. A
    checkpoint at step 0 of a stage (a stage boundary) has not started that stage: it may change."""
    applied: list[str] = []
    problems: list[str] = []
    old_stages, new_stages = list(saved.get("stages", {})), list(current.get("stages", {}))
    done = old_stages[:stage_index]  # finished stages
    in_progress = old_stages[stage_index] if stage_index < len(old_stages) and stage_step > 0 else None
    fixed = done + ([in_progress] if in_progress else [])
    if new_stages[:len(fixed)] != fixed:
        problems.append(
            f"stages: the checkpoint finished {done or 'no stage'}"
            + (f" and is in stage {in_progress!r}" if in_progress else "")
            + f" of {old_stages}; this recipe has {new_stages}. Stages up to the one in progress must stay, "
            "in the same order (stages after it may be added or removed)")
    else:
        for name in done:
            changed = _diff(saved["stages"][name], current["stages"][name], f"stages.{name}")
            if changed:
                more = current["stages"][name]["steps"] > saved["stages"][name]["steps"]
                problems.append(f"stage {name!r} is finished, it cannot change: " + "; ".join(changed)
                                + (" (a finished stage's checkpoint keeps no optimizer state to continue it exactly: "
                                   "to train more, add a stage after it)" if more else ""))
        if in_progress:
            old, new = dict(saved["stages"][in_progress]), dict(current["stages"][in_progress])
            old_steps, new_steps = old.pop("steps"), new.pop("steps")
            changed = _diff(old, new, f"stages.{in_progress}")
            if changed:
                problems.append(f"stage {in_progress!r} is in progress (step {stage_step}): "
                                + "; ".join(changed))
            if new_steps != old_steps:
                if new_steps <= stage_step:
                    problems.append(f"stages.{in_progress}.steps: {new_steps}, but the checkpoint has done "
                                    f"{stage_step} steps of that stage already")
                else:
                    applied.append(f"stages.{in_progress}.steps {old_steps} -> {new_steps}: "
                                   f"{'extending' if new_steps > old_steps else 'shortening'} the stage in progress "
                                   "(its LR schedule is recomputed for the new length)")
        later_old, later_new = old_stages[len(fixed):], new_stages[len(fixed):]
        for name in later_new:
            if name not in later_old:
                applied.append(f"stage {name!r} added after the checkpoint's position")
            elif saved["stages"][name] != current["stages"][name]:
                applied.append(f"stage {name!r} (not started yet) changed: "
                               + "; ".join(_diff(saved["stages"][name], current["stages"][name], f"stages.{name}")))
        for name in later_old:
            if name not in later_new:
                applied.append(f"stage {name!r} (not started yet) removed")
    for section in sorted(set(saved) | set(current)):
        if section == "stages":
            continue
        changed = _diff(saved.get(section), current.get(section), section)
        if not changed:
            continue
        if section in FREE_SECTIONS:
            applied.extend(changed)
        else:
            problems.extend(changed)
    if problems:
        from pathlib import Path

        path = Path(path)
        export = path.parent.parent / "export"
        weights = (f"model.pretrained={export}" if (export / "config.json").is_file() else
                   f"`dsa-train export {path} {path.parent.parent / ('export-' + path.name)}`, then "
                   f"model.pretrained={path.parent.parent / ('export-' + path.name)}")
        raise RecipeChanged(
            f"checkpoint.dir: this recipe differs from the one {path} was written under: " + "; ".join(problems)
            + f" — resume with the recipe's old values, or start a new run under another run_dir (to continue from "
            f"these weights: {weights})")
    return applied


def finished_message(stage_names: list[str], global_step: int, path, export_dir) -> str:
    from pathlib import Path

    export_dir = Path(export_dir)
    done = (f"this run is already finished: all {len(stage_names)} stages ({', '.join(stage_names)}) done at global "
            f"step {global_step} (checkpoint {path}); nothing to train.")
    if not (export_dir / "config.json").is_file():  # stopped during (or before) its end-of-run export
        return (f"{done} Its export {export_dir} is missing (the run was stopped during its export?): write it with "
                f"`dsa-train export {path} {export_dir}`. To train more, add a stage to the recipe")
    return (f"{done} To train more, add a stage to the recipe, or start a new run_dir from its export "
            f"(model.pretrained={export_dir})")
