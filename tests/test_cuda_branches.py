"""Code that only a CUDA run executes, run on the CPU: the routed experts' loop path (fp32 on
CUDA: no grouped GEMM there) with the host counts expert parallelism gives it."""

import pytest
import torch

from dsa_train.model import grouped_experts as ge
from dsa_train.model import moe
from dsa_train.trainer.op_counts import StepCounts


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


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
