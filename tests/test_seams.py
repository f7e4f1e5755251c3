"""The typed seams and the fault seam (issue 33, items 4 and 5), without starting a process.

- `TrainingEngine` (dsa_train/trainer/trainer.py) is what `Engine` and `DeepSpeedEngine` share,
  `TokenDispatcher` (dsa_train/model/moe.py) what the two MoE dispatchers share, `TokenSplit` what
  the MoE's TP token split (`TensorParallelTokens`) offers: `runtime_checkable` Protocols. Each class has every member (a method or property of the class,
  or an attribute its `__init__` sets) with the Protocol's parameters; the classes that build
  cheaply here (`Engine`, `LocalDispatcher`) pass `isinstance`. A DeepSpeed engine and the
  all-to-all dispatcher need process groups: their members are read from the class and the
  source of its `__init__`.
- Fault injection joins a run only with `DSA_FAULT` set: the trainer's fault hook and the
  checkpoint writer's fault wrapper come from one factory each, and without the variable no
  fault code runs while a checkpoint is written.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
import torch

from dsa_train import faults
from dsa_train.trainer.engine import Engine
from dsa_train.training_engine import TrainingEngine
from dsa_train.trainer.hooks import InjectedFaults, fault_hooks
from dsa_train.model.moe import LocalDispatcher, TokenDispatcher, TokenSplit
from dsa_train.trainer.deepspeed_engine import DeepSpeedEngine
from dsa_train.parallel.expert import AllToAllDispatcher
from dsa_train.parallel.tensor import TensorParallelTokens

ENGINE_MEMBERS = {"model", "trainable", "optimizer", "scheduler", "lr", "forward", "backward", "gradient_tensors",
                  "step", "zero_grad", "close", "fragments"}
DISPATCHER_MEMBERS = {"local_experts", "dispatch", "combine"}
TOKEN_SPLIT_MEMBERS = {"scatter", "gather", "sum_load", "sum_gradient"}


def protocol_members(protocol: type) -> set[str]:
    return {name for name in vars(protocol) if not name.startswith("_")} | set(protocol.__annotations__)


def init_attributes(cls: type) -> set[str]:
    """Names `cls.__init__` assigns as `self.<name>` (plain or chained assignments, annotated too)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    found = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        for target in targets:
            for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    found.add(t.attr)
    return found


def parameters(fn) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values()][1:]  # without self


def missing_members(cls: type, protocol: type) -> list[str]:
    """What `cls` lacks of `protocol`, or has with other parameters."""
    problems = []
    for name in sorted(protocol_members(protocol)):
        wanted = getattr(protocol, name, None)
        have = inspect.getattr_static(cls, name, None)
        if have is None:
            if name not in init_attributes(cls):
                problems.append(f"{cls.__name__}.{name}: missing")
        elif inspect.isfunction(wanted) and parameters(have) != parameters(wanted):
            problems.append(f"{cls.__name__}.{name}{inspect.signature(have)}: the protocol's is {inspect.signature(wanted)}")
        elif isinstance(inspect.getattr_static(protocol, name), property) and not isinstance(have, property):
            problems.append(f"{cls.__name__}.{name}: a property in the protocol")
    return problems


def test_the_protocols_list_the_shared_members():
    assert protocol_members(TrainingEngine) == ENGINE_MEMBERS
    assert protocol_members(TokenDispatcher) == DISPATCHER_MEMBERS
    assert protocol_members(TokenSplit) == TOKEN_SPLIT_MEMBERS


@pytest.mark.parametrize("cls,protocol", [(Engine, TrainingEngine), (DeepSpeedEngine, TrainingEngine),
                                          (LocalDispatcher, TokenDispatcher), (AllToAllDispatcher, TokenDispatcher),
                                          (TensorParallelTokens, TokenSplit)],
                         ids=["Engine", "DeepSpeedEngine", "LocalDispatcher", "AllToAllDispatcher", "TensorParallelTokens"])
def test_both_implementations_satisfy_their_protocol(cls, protocol):
    assert missing_members(cls, protocol) == []


def test_the_member_check_finds_a_missing_or_different_member():
    class Partial:
        def __init__(self):
            self.local_experts = range(2)

        def dispatch(self, tokens, expert_ids):  # parameters missing
            pass

    assert missing_members(Partial, TokenDispatcher) == [
        "Partial.combine: missing",
        "Partial.dispatch(self, tokens, expert_ids): the protocol's is "
        "(self, tokens: 'torch.Tensor', expert_ids: 'torch.Tensor', weights: 'torch.Tensor', counts: 'torch.Tensor') "
        "-> 'tuple[torch.Tensor, list[int], object]'",
    ]
    assert not isinstance(Partial(), TokenDispatcher)


def test_engine_instances_are_training_engines_and_model_is_the_model():
    from dsa_train.config import OptimConfig, StageConfig
    from dsa_train.config.schema import Attention, Trainable
    from dsa_train.model import DSAForCausalLM, tiny_config
    from dsa_train.stage import Stage

    model = DSAForCausalLM(tiny_config(num_hidden_layers=1, num_nextn_predict_layers=0))
    stage = Stage.of("test", StageConfig(attention=Attention.dense, trainable=Trainable.all, steps=1))
    engine = Engine(model, stage, OptimConfig())
    assert isinstance(engine, TrainingEngine) and engine.model is model
    assert isinstance(LocalDispatcher(4), TokenDispatcher)
    # DeepSpeedEngine.model is the model too: DeepSpeed's wrapper is `.ds`, the forward runs through it
    assert "ds" in init_attributes(DeepSpeedEngine)
    assert "self.ds(" in inspect.getsource(DeepSpeedEngine.forward)


# ------------------------------------------------------------------------------ the fault seam
def test_fault_injection_joins_only_with_dsa_fault_set(monkeypatch):
    monkeypatch.delenv(faults.ENV, raising=False)
    assert fault_hooks(lambda: 1) == []
    assert faults.checkpoint_faults(3) is faults.NO_FAULTS
    monkeypatch.setenv(faults.ENV, "step=3,kind=crash,at=commit")
    [hook] = fault_hooks(lambda: 3)
    assert isinstance(hook, InjectedFaults)
    wrapper = faults.checkpoint_faults(3)
    assert isinstance(wrapper, faults.WriteFaults)
    wrapper.on_write()  # no at=checkpoint fault for step 3
    with pytest.raises(faults.InjectedFault):
        wrapper.on_commit()
    monkeypatch.setenv(faults.ENV, "step=2,kind=crash")  # at=step: the hook's before_step
    with pytest.raises(faults.InjectedFault):
        fault_hooks(lambda: 2)[0].before_step()


def test_no_fault_code_runs_in_a_checkpoint_write_without_dsa_fault(tmp_path, monkeypatch):
    from dsa_train.checkpoint.training import TrainerState, save_checkpoint, verify_checkpoint
    from dsa_train.checkpoint.sharded_state import GlobalPieces

    monkeypatch.delenv(faults.ENV, raising=False)

    def no_fault_code(*args, **kwargs):
        raise AssertionError("fault code ran without DSA_FAULT")

    for name in ("active", "at", "fire"):
        monkeypatch.setattr(faults, name, no_fault_code)
    tensors = {"model/w": GlobalPieces((4,), torch.float32, [((0,), torch.arange(4.0))])}
    path = save_checkpoint(tmp_path, TrainerState(global_step=1), tensors, {"epoch": 0}, {"torch": torch.get_rng_state()},
                           keep_last=1)
    verify_checkpoint(path)
