"""The error the sparse-MLA tolerances (correctness.TOL) should expect on a GPU, emulated in PyTorch:
the kernel's bf16 roundings — P and dS rounded to bf16 as tensor-core operands, the outputs
rounded to bf16 — applied to an fp32 computation at the 671B dims on a few query rows, against the
plain fp32 computation on the same bf16 inputs. Evidence for the argument in docs/gpu-check.md
(not a check: the kernels' own arithmetic is what gpu-check measures).

    python -m dsa_train.gpucheck.emulate [--rows 16]
"""

from __future__ import annotations

import argparse

import torch


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.bfloat16().float()


def sparse_mla_errors(rows: int = 16, H: int = 128, D: int = 576, D_V: int = 512, K: int = 2048, T: int = 4096,
                      seed: int = 0) -> dict:
    """{output: (max err / max |ref|, relative L2)} for out, dq, dkv."""
    g = torch.Generator().manual_seed(seed)
    q = _bf16(torch.randn(rows, H, D, generator=g))
    kv = _bf16(torch.randn(T, D, generator=g))
    dout = _bf16(torch.randn(rows, H, D_V, generator=g))
    idx = torch.stack([torch.randperm(T, generator=g)[:K] for _ in range(rows)])  # [rows, K] distinct keys
    scale = D**-0.5

    def run(rounded: bool):
        r = _bf16 if rounded else (lambda x: x)
        ks = kv[idx]  # [rows, K, D]
        p = torch.softmax(torch.einsum("rhd,rkd->rhk", q, ks) * scale, -1)
        out = r(torch.einsum("rhk,rkd->rhd", r(p), ks[..., :D_V]))
        delta = (dout * out).sum(-1, keepdim=True)  # from the stored (bf16) output, as the kernel
        ds = r(p * (torch.einsum("rhd,rkd->rhk", dout, ks[..., :D_V]) - delta) * scale)
        dq = r(torch.einsum("rhk,rkd->rhd", ds, ks))
        dk = torch.einsum("rhk,rhd->rkd", ds, q)
        dk[..., :D_V] += torch.einsum("rhk,rhd->rkd", r(p), dout)
        dkv = r(torch.zeros(T, D).index_add_(0, idx.flatten(), dk.reshape(-1, D)))
        return {"out": out, "dq": dq, "dkv": dkv}

    exact, rounded = run(False), run(True)
    return {k: (float((rounded[k] - exact[k]).abs().max() / exact[k].abs().max()),
                float((rounded[k] - exact[k]).norm() / exact[k].norm())) for k in exact}


def main(argv: list[str] | None = None) -> int:
    from .correctness import TOL

    p = argparse.ArgumentParser(prog="python -m dsa_train.gpucheck.emulate", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=16)
    args = p.parse_args(argv)
    for name, (err, l2) in sparse_mla_errors(args.rows).items():
        tol = TOL["out" if name == "out" else "grad"]
        print(f"sparse MLA {name}: emulated error {err:.2g} (relative L2 {l2:.2g}); tolerance {tol:.2g}, "
              f"margin x{tol / err:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
