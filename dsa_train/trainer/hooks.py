"""The trainer's policies around one optimizer step, as `StepHooks` of `trainer/step.train_step`.

Called in this order at the points of every training step:

    before_step     InjectedFaults    DSA_FAULT's at=step faults (crash, signals, hang)
    after_backward  InjectedFaults    DSA_FAULT's at=mid_step faults (crash, signals, NaN loss, +inf gradient)
    skip_update     NonFiniteGuard    a non-finite loss or gradient on any rank: skip the update or stop
    after_update    NonFiniteGuard    the skip counters, `nonfinite_skipped` in the metrics
                    RouterBias        the MoE router-bias update (or, without one, the loads cleared)

InjectedFaults is test machinery: `fault_hooks` gives it only when `DSA_FAULT` is set.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from pathlib import Path

import torch

from dsa_train.config.schema import FaultToleranceConfig, NonFinitePolicy
import dsa_train.faults as faults
from dsa_train.checkpoint.training import TrainerState
from dsa_train.runtime import warn_rank_local
from dsa_train.training_engine import TrainingEngine
from dsa_train.trainer.nonfinite import NonFiniteError, gradient_flag, nonfinite_losses, poison, poison_gradient
from dsa_train.trainer.step import StepHooks

log = logging.getLogger(__name__)


class InjectedFaults(StepHooks):
    """The `DSA_FAULT` faults (faults.py) set for the start of the step `step_of()` returns
    (the global step it becomes) and for after its backward, before the update."""

    def __init__(self, step_of: Callable[[], int]):
        self.step_of = step_of

    def before_step(self) -> None:
        faults.at("step", self.step_of())

    def after_backward(self, engine: TrainingEngine, metrics: dict) -> None:
        step = self.step_of()
        faults.at("mid_step", step)
        if faults.poison_step(step):
            poison(metrics, engine)
        if faults.inf_gradient_step(step):
            poison_gradient(engine)


def fault_hooks(step_of: Callable[[], int]) -> list[StepHooks]:
    """[InjectedFaults(step_of)] when `DSA_FAULT` is set, else none: fault injection joins a run's
    hooks only when asked for."""
    return [InjectedFaults(step_of)] if faults.requested() else []


class NonFiniteGuard(StepHooks):
    """`fault_tolerance.nonfinite` (trainer/nonfinite.py): a step whose loss or gradients are not
    finite on any rank is skipped (gradients cleared, counted in `state`), or the run stops with
    a checkpoint of the state before the step (`save_step_start(engine)`) and NonFiniteError."""

    def __init__(self, policy: FaultToleranceConfig, state: TrainerState,
                 any_rank: Callable[[bool | torch.Tensor], bool],
                 save_step_start: Callable[[TrainingEngine], None], checkpoint_dir: str):
        self.policy = policy
        self.state = state
        self.any_rank = any_rank
        self.save_step_start = save_step_start
        self.checkpoint_dir = checkpoint_dir

    def skip_update(self, engine: TrainingEngine, metrics: dict) -> bool:
        # one host read per step: the losses are host floats already; the gradient flag is a
        # bool (the engine's norm, read once) or a device tensor that any_rank combines and reads
        bad = nonfinite_losses(metrics)
        finite = gradient_flag(engine)
        if isinstance(finite, torch.Tensor):
            flag = torch.logical_not(finite) if not bad else torch.ones((), dtype=torch.bool, device=finite.device)
        else:
            flag = bool(bad) or not finite
        if not self.any_rank(flag):
            return False
        if not bool(finite):  # only after a bad step: which of this rank's quantities
            bad.append("gradients")
        self.skip(engine, bad or ["values on another rank"])
        return True

    def skip(self, engine: TrainingEngine, bad: list[str]) -> None:
        policy, state = self.policy, self.state
        engine.zero_grad()
        step = state.global_step + 1
        consecutive = state.nonfinite_consecutive + 1
        what = ", ".join(bad)
        if policy.nonfinite == NonFinitePolicy.stop or consecutive > policy.max_consecutive_nonfinite:
            self.save_step_start(engine)
            reason = ("fault_tolerance.nonfinite=stop" if policy.nonfinite == NonFinitePolicy.stop else
                      f"{consecutive} non-finite steps in a row (fault_tolerance.max_consecutive_nonfinite="
                      f"{policy.max_consecutive_nonfinite})")
            saved = Path(self.checkpoint_dir) / f"step_{state.global_step:08d}"
            exported = saved.parent.parent / f"export-{saved.name}"
            raise NonFiniteError(
                f"non-finite {what} at global step {step}: stopping ({reason}). {saved} holds the state before this "
                "step (resuming reproduces the step)",
                fix="resume with fault_tolerance.nonfinite=skip to skip such steps; or, to lower the lr (a resume "
                    f"keeps the recipe of the stage in progress), export it (`dsa-train export {saved} {exported}`) "
                    f"and start a new run_dir with model.pretrained={exported} and the lower lr; or check the data "
                    "at this position")
        # which values were not finite only the rank that holds them knows: a rank-local warning, shown
        # by ranks other than 0 too (dsa_train/runtime.py); "values on another rank" is every other rank's
        if bad != ["values on another rank"]:
            warn_rank_local(log, "non-finite %s at global step %d: update skipped (%d in a row)", what, step, consecutive)
        else:
            log.warning("non-finite %s at global step %d: update skipped (%d in a row)", what, step, consecutive)
        state.nonfinite_consecutive = consecutive
        state.nonfinite_skipped += 1

    def after_update(self, engine: TrainingEngine, metrics: dict, skipped: bool) -> None:
        if not skipped:
            self.state.nonfinite_consecutive = 0
        metrics["nonfinite_skipped"] = self.state.nonfinite_skipped


class RouterBias(StepHooks):
    """The auxiliary-loss-free MoE balancing: after an applied update, the router biases move by
    `rate` towards balanced loads. The loads a step accumulated are not part of a checkpoint, so
    a step without a bias update (rate 0, or skipped) clears them: they are zero at every step
    boundary, for an exact resume."""

    def __init__(self, model: torch.nn.Module, rate: float):
        self.model = model
        self.rate = rate

    def after_update(self, engine: TrainingEngine, metrics: dict, skipped: bool) -> None:
        if self.rate > 0 and not skipped:
            self.model.update_router_bias(self.rate)
        else:
            for module in self.model.modules():
                if isinstance(getattr(module, "load_since_update", None), torch.Tensor):
                    module.load_since_update.zero_()
