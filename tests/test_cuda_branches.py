"""Code that only a CUDA run executes, run on the CPU: the MoE layer's CUDA stream paths
(`HostCopy`: the routing counts copied into pinned memory without blocking; `SideStream`: the
shared experts on a side stream) with the device predicate forced and torch.cuda's stream API
replaced by a recorder, and the routed experts' loop path (fp32 on CUDA: no grouped GEMM there)
with the host counts expert parallelism gives it."""

import contextlib

import pytest
import torch

from dsa_train.model import grouped_experts as ge
from dsa_train.model import moe
from dsa_train.model.config import tiny_config
from dsa_train.trainer.op_counts import StepCounts


class _FakeStream:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait_stream(self, other):
        self.log.append(("wait_stream", self.name, other.name))

    def __repr__(self):
        return self.name


class _FakeCuda:
    """torch.cuda's stream API as a recorder: which stream is current, what waits on what, which
    tensor is marked used on which stream, what an event records and waits for."""

    def __init__(self, monkeypatch):
        self.log = []
        self.main = _FakeStream(self.log, "main")
        self.current = self.main
        self.sides = 0
        fake = self

        class Stream(_FakeStream):
            def __init__(self, device=None):
                fake.sides += 1
                super().__init__(fake.log, f"side{fake.sides}")

        class Event:
            def record(self, stream=None):
                fake.log.append(("event_record", (stream or fake.current).name))

            def synchronize(self):
                fake.log.append(("event_synchronize",))

        @contextlib.contextmanager
        def stream(s):
            saved, fake.current = fake.current, s
            fake.log.append(("enter", s.name))
            try:
                yield
            finally:
                fake.current = saved
                fake.log.append(("exit", s.name))

        def record_stream(t, s):
            fake.log.append(("record_stream", tuple(t.shape), s.name))

        def pinned_empty(shape, dtype):
            fake.log.append(("pinned_empty", tuple(shape)))
            return torch.empty(shape, dtype=dtype)

        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "stream", stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: fake.current)
        monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)
        monkeypatch.setattr(moe, "uses_cuda_streams", lambda t: True)
        monkeypatch.setattr(moe, "pinned_empty", pinned_empty)


def test_host_copy_waits_for_its_event_before_the_values_are_read(monkeypatch):
    cuda = _FakeCuda(monkeypatch)
    counts = torch.tensor([3, 0, 5, 2])
    copy = moe.HostCopy(counts, balanced=[1, 1, 1, 1])
    # into pinned memory, the event recorded on the stream the copy was queued on (the current one)
    assert cuda.log == [("pinned_empty", (4,)), ("event_record", "main")]
    assert copy.values() == [3, 0, 5, 2]
    assert cuda.log[-1] == ("event_synchronize",)  # waited for before the read


def _moe_layer():
    torch.manual_seed(0)
    cfg = tiny_config(num_hidden_layers=1)
    layer = moe.MoE(cfg)
    # the router's weight is made with torch.empty (a model's init or checkpoint fills it): left
    # so, it held whatever the allocator gave, NaN at times, and NaN outputs never compare equal
    torch.nn.init.normal_(layer.gate.weight, std=0.5)
    assert layer.shared_experts is not None
    return layer, cfg


def _forward_backward(layer, x):
    x = x.detach().clone().requires_grad_()
    layer.zero_grad()
    out = layer(x)
    out.square().sum().backward()
    return out.detach(), x.grad, [p.grad.clone() for p in layer.shared_experts.parameters()]


def test_shared_experts_on_a_side_stream_equal_the_cpu_order(monkeypatch):
    """The CUDA order (shared experts started before the dispatch, on a side stream that waits for
    the main stream; joined after the combine) gives the CPU path's output and gradients, and the
    side stream is joined and its tensors marked used as the caching allocator needs."""
    layer, cfg = _moe_layer()
    x = torch.randn(2, 5, cfg.hidden_size)
    want = _forward_backward(layer, x)

    cuda = _FakeCuda(monkeypatch)
    ran_on = []
    layer.shared_experts.register_forward_hook(lambda *_: ran_on.append(cuda.current.name))
    got = _forward_backward(layer, x)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    for g, w in zip(got[2], want[2]):
        torch.testing.assert_close(g, w, rtol=0, atol=0)

    assert ran_on == ["side1"]  # the shared experts ran with the side stream current
    tokens = (2 * 5, cfg.hidden_size)
    side = [e for e in cuda.log if "side1" in e]
    assert side == [
        ("wait_stream", "side1", "main"),  # the side stream starts after the work that made x
        ("enter", "side1"), ("exit", "side1"),
        ("record_stream", tokens, "side1"),  # x, made on main, read on the side stream
        ("wait_stream", "main", "side1"),  # the join, before main reads the shared output
    ]
    assert cuda.log.index(side[-1]) < cuda.log.index(("record_stream", tokens, "main"))  # the output, used on main
    # the dispatch's routing counts: one pinned copy, waited for once
    assert cuda.log.count(("event_synchronize",)) == 1


def test_expert_loop_with_host_counts_reads_nothing_back(monkeypatch):
    """fp32 experts on CUDA run the per-expert loop (`expert_gemm_path`: CUDA's grouped GEMM is
    bf16 only); under expert parallelism their token counts are already on the host. The loop
    slices with them: no offsets sent to the device and read back (a device synchronization per
    layer on a GPU). Counts on the device (one process) still take their one read."""
    monkeypatch.setattr(ge, "expert_gemm_path", lambda *a: "loop")
    torch.manual_seed(0)
    experts = [moe.MLP(16, 8) for _ in range(3)]
    counts = [2, 0, 5]
    x = torch.randn(sum(counts), 16)
    with StepCounts() as host:
        out = ge.grouped_experts(experts, x, counts)
    assert sum(host.reads.values()) == 0, host.reads
    with torch.no_grad():
        want = torch.cat([e(part) for e, part in zip(experts, x.split(counts))])
    torch.testing.assert_close(out.detach(), want, rtol=1e-5, atol=1e-6)
    with StepCounts() as host:
        again = ge.grouped_experts(experts, x, torch.tensor(counts))
    assert sum(host.reads.values()) == 1, host.reads
    torch.testing.assert_close(again, out, rtol=0, atol=0)


def test_zero0_gradient_norm_reads_the_host_once(monkeypatch):
    """ZeRO-0 fp32 (`DeepSpeedEngine.own_norm`) takes the norm of the reduced `p.grad` itself: the
    squared norms summed on the gradients' device, one host read for the norm (a read per
    parameter is a device synchronization per parameter on a GPU; on the CPU nothing shows it)."""
    from types import SimpleNamespace

    from dsa_train.trainer.deepspeed_engine import DeepSpeedEngine

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 3))
    model(torch.randn(2, 4)).square().sum().backward()
    params = list(model.named_parameters())
    engine = SimpleNamespace(model=model, trainable=params,
                             state=SimpleNamespace(sizes=SimpleNamespace(world=1, tensor=1, expert=1)))
    with StepCounts() as host:
        norm = DeepSpeedEngine.replica_grad_norm(engine)
    assert sum(host.reads.values()) == 1, host.reads
    want = torch.cat([p.grad.double().flatten() for _, p in params]).norm().item()
    assert norm == pytest.approx(want, rel=1e-12)


def test_unknown_gpu_peak_is_a_one_line_error(monkeypatch):
    """On a GPU whose peak FLOP/s the table lacks, without logging.peak_flops: a ConfigError naming
    the key and the fix (one line from the command line, not a traceback; a plain ValueError was a
    bug's traceback, and torchrun restarted it); the name lookup picks the H200 before the H20."""
    from dsa_train.errors import DSATrainError
    from dsa_train.logging import perf

    gpu = torch.device("cuda", 0)
    names = iter(["NVIDIA H200", "NVIDIA H20", "NVIDIA H100 80GB HBM3"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: next(names))
    assert [perf.peak_flops_per_device(gpu, None) for _ in range(3)] == [989.4e12, 148e12, 989.4e12]
    assert perf.peak_flops_per_device(gpu, 5e14) == 5e14  # configured: no lookup

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA RTX 6000 Ada Generation")
    with pytest.raises(DSATrainError, match=r"logging.peak_flops: no peak FLOP/s known for GPU "
                                            r"'NVIDIA RTX 6000 Ada Generation'.* — set logging.peak_flops="):
        perf.peak_flops_per_device(gpu, None)


@pytest.mark.integration
def test_trainer_checks_the_gpu_peak_before_it_reads_data(tmp_path, monkeypatch):
    """The peak FLOP/s error comes at start-up, before the data and the model (a 671B checkpoint
    takes minutes to load). About 1 s: the trainer stops at its fifth line."""
    from dsa_train.config import ConfigError, load_recipe
    from dsa_train.trainer import trainer as trainer_module

    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA RTX 6000 Ada Generation")
    cfg = load_recipe("demo", [f"run_dir={tmp_path / 'run'}"])
    monkeypatch.setattr(trainer_module, "resolve_device", lambda device: gpu)
    monkeypatch.setattr(trainer_module, "build_dataloader",
                        lambda *a, **k: pytest.fail("data read before the GPU's peak FLOP/s was known"))
    with pytest.raises(ConfigError, match="logging.peak_flops"):
        trainer_module.Trainer(cfg)


def test_a_rank_without_its_gpu_stops_with_one_line(monkeypatch):
    """NCCL start-up on a node that shows fewer GPUs than it runs ranks: one line naming LOCAL_RANK,
    the GPU count and the fix, before torch.cuda.set_device (whose "invalid device ordinal" is a
    traceback) or any process group."""
    import torch.distributed as dist

    from dsa_train.errors import DSATrainError
    from dsa_train.parallel import groups

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(groups, "uses_nccl", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail("set_device reached"))
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("process group started"))
    monkeypatch.setenv("LOCAL_RANK", "4")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    with pytest.raises(DSATrainError, match=r"^LOCAL_RANK=4: this node shows 4 GPU\(s\) \(CUDA_VISIBLE_DEVICES=0,1,2,3\)"
                                            r", one per rank — start at most 4 processes per node"):
        groups.init_distributed()
    groups.check_local_gpu(3)  # the last one there


def test_cuda_rng_states_restore_on_a_process_that_sees_fewer_gpus(monkeypatch):
    """A checkpoint's RNG states hold one CUDA generator state per GPU the saving rank saw; a resume
    whose ranks see fewer (one GPU per rank) restores the ones it has, not an index error (torch's
    `set_rng_state_all` indexes the device generators by position)."""
    from dsa_train.trainer import rng

    restored = []

    def set_rng_state_all(states):
        if len(states) > torch.cuda.device_count():
            raise IndexError("tuple index out of range")  # torch.cuda.default_generators[i]
        restored.extend(states)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", set_rng_state_all)
    saved = {"python": __import__("random").getstate(), "numpy": __import__("numpy").random.get_state(),
             "torch": torch.get_rng_state(), "cuda": [torch.full((16,), i, dtype=torch.uint8) for i in range(8)]}
    rng.load_rng_state(saved)
    assert len(restored) == 1 and torch.equal(restored[0], saved["cuda"][0])


def test_expert_weights_off_16_byte_alignment_get_an_aligned_copy():
    """A flat buffer whose experts sit off 16-byte alignment (a parameter of odd size before them)
    is not handed to the grouped GEMM as a view: CUDA's `_grouped_mm` refuses such an operand
    ("expected data_ptr to be aligned to 16 bytes"; the CPU kernel takes it, so only a GPU run
    would fail); the experts get the stacked copy. Aligned, they stay a view."""
    for lead, viewed in ((3, False), (8, True)):  # bf16 elements before the experts: 6 or 16 bytes
        flat = torch.randn(lead + 3 * 8 * 16, dtype=torch.bfloat16)
        weights = [flat[lead + i * 128 : lead + (i + 1) * 128].view(8, 16) for i in range(3)]
        stacked = ge.stacked_weights(weights)
        assert (stacked.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()) == viewed, lead
        assert stacked.data_ptr() % ge.GROUPED_MM_ALIGN_BYTES == 0
        torch.testing.assert_close(stacked, torch.stack(weights), rtol=0, atol=0)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
