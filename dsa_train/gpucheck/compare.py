"""One comparison of a kernel's output with its reference, for every gpu-check check that compares
(correctness.*, end-to-end.grouped_experts): the relative-to-scale error, non-finite entries matched
exactly, NaN a failure."""

from __future__ import annotations

import math

import torch

COMPARE_CHUNK = 1 << 24  # elements per chunk of `compare` (its temporaries: a few of this size)


def compare(got: torch.Tensor, ref: torch.Tensor, tol: float, chunk: int = COMPARE_CHUNK) -> dict:
    """Relative-to-scale error of `got` against `ref` (same shape). Non-finite reference entries
    (-inf lse of an empty row, masked scores) must be matched exactly; NaN anywhere fails.
    One pass over `chunk`-element pieces: no full-size copy of either tensor (at T = 128K a dense
    gradient has 3.2e9 elements; whole-tensor fp32 / fp64 copies took up to 10x its fp32 size)."""
    if got.shape != ref.shape:
        return {"err": math.inf, "tol": tol, "ok": False, "note": f"shape {tuple(got.shape)} != {tuple(ref.shape)}"}
    g_all, r_all = got.detach().reshape(-1), ref.detach().reshape(-1)
    nonfinite_ok, nan, any_finite = True, False, False
    scale, max_diff, diff_sq, ref_sq = 0.0, 0.0, 0.0, 0.0
    for i in range(0, g_all.numel(), chunk):
        g, r = g_all[i:i + chunk].float(), r_all[i:i + chunk].float()
        finite = torch.isfinite(r)
        if not bool(finite.all()):
            nonfinite_ok = nonfinite_ok and bool(torch.equal(g[~finite], r[~finite]))
        nan = nan or bool(torch.isnan(g).any())
        if not bool(finite.any()):
            continue
        any_finite = True
        g, r = g[finite], r[finite]
        diff = (g - r).abs_()
        scale = max(scale, float(r.abs().max()))
        max_diff = max(max_diff, float(diff.max()))
        diff_sq += float(diff.double().square_().sum())
        ref_sq += float(r.double().square_().sum())
    if not any_finite:
        return {"err": 0.0, "tol": tol, "ok": nonfinite_ok and not nan, "rel_l2": 0.0}
    scale = max(scale, 1e-30)
    err = max_diff / scale if not nan else math.inf
    rel_l2 = math.sqrt(diff_sq) / max(math.sqrt(ref_sq), 1e-30)
    return {"err": err, "tol": tol, "ok": err <= tol and nonfinite_ok and not nan and math.isfinite(err),
            "rel_l2": rel_l2, "scale": scale, **({} if nonfinite_ok else {"note": "non-finite entries differ"})}
