"""Suite-wide settings.

DSA_STRICT_DEVICES=1: every multi-rank run the suite launches (torchrun subprocesses inherit the
environment) checks that each collective's tensors are on the compute device, so a collective
that NCCL would reject on a GPU fails here on the CPU (`dsa_train.parallel.strict_devices`).
Set DSA_STRICT_DEVICES=0 in the environment to switch it off.
"""

import os

os.environ.setdefault("DSA_STRICT_DEVICES", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _restore_deterministic_mode():
    """A test that trains in-process with `deterministic: true` switches on
    torch.use_deterministic_algorithms for the whole process (dsa_train/engine/rng.py); restore the
    mode after every test so that later tests see the default (one did: the sparse-MLA backward
    then took its deterministic path)."""
    enabled, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
