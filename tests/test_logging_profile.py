"""logging.profile_steps: only the listed steps are profiled, each into one table file."""

from __future__ import annotations

import torch

from dsa_train.logging.profile import profile_path, profiled


def test_only_listed_steps_write_a_profile_table(tmp_path):
    x = torch.randn(64, 64, requires_grad=True)
    for step in (1, 2, 3):
        with profiled(step, [2], tmp_path, torch.device("cpu"), rank=0, trace=step == 2) as prof:
            (x @ x).sum().backward()
        assert (prof is not None) == (step == 2)
    table = profile_path(tmp_path, 2, 0, ".txt")
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["step_00000002.json.gz", table.name]
    text = table.read_text()
    assert "global step 2" in text and "by self CPU time" in text and "aten::mm" in text
    assert profile_path(tmp_path, 2, 3, ".txt").name == "step_00000002_rank3.txt"
