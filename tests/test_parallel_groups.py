"""Process groups at scale (issue 19): the groups rank 0 of the 1024-rank sparse layout
(recipes v3.2_sparse: TP 1, CP 32, EP 256, DP 32) creates, built by the start-up's own code
(`init_parallel`, the layout's checkpoint group) on torch's `fake` backend in one process, and the
gloo meshes they would open on a GPU cluster: before issue 19 every group inherited the world's
`cpu:gloo,cuda:nccl` (an eager gloo mesh per group); now the world and megatron-core's groups are
NCCL only and one gloo group exists, created at the first checkpoint."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from dsa_train.config import load_recipe
from dsa_train.parallel.groups import (
    CPU_GROUP_DESC, MIXED_BACKEND, destroy_parallel, init_parallel, process_group_args, world_backend,
)
from dsa_train.parallel.layout import DistributedLayout

WORLD, RANK = 1024, 0


def _gloo_meshes(created, world_string: str, world: int) -> tuple[int, int]:
    """(gloo meshes, gloo peer connections) this rank opens for the world and the groups it joins,
    when the world's backend string is `world_string`. A group asked for without a backend
    inherits the world's; the CPU group asks for gloo (for `fake` on this fake world)."""
    meshes, peers = 0, 0
    groups = [(list(range(world)), world_string)]  # the world itself
    groups += [(ranks, "gloo" if desc == CPU_GROUP_DESC else (backend or world_string)) for ranks, backend, desc in created]
    for ranks, backend in groups:
        if RANK in ranks and "gloo" in backend and len(ranks) > 1:
            meshes += 1
            peers += len(ranks) - 1  # gloo connects every pair of a group at its creation
    return meshes, peers


def test_1024_rank_layout_opens_one_gloo_mesh_and_only_at_the_first_checkpoint(monkeypatch):
    cfg = load_recipe("v3.2_sparse", ["data.sources=[/data/x.jsonl]"])
    created: list[tuple[list[int], str | None, str | None]] = []
    new_group = dist.new_group

    def recording_new_group(*args, **kwargs):  # the real new_group, its arguments recorded
        ranks = kwargs.get("ranks", args[0] if args else None)
        created.append((list(range(WORLD)) if ranks is None else list(ranks), kwargs.get("backend"), kwargs.get("group_desc")))
        return new_group(*args, **kwargs)

    monkeypatch.setattr(dist, "new_group", recording_new_group)
    dist.init_process_group("fake", store=FakeStore(), rank=RANK, world_size=WORLD)
    try:
        state = init_parallel(cfg.parallel)  # the start-up's groups (the world exists: not re-initialized)
        layout = DistributedLayout(state, cfg.parallel.zero_stage, cfg.data.micro_batch_size)
        at_start = list(created)
        checkpoint_group = layout.checkpoint_group
        assert layout.checkpoint_group is checkpoint_group  # made once
        cpu_groups = created[len(at_start):]
    finally:
        destroy_parallel()
    assert state.sizes.world == WORLD and state.sizes.context == 32 and state.sizes.expert == 256
    # megatron-core asks for no backend: its groups are whatever the world is (NCCL only on GPUs)
    assert all(backend is None for _, backend, _ in at_start), {b for _, b, _ in at_start}
    joined = [ranks for ranks, _, _ in at_start if RANK in ranks]
    nccl = world_backend(True)
    start = _gloo_meshes(at_start, nccl, WORLD)
    after_checkpoint = _gloo_meshes(at_start + cpu_groups, nccl, WORLD)
    # before issue 19: the world `cpu:gloo,cuda:nccl`, every group a gloo mesh, the checkpoint
    # group made at start-up
    before = _gloo_meshes(at_start + cpu_groups, MIXED_BACKEND, WORLD)
    print(f"1024-rank v3.2_sparse, rank {RANK}: {len(at_start)} new_group calls, {len(joined)} groups joined "
          f"(sizes {sorted(len(r) for r in joined)}); gloo meshes / peer connections: before {before}, "
          f"now {start} at start-up and {after_checkpoint} after the first checkpoint")
    assert start == (0, 0)
    assert len(cpu_groups) == 1 and after_checkpoint == (1, WORLD - 1)
    assert before[0] > 10 * after_checkpoint[0] and before[1] > 5 * after_checkpoint[1]


def test_process_group_arguments_bind_the_device_on_gpus_only():
    gpu = process_group_args(True, local_rank=3)
    assert gpu == {"backend": "nccl", "device_id": torch.device("cuda", 3)}
    assert process_group_args(False, local_rank=3) == {"backend": "gloo"}
