"""The forward's position bound (positions < max_position_embeddings) without a host read where none
is needed: positions the forward makes are checked from T alone; given position_ids are read back
(`position_ids.max()`, a device synchronization on a GPU) unless the caller passes
`positions_checked=True`, as the trainer's step and probes do. Reads counted on the CPU with
`dsa_train.trainer.op_counts.StepCounts` (a TorchDispatchMode: `aten._local_scalar_dense`, i.e.
`int(t)` / `.item()`, and the `tolist` / `cpu` calls)."""

from __future__ import annotations

import pytest
import torch

from dsa_train.config import Attention, StageConfig, Trainable
from dsa_train.model import DSAForCausalLM, tiny_config
from dsa_train.stage import Stage
from dsa_train.trainer.op_counts import StepCounts
from dsa_train.trainer.probe import measure
from dsa_train.trainer.step import forward_backward

VOCAB, LIMIT = 256, 16
TRANSFORMER = "dsa_train/model/transformer.py"


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return DSAForCausalLM(tiny_config(vocab_size=VOCAB, num_hidden_layers=1, max_position_embeddings=LIMIT))


def ids(T: int, B: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(T))


def reads_in_forward(counts: StepCounts) -> int:
    """Host reads made by the forward's own code (the reference kernels' CPU-only reads aside)."""
    return sum(n for f, n in counts.read_files.items() if f.endswith(TRANSFORMER))


@torch.no_grad()
def test_given_positions_beyond_the_model_fail_in_one_line(model):
    pos = torch.arange(10, 18)[None]  # a continuation: positions 10 .. 17, 17 >= 16
    with pytest.raises(ValueError) as err:
        model(ids(8), position_ids=pos, compute_logits=False)
    msg = str(err.value)
    assert msg.startswith("position 17 is beyond max_position_embeddings=16; restart position_ids at 0")
    assert "\n" not in msg
    # within the bound: the same check reads the maximum once (on the CPU: no device to wait for)
    with StepCounts() as counts:
        model(ids(8), position_ids=torch.arange(8, 16)[None], compute_logits=False)
    assert reads_in_forward(counts) == 1


@torch.no_grad()
def test_positions_the_forward_makes_are_checked_from_the_length_without_a_read(model):
    with pytest.raises(ValueError) as err:
        model(ids(LIMIT + 4), compute_logits=False)
    msg = str(err.value)
    assert msg.startswith("a sequence of 20 tokens has positions up to 19, beyond max_position_embeddings=16; "
                          "pass at most 16 tokens per row") and "\n" not in msg
    with StepCounts() as counts:
        model(ids(LIMIT, B=2), compute_logits=False)  # positions 0 .. 15: the longest allowed
    assert reads_in_forward(counts) == 0
    # one packed row longer than the limit: only its documents' lengths bound the positions
    model(ids(LIMIT + 4), cu_seqlens=torch.tensor([0, 10, 20]), compute_logits=False)
    with pytest.raises(ValueError, match="^position 17 is beyond max_position_embeddings=16;"):
        model(ids(LIMIT + 4), cu_seqlens=torch.tensor([0, 18, 20]), compute_logits=False)


@torch.no_grad()
def test_positions_checked_by_the_caller_are_not_read(model):
    x, pos = ids(12, B=2), torch.cat([torch.arange(5), torch.arange(7)]).expand(2, 12)
    with StepCounts() as trusted:
        out = model(x, position_ids=pos, positions_checked=True)
    with StepCounts() as checked:
        ref = model(x, position_ids=pos)
    assert reads_in_forward(trusted) == 0 and reads_in_forward(checked) == 1
    assert trusted.reads_outside("/dsa_kernels/") == checked.reads_outside("/dsa_kernels/") - 1
    assert torch.equal(out.logits, ref.logits)


def test_the_trainers_step_and_probes_pass_their_positions_as_checked(model):
    """forward_backward (every trainer step: Trainer, selftest, memcheck, plan's trace) and the
    probes read no position back, whatever the number of micro-batches."""

    class Engine:  # what forward_backward needs of a TrainingEngine
        def forward(self, *args, **kwargs):
            return model(*args, **kwargs)

        def backward(self, loss):
            loss.backward()

    stage = Stage.of("warmup", StageConfig(attention=Attention.dense, trainable=Trainable.indexer,
                                           lm_loss_coef=0.0, indexer_loss_coef=1.0))
    stage.select_trainable(model)
    x = ids(LIMIT, B=3)
    batches = [{"input_ids": x[i:i + 1], "labels": x[i:i + 1], "position_ids": torch.arange(LIMIT)[None]}
               for i in range(3)]
    with StepCounts() as step:
        forward_backward(Engine(), batches, stage)
    with StepCounts() as probes:
        measure(model, batches, stage, torch.device("cpu"))
    assert reads_in_forward(step) == reads_in_forward(probes) == 0
    model.zero_grad(set_to_none=True)


def test_memcheck_refuses_a_sequence_beyond_its_model(capsys):
    """The memory check's step takes its positions unchecked (as the trainer's): a --seq-len beyond
    its model's positions is one line at start-up, before any process group or model exists."""
    from dsa_train.testing import memcheck

    with pytest.raises(SystemExit) as exit_info:
        memcheck.main(["--seq-len", str(memcheck.ARCH["max_position_embeddings"] + 1)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--seq-len 8193" in err and "pass --seq-len 1 .. 8192" in err, err
