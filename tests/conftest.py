"""Suite-wide settings.

DSA_STRICT_DEVICES=1: every multi-rank run the suite launches (torchrun subprocesses inherit the
environment) checks that each collective's tensors are on the compute device, so a collective
that NCCL would reject on a GPU fails here on the CPU (`dsa_train.parallel.strict_devices`).
Set DSA_STRICT_DEVICES=0 in the environment to switch it off.
"""

import os

os.environ.setdefault("DSA_STRICT_DEVICES", "1")
