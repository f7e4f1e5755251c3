"""Launchers the tests share: a free TCP port for a rendezvous, and the distributed self-test
(`dsa_train.testing.selftest`) run under torchrun on this machine."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_selftest(nproc: int, args: list[str], out_path: str, timeout: float = 400) -> tuple[int, list[dict], str]:
    """Run `python -m dsa_train.testing.selftest ARGS` under torchrun with `nproc` ranks on the CPU
    (gloo, DeepSpeed's CPU accelerator) -> (exit code, rank 0's JSON results, the log's tail)."""
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"), "OMP_NUM_THREADS": "1",
           "DSA_STRICT_DEVICES": os.environ.get("DSA_STRICT_DEVICES", "1")}  # collectives checked (strict_devices)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={free_port()}", "-m", "dsa_train.testing.selftest", *args, "--out", out_path]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    results = []
    if os.path.exists(out_path):
        with open(out_path) as f:
            results = [json.loads(line) for line in f if line.strip()]
    return proc.returncode, results, proc.stdout[-6000:] + proc.stderr[-6000:]
