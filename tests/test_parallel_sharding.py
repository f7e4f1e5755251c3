"""The layout's records and adapters in one process: the Sharding record (placement, slicing,
copy counting), the single-process Layout, and the DeepSpeed adapter's version guard and MoE marks."""

import pytest
import torch

from dsa_train.config import ConfigError, TrainConfig
from dsa_train.config import ParallelSizes
from dsa_train.checkpoint import sharded_state
from dsa_train.parallel import deepspeed_compat
from dsa_train.parallel.layout import Layout, init_layout
from dsa_train.sharding import (
    REPLICATED,
    Sharding,
    copies_in_world,
    mark_parallelized,
    parallelized_state,
    set_sharding,
    sharding_of,
)


def test_tensor_parallel_record_places_and_slices_the_full_tensor():
    full = torch.arange(4 * 8, dtype=torch.float32).view(4, 8)
    record = Sharding(tp_dim=1, tp_range=(4, 8))  # rank 1 of 2 along the columns
    local = record.slice_of(full)
    assert torch.equal(local, full[:, 4:8])
    assert record.place(tuple(local.shape), tp_size=2) == ((4, 8), (0, 4))
    assert REPLICATED.place((4, 8), tp_size=2) == ((4, 8), (0, 0))
    assert REPLICATED.slice_of(full) is full


def test_record_is_read_through_one_function_and_counts_copies():
    sizes = ParallelSizes(world=8, tensor=2, context=1, expert=2, data=4)
    dense, tp_slice, expert = (torch.nn.Parameter(torch.zeros(2)) for _ in range(3))
    set_sharding(tp_slice, Sharding(tp_dim=0, tp_range=(0, 2)))
    set_sharding(expert, Sharding(expert_group="ep_size_2"))
    assert sharding_of(dense) is REPLICATED and not sharding_of(dense).expert
    assert sharding_of(tp_slice).tensor_parallel and sharding_of(expert).expert
    assert [copies_in_world(p, sizes) for p in (dense, tp_slice, expert)] == [8, 4, 4]


def test_checkpoint_pieces_are_placed_by_the_record():
    model = torch.nn.Linear(3, 4, bias=False)
    set_sharding(model.weight, Sharding(tp_dim=0, tp_range=(4, 8)))
    pieces = sharded_state.model_pieces(model, tp_size=2)["model/weight"]
    assert tuple(pieces.shape) == (8, 3) and list(pieces.pieces) == [(4, 0)]


def test_parallelized_models_are_remembered_without_attributes():
    model, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    mark_parallelized(model, "state")
    assert parallelized_state(model) == "state" and parallelized_state(other) is None
    assert not [k for k in vars(model) if "parallel" in k]


def test_single_process_layout_is_trivial():
    layout, cfg = init_layout(TrainConfig(), distributed=False)
    assert type(layout) is Layout and not layout.distributed
    assert (layout.rank, layout.world_size, layout.dp_size, layout.tp_size) == (0, 1, 1, 1)
    assert layout.any_rank(True, "cpu") is True and layout.any_rank(False, "cpu") is False
    assert layout.all_gather_object({"a": 1}) == [{"a": 1}]
    model = torch.nn.Linear(2, 3)
    assert layout.prepare_model(model, cfg) is model
    assert list(layout.model_pieces(model)) == ["model/weight", "model/bias"]


def test_single_process_layout_refuses_parallel_sizes():
    cfg = TrainConfig()
    cfg.parallel.tensor_parallel = 2
    with pytest.raises(ConfigError, match=r"parallel.tensor_parallel=2: the single-process trainer runs one rank"):
        init_layout(cfg, distributed=False)


def test_missing_private_name_outside_the_written_range_is_one_line(monkeypatch):
    from packaging.version import Version

    class Optimizer:
        pass

    monkeypatch.setattr(deepspeed_compat, "installed_version", lambda: Version("0.30.0"))
    with pytest.raises(deepspeed_compat.DeepSpeedVersionError) as err:
        deepspeed_compat.private(Optimizer(), "_hp_mapping")
    message = str(err.value)
    assert "\n" not in message and "DeepSpeed 0.30.0" in message and "_hp_mapping" in message
    assert "pip install 'deepspeed>=0.19.8,<0.20'" in message
    # within the range a missing name is a bug: the AttributeError stays
    monkeypatch.setattr(deepspeed_compat, "installed_version", lambda: Version("0.19.8"))
    with pytest.raises(AttributeError):
        deepspeed_compat.private(Optimizer(), "_hp_mapping")
    assert deepspeed_compat.private(Optimizer(), "_hp_mapping", None) is None


def test_deepspeed_moe_marks_come_from_the_records():
    dense, expert = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    set_sharding(expert, Sharding(expert_group="ep_size_2"))
    assert deepspeed_compat.mark_expert_parameters([dense, expert]) == {"ep_size_2"}
    assert expert.allreduce is False and expert.group_name == "ep_size_2"
    assert not hasattr(dense, "allreduce") and not hasattr(dense, "group_name")
