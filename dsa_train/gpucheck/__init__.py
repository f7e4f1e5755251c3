"""`dsa-train gpu-check`: one command that proves and measures the CUDA path (see docs/gpu-check.md)."""
