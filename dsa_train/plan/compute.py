"""The step's compute time per rank, from the stage's step FLOPs (`Stage.step_flops`).

Every part of the step (`dsa_train.model.step_flops`: the FLOPs users count beside the FLOPs and
bytes the CUDA path issues) is timed at max(its issued FLOPs at the MFU, its bytes at the HBM
bandwidth): matmul parts carry no bytes and run at the MFU; kernel parts (sparse MLA, the KL target,
the index scores and select, the KL kernels) run at whichever bound is slower, the compile report's
roofline with the plan's MFU in place of the peak. The kernels' bytes count every load the kernel
issues, L2 hits included (except the dense KL's shared key under CP): at the 671B shapes a lower
bound on their time where they are memory-bound, not a prediction (measured kernels:
docs/kernels.md, docs/gpu-check/).

The MFU the trainer would report at the planned step time is the model FLOPs (the same
`Stage.flops_per_token` the trainer divides) over the step time and the peak: below the assumed
MFU by what the step issues beyond the model count (recompute, the KL target, the index scores'
and kernels' extra work) and by the communication.
"""

from __future__ import annotations

HBM_BYTES_PER_S = 3.35e12  # H100 SXM HBM3 (`dsa_kernels.analysis.H100`), the default of --hbm-tbps


def compute_seconds(step, tokens_per_rank: float, peak_flops: float, mfu: float,
                    hbm_bytes_per_s: float = HBM_BYTES_PER_S, tensor: int = 1) -> dict:
    """Seconds per step of one rank for `step` (a `StepFlops`): per part, and in all.
    `tokens_per_rank`: the step's tokens over the world size. Under tensor parallelism (`tensor` > 1)
    a TP group's ranks hold the same tokens (tensor x tokens_per_rank): a part's TP-split share
    (`StepPart.tp_split`) is divided over them, the rest runs whole on every one of them."""
    rate = peak_flops * mfu
    parts = {}
    for name, p in step.parts.items():
        tokens = tokens_per_rank * (p.tp_split + tensor * (1.0 - p.tp_split))  # that part's tokens' worth
        flops_s = tokens * p.issued / rate
        bytes_s = tokens * p.hbm_bytes / hbm_bytes_per_s
        parts[name] = {"seconds": max(flops_s, bytes_s), "bound": "memory" if bytes_s > flops_s else "compute",
                       "model_flops": p.model, "issued_flops": p.issued, "hbm_bytes": p.hbm_bytes,
                       "recomputed_flops": p.recomputed, "tp_split": p.tp_split}
    return {"compute_s": sum(p["seconds"] for p in parts.values()), "parts": parts,
            "model_flops_s": tokens_per_rank * step.model / rate}
