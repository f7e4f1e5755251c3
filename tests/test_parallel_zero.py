"""DeepSpeed ZeRO-0/1/2/3 data parallel (2 ranks, CPU, gloo) == one process over the same global batch:
per-step LM loss, indexer loss and grad norm, the last step's gradients and the final parameters."""

import pytest

from dsa_train.config import ConfigError, ParallelConfig, resolve_sizes
from tests.helpers import launch_selftest



@pytest.mark.integration
@pytest.mark.slow
def test_zero_0_1_2_3_equal_single_process(tmp_path):
    rc, results, log = launch_selftest(2, ["--zero", "0,1,2,3", "--steps", "3", "--global-batch", "4"], str(tmp_path / "r.jsonl"))
    assert rc == 0, log
    assert [r["layout"]["zero"] for r in results] == [0, 1, 2, 3]
    for r in results:
        assert r["layout"]["dp"] == 2 and not r["failures"], r
        assert r["worst"]["loss"] < 2e-4 and r["worst"]["param"] < 1e-5 and r["worst"]["grad"] < 1e-3, r
        assert len(r["losses"]) == 3


@pytest.mark.integration
@pytest.mark.slow
def test_bf16_zero_1_2_close_to_single_process_bf16(tmp_path):
    # bf16 parameters, fp32 masters on both sides; per-step losses and grad norms within 1%
    rc, results, log = launch_selftest(2, ["--zero", "1,2", "--bf16", "--rtol", "1e-2"], str(tmp_path / "r.jsonl"))
    assert rc == 0, log
    assert len(results) == 2 and all(not r["failures"] for r in results), results
    assert all(r["worst"]["loss"] < 1e-2 for r in results)


def test_sizes_validated_against_world():
    assert resolve_sizes(ParallelConfig(tensor_parallel=2, context_parallel=2, expert_parallel=2), 8).data == 2
    with pytest.raises(ConfigError, match="world size 6 is not divisible by .*tensor_parallel \\* parallel.context_parallel = 2 \\* 2"):
        resolve_sizes(ParallelConfig(tensor_parallel=2, context_parallel=2), 6)
    with pytest.raises(ConfigError, match="set parallel.data_parallel=2"):
        resolve_sizes(ParallelConfig(tensor_parallel=2, data_parallel=4), 4)
    with pytest.raises(ConfigError, match="expert_parallel=4 must divide"):
        resolve_sizes(ParallelConfig(tensor_parallel=2, expert_parallel=4), 4)


@pytest.mark.integration
@pytest.mark.slow
def test_mtp_loss_data_parallel_equals_single_process(tmp_path):
    # the MTP loss is token-weighted over the global batch like the LM loss (rows hold 1-3
    # documents, so the ranks' valid-label counts differ and a per-rank mean would not match)
    rc, results, log = launch_selftest(2, ["--zero", "0,2", "--mtp", "--steps", "2"], str(tmp_path / "r.jsonl"))
    assert rc == 0, log
    assert len(results) == 2 and all(not r["failures"] for r in results), [r["failures"] for r in results]
    assert all(r["worst"]["loss"] < 2e-4 and r["worst"]["param"] < 5e-5 for r in results), [r["worst"] for r in results]


def test_gradient_reduction_config_per_zero_stage():
    """ZeRO-0/1 reduce once per step (in step(), the caller's boundary): no overlap. ZeRO-2 reduces
    every micro-batch into its partition, overlapped with the backward; bf16 gradients go over the
    wire in fp32 unless asked otherwise (the measured choice: docs/distributed.md, "Gradient reduction")."""
    from dsa_train.trainer.deepspeed_engine import deepspeed_config

    def cfg(zero, **kw):
        return deepspeed_config(zero, micro_batch_size=1, dp_size=2, bf16=True, grad_clip=1.0, **kw)

    assert cfg(2)["zero_optimization"]["overlap_comm"] is True and cfg(2)["managed_gradient_accumulation"] is False
    assert cfg(1)["zero_optimization"]["overlap_comm"] is False  # DeepSpeed: overlap only with partitioned gradients
    assert cfg(2)["communication_data_type"] == "fp32" and cfg(2)["data_types"]["grad_accum_dtype"] == "fp32"
    assert cfg(2, reduce_fp32=False)["communication_data_type"] == "bf16"
    assert "communication_data_type" not in cfg(2, grad_fp32=False)  # bf16 accumulation: bf16 reduce
