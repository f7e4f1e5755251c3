"""gpu-check section `correctness`: every Triton kernel against its fp32 PyTorch reference.

The kernels run on bf16 inputs (the model's dtype) through the dispatchers the model calls
(`dsa_kernels.sparse_mla`, `indexer_topk`, `sparse_indexer_kl`, `dense_indexer_kl`,
`dense_attention`; index scores through `index_scores_triton`); the references get the same bf16
values and compute in fp32 (TF32 off). Errors are measured relative to the output's scale:
max |kernel - reference| / max |reference|, against the per-output tolerances in `TOL`
(the argument for each is in docs/gpu-check.md). Top-k is compared exactly.

Large T: sparse MLA compares a sample of query rows (`inputs.compared_rows`); its backward is
driven by an output gradient that is zero outside those rows, so dq outside them must be exactly
0 and dkv is the reference's over the sampled rows alone. Dense attention and the dense KL run
their reference one packed document at a time (documents do not interact), with documents of at
most 16K tokens at T = 128K (`dense_lengths`).
"""

from __future__ import annotations

import math

import torch

from .budget import skip_reason
from .compare import COMPARE_CHUNK, compare  # noqa: F401 - correctness.compare is what the checks call
from .core import Check, Options, Outcome
from .inputs import (
    compared_rows,
    cp_positions,
    dims_for,
    doc_lengths,
    doc_start_of,
    grid,
    randn,
    topk_lists,
)

# max |kernel - reference| / max |reference| allowed, per output (see docs/gpu-check.md)
TOL = {
    "out": 2.0**-6,  # attention outputs: bf16 rounding of P for the PV dot and of the output
    "lse": 2.0**-14,  # fp32 log-sum-exp of fp32-accumulated exact bf16 products
    "grad": 2.0**-5,  # dq, dkv, dk, dv: bf16 dS / P operands and one cancellation (dP - delta)
    "scores": 2.0**-12,  # index scores, bf16 inputs: exact products, fp32 accumulation
    "scores_fp8_deq": 2.0**-7,  # FP8 scores vs the FP8 reference (the same e4m3 inputs, fp32 sums in another order)
    "scores_fp8_exact": 2.0**-3,  # FP8 scores vs the exact bf16 scores (e4m3 has 3 mantissa bits)
    "kl": 2.0**-9,  # the KL value (relative error of the sum)
    "kl_grad": 2.0**-5,  # KL gradients (max, relative to scale)
    "kl_grad_l2": 2.0**-7,  # KL gradients (relative L2, the contract of tests/test_kernels_triton.py)
}


def _device(opts: Options) -> str:
    return "cuda" if opts.device == "cuda" else "cpu"


def _ref_chunk(opts: Options, rows: int) -> int | None:
    """Query rows per chunk of the fp32 references on a GPU (their defaults size chunks for a
    CPU's memory: a few rows at the 671B shapes, thousands of small launches); None on the CPU."""
    return rows if opts.device == "cuda" else None


def _max_abs_outside(x: torch.Tensor, rows: torch.Tensor, block: int = 4096) -> float:
    """max |x[:, t]| over the rows t not in `rows` (dim 1), a block of rows at a time (no full copy)."""
    keep = torch.ones(x.shape[1], dtype=torch.bool, device=x.device)
    keep[rows] = False
    out = 0.0
    for t0 in range(0, x.shape[1], block):
        sel = keep[t0 : t0 + block]
        if bool(sel.any()):
            out = max(out, float(x[:, t0 : t0 + block][:, sel].abs().max()))
    return out


def _outcome(results: dict, extra: dict | None = None, note: str = "") -> Outcome:
    """results: output name -> `compare` dict -> one Outcome, worst output first in the summary."""
    failed = [k for k, v in results.items() if not v["ok"]]
    parts = [f"{k} {v['err']:.2g}/{v['tol']:.2g}" + (f" ({v['note']})" if v.get("note") else "")
             for k, v in results.items()]
    summary = ("FAILED " + ", ".join(failed) + ": " if failed else "") + ", ".join(parts) + note
    return Outcome("fail" if failed else "pass", summary, {"outputs": results, **(extra or {})})


def _budget(T: int, base_s: float, per_4k_s: float):
    """Decorator of a check at T: skip (one line) when the command's deadline leaves less than
    its estimated seconds (`_need`); a CUDA out-of-memory at T >= 128K is a skip (the GPU does not
    hold it), below a failure."""
    need_s = _need(T, base_s, per_4k_s)

    def deco(fn):
        def run(opts: Options) -> Outcome:
            reason = skip_reason(opts, "correctness", need_s)
            if reason:
                return Outcome("skip", reason)
            torch.backends.cuda.matmul.allow_tf32 = False  # fp32 references in full fp32
            torch.backends.cudnn.allow_tf32 = False
            try:
                return fn(opts)
            except torch.cuda.OutOfMemoryError as err:
                big = T >= 131072
                msg = str(err).splitlines()[0][:160]
                return Outcome("skip" if big else "fail", f"out of GPU memory ({msg})"
                               + ("; this GPU does not hold this T" if big else ""))

        run.__name__ = getattr(fn, "__name__", "run")
        run.need_s = need_s  # budget.check_need_s
        return run

    return deco


def dense_lengths(T: int, d) -> list[int]:
    """Documents of the dense checks: as the sparse ones, except at the largest T (128K; 128 with
    --small) documents of d.dense_doc_max tokens (the fp32 reference's work is quadratic in the
    document length)."""
    return doc_lengths(T, d.dense_doc_max if T == d.seq_lens[-1] else None)


def _documents(lengths: list[int]):
    """(slice, start) of each packed document: the dense references run one document at a time
    (the mask makes documents independent)."""
    start = 0
    for n in lengths:
        yield slice(start, start + n), start
        start += n


def _need(T: int, base_s: float, per_4k_s: float) -> float:
    """Estimated GPU seconds of a check at T (set-up and reference + the part that grows with T);
    estimates until a GPU run measures them (report.json has every check's seconds)."""
    return base_s + per_4k_s * T / 4096


# ----------------------------------------------------------------------------- sparse MLA
def sparse_mla_bytes_per_query(d) -> int:
    """GPU bytes per query token of the sparse-MLA check: q and dq [H, D], out and dout [H, D_V]
    in bf16, lse, and the index list with its construction temporaries (~6 x K x 8 bytes)."""
    return 2 * d.H * (2 * d.D + 2 * d.D_V) + 4 * d.H + 48 * d.K


def largest_fitting_T(T: int, d, opts: Options) -> tuple[int, str]:
    """(T to run, note): T itself where its tensors fit the GPU's free memory (with 10% slack),
    else the largest multiple of 8192 that fits (still past 65,536, CUDA's grid-y limit, when it
    can be); the CPU runs T."""
    if opts.device != "cuda":
        return T, ""
    free, _ = torch.cuda.mem_get_info()
    per = sparse_mla_bytes_per_query(d)
    if T * per <= 0.9 * free:
        return T, ""
    fit = int(0.9 * free / per) // 8192 * 8192
    return fit, (f"; ran at T={fit}, the largest that fits: T={T} needs ~{T * per / 2**30:.0f} GiB, "
                 f"{free / 2**30:.0f} GiB free")


def sparse_mla_check(T_asked: int, cp: bool = False):
    def fn(opts: Options) -> Outcome:
        import dsa_kernels as K
        from dsa_kernels import sparse_mla_ref

        d, dev = dims_for(opts.small), _device(opts)
        T, fit_note = (T_asked, "") if cp else largest_fitting_T(T_asked, d, opts)
        if T <= 32768 < T_asked:
            return Outcome("skip", f"T={T_asked} does not fit this GPU{fit_note}")
        ds = doc_start_of(doc_lengths(T), dev)
        pos = cp_positions(T, dev) if cp else torch.arange(T, device=dev)
        Tq = pos.shape[0]
        idx = topk_lists(ds, pos, d.K, seed=T + 1)
        q = randn((1, Tq, d.H, d.D), dev, seed=T + 2).requires_grad_()
        kv = randn((1, T, d.D), dev, seed=T + 3).requires_grad_()
        scale = d.D**-0.5
        rows = compared_rows(Tq, d, ds, pos).to(dev)
        dout = torch.zeros(1, Tq, d.H, d.D_V, device=dev, dtype=torch.bfloat16)
        dout[:, rows] = randn((1, rows.shape[0], d.H, d.D_V), dev, seed=T + 4)

        out, lse = K.sparse_mla(q, kv, idx, scale, d.D_V)
        dq, dkv = torch.autograd.grad(out, (q, kv), dout)
        out_r, lse_r, dq_r = out[:, rows].float(), lse[:, rows], dq[:, rows].float()
        outside = _max_abs_outside(dq, rows) if rows.shape[0] < Tq else 0.0
        del out, lse, dq

        qs = q.detach()[:, rows].float().requires_grad_()
        kvf = kv.detach().float().requires_grad_()
        ro, rlse = sparse_mla_ref(qs, kvf, idx[:, rows], scale, d.D_V, chunk_size=_ref_chunk(opts, 64))
        rdq, rdkv = torch.autograd.grad(ro, (qs, kvf), dout[:, rows].float())
        res = {"out": compare(out_r, ro, TOL["out"]), "lse": compare(lse_r, rlse, TOL["lse"]),
               "dq": compare(dq_r, rdq, TOL["grad"]), "dkv": compare(dkv, rdkv, TOL["grad"])}
        if outside:
            res["dq_outside_rows"] = {"err": outside, "tol": 0.0, "ok": False, "note": "dout is 0 there"}
        gluon = _sparse_mla_gluon_forwards(q.detach(), kv.detach(), idx, scale, d.D_V, rows, ro, rlse)
        res.update(gluon)
        note = f"; Gluon forward {', '.join(sorted({k.split('_', 1)[1] for k in gluon}))}" if gluon else ""
        gluon_b = _sparse_mla_gluon_backwards(q.detach(), kv.detach(), idx, scale, d.D_V, rows, dout, rdq, rdkv)
        res.update(gluon_b)
        note += f"; Gluon backward {', '.join(sorted({k.split('_', 1)[1] for k in gluon_b}))}" if gluon_b else ""
        return _outcome(res, {"rows_compared": int(rows.shape[0]), "queries": Tq, "keys": T},
                        f"; {rows.shape[0]} of {Tq} rows compared{fit_note}{note}")

    return _budget(T_asked, 5.0, 0.5)(fn)


def _sparse_mla_gluon_forwards(q, kv, idx, scale, d_v, rows, ref_out, ref_lse, on_gpu: bool | None = None) -> dict:
    """Issue 31: each Gluon config of the forward's space for this call (sm_90 GPUs; none on the CPU
    or elsewhere: {}) run explicitly (forced, not autotuned) and compared on the same rows with the
    same fp32 reference and tolerances: {"out_<config>": compare, "lse_<config>": compare}. A config
    that fails to compile or launch is a failed output with its error."""
    from dsa_kernels.ops.sparse_mla import kernel as SM

    if not (q.is_cuda if on_gpu is None else on_gpu):
        return {}
    space = SM.fwd_space_for(q, kv, d_v)
    res = {}
    for name, cfg in space.items():
        if not SM.is_gluon_config(cfg):
            continue
        try:
            with torch.no_grad(), SM.force_fwd_config(name):
                import dsa_kernels as K

                out, lse = K.sparse_mla(q, kv, idx, scale, d_v)
            res[f"out_{name}"] = compare(out[:, rows].float(), ref_out, TOL["out"])
            res[f"lse_{name}"] = compare(lse[:, rows], ref_lse, TOL["lse"])
            del out, lse
        except torch.cuda.OutOfMemoryError:  # the largest T: the GPU holds one forward's outputs, not two
            res[f"out_{name}"] = _not_compared_out_of_memory(TOL["out"], "a second forward")
        except Exception as err:  # noqa: BLE001 - a compile / launch failure is this output's failure
            res[f"out_{name}"] = _failed_output(err, TOL["out"])
    return res


def _not_compared_out_of_memory(tol: float, what: str) -> dict:
    """An explicitly run config's output at the largest T when the GPU holds one run's outputs, not
    two: passed, with the reason it was not compared."""
    torch.cuda.empty_cache()
    return {"err": 0.0, "tol": tol, "ok": True, "note": f"not compared: out of GPU memory for {what} at this T"}


def _failed_output(err: Exception, tol: float) -> dict:
    """An explicitly run config that failed to compile or launch: a failed output naming the error."""
    msg = (str(err).strip().splitlines() or [""])[-1][:200]
    return {"err": math.inf, "tol": tol, "ok": False, "note": f"{type(err).__name__}: {msg}"}


def _sparse_mla_gluon_backwards(q, kv, idx, scale, d_v, rows, dout, ref_dq, ref_dkv,
                                on_gpu: bool | None = None) -> dict:
    """Issue 31: each Gluon config of the atomic backward's space for this call (sm_90 GPUs; none on
    the CPU or elsewhere: {}) run explicitly (forced, not autotuned: `force_bwd_config`) and compared
    with the same fp32 reference gradients and tolerance as the default path: {"dq_<config>": compare
    on the check's rows, "dkv_<config>": compare}. A config that fails to compile or launch is a failed
    output with its error."""
    from dsa_kernels.ops.sparse_mla import kernel as SM

    if not (q.is_cuda if on_gpu is None else on_gpu):
        return {}
    space = SM.bwd_space_for(q, kv, d_v, unmeasured=True)  # forced below: run with or without the opt-in
    res = {}
    for name, cfg in space.items():
        if not SM.is_gluon_config(cfg):
            continue
        try:
            import dsa_kernels as K

            qg, kvg = q.detach().requires_grad_(), kv.detach().requires_grad_()
            with SM.force_bwd_config(name):
                out, _ = K.sparse_mla(qg, kvg, idx, scale, d_v)
                dq, dkv = torch.autograd.grad(out, (qg, kvg), dout)
            del out
            res[f"dq_{name}"] = compare(dq[:, rows].float(), ref_dq, TOL["grad"])
            res[f"dkv_{name}"] = compare(dkv, ref_dkv, TOL["grad"])
            del dq, dkv
        except torch.cuda.OutOfMemoryError:  # the largest T: room for one backward's outputs, not two
            res[f"dq_{name}"] = _not_compared_out_of_memory(TOL["grad"], "a second backward")
        except Exception as err:  # noqa: BLE001 - a compile / launch failure is this output's failure
            res[f"dq_{name}"] = _failed_output(err, TOL["grad"])
    return res


# ----------------------------------------------------------------------------- index scores
def _score_configs(q, k, scores, fp8: bool) -> list[str]:
    """The score kernel's configs for this call, each to be run forced: the Triton ones, and on an sm_90
    GPU the Gluon ones (issue 31: `gluon_scores.py`, never run on a GPU before; forced here with or
    without DSA_KERNELS_GLUON_SCORES=1) where that kernel takes the call (bf16 q/k, not FP8)."""
    from dsa_kernels.ops.indexer_topk.kernel import score_space_for

    return score_space_for(q, k, scores, fp8, unmeasured=True)


def index_scores_check(T: int, fp8: bool):
    def fn(opts: Options) -> Outcome:
        from dsa_kernels.ops.indexer_topk import index_scores_fp8_ref, index_scores_ref
        from dsa_kernels.ops.indexer_topk.kernel import index_scores_triton

        d, dev = dims_for(opts.small), _device(opts)
        ds = doc_start_of(doc_lengths(T), dev)
        q = randn((1, T, d.H_I, d.D_I), dev, seed=T + 11)
        k = randn((1, T, d.D_I), dev, seed=T + 12)
        w = randn((1, T, d.H_I), dev, seed=T + 13, dtype=torch.float32, std=(d.H_I * d.D_I) ** -0.5)
        C = min(T // 2, 64)
        second = int(ds[0, T * 5 // 8]) - C // 2  # a block straddling the second document's start
        res = {}
        for name, (q0, q1) in {"last": (T - C, T), "doc": (second, second + C)}.items():
            got, k0 = index_scores_triton(q, k, w, ds, q0, q1, fp8=fp8)
            if fp8:  # against DeepSeek-V3.2's fp8_index order (dsa_kernels.ops.indexer_topk.fp8), both scale formats
                ref, rk0 = index_scores_fp8_ref(q, k, w, ds, q0, q1)
                exact, _ = index_scores_ref(q.float(), k.float(), w, ds, q0, q1)
                res[f"{name}_vs_fp8_reference"] = compare(got, ref, TOL["scores_fp8_deq"])
                res[f"{name}_vs_bf16"] = compare(got, exact, TOL["scores_fp8_exact"])
                got8, _ = index_scores_triton(q, k, w, ds, q0, q1, fp8=True, ue8m0=True)
                ref8, _ = index_scores_fp8_ref(q, k, w, ds, q0, q1, ue8m0=True)
                res[f"{name}_ue8m0_vs_fp8_reference"] = compare(got8, ref8, TOL["scores_fp8_deq"])
            else:
                ref, rk0 = index_scores_ref(q.float(), k.float(), w, ds, q0, q1)
                res[name] = compare(got, ref, TOL["scores"])
            for cfg in _score_configs(q, k, got, fp8)[1:]:  # each other config of the call's space, forced
                try:
                    got_c, _ = index_scores_triton(q, k, w, ds, q0, q1, fp8=fp8, config=cfg)
                    res[f"{name}_{cfg}"] = compare(got_c, ref, TOL["scores_fp8_deq" if fp8 else "scores"])
                    del got_c
                except Exception as err:  # noqa: BLE001 - a compile / launch failure is this output's failure
                    res[f"{name}_{cfg}"] = _failed_output(err, TOL["scores_fp8_deq" if fp8 else "scores"])
            if k0 != rk0:
                res[name + "_window"] = {"err": abs(k0 - rk0), "tol": 0, "ok": False, "note": "key window start"}
        return _outcome(res, {"rows": 2 * C, "fp8": fp8}, f"; {2 * C} rows x their key windows")

    return _budget(T, 2.0, 0.0)(fn)


# ----------------------------------------------------------------------------- top-k
def _run_topk(q, k, w, ds, K_, pos, cp: bool, select: str | None = None, overlap: bool = True):
    """The entry point (select None: the autotuned select), or the Triton driver with the select
    path forced (`kernel.SELECT_PATHS`); overlap: each chunk's select on a side stream beside the
    next chunk's scores (`indexer_topk/pipeline.py`; the entry point through DSA_INDEXER_OVERLAP)."""
    import os

    import dsa_kernels as K
    from dsa_kernels.ops.indexer_topk.pipeline import OVERLAP_ENV

    if select is not None:
        from dsa_kernels.ops.indexer_topk.kernel import indexer_topk_triton

        return indexer_topk_triton(q, k, w, ds, K_, query_positions=pos if cp else None, select=select,
                                   overlap=overlap)
    saved = os.environ.get(OVERLAP_ENV)
    os.environ[OVERLAP_ENV] = "1" if overlap else "0"
    try:
        if cp:
            return K.indexer_topk(q, k, w, ds, K_, query_positions=pos)
        return K.indexer_topk(q, k, w, ds, K_)
    finally:
        if saved is None:
            os.environ.pop(OVERLAP_ENV)
        else:
            os.environ[OVERLAP_ENV] = saved


def _same_without_overlap(got, q, k, w, ds, K_, pos, cp: bool, path) -> bool:
    """Whether the call with the overlap off (one stream) gives `got` bit for bit."""
    idx, val = _run_topk(q, k, w, ds, K_, pos, cp, path, overlap=False)
    return bool(torch.equal(idx, got[0]) and torch.equal(val, got[1]))


# the entry point, then each select path forced
TOPK_PATHS = (None, "radix", "composite", "fix-ties", "repair", "repair-count")


def _ref_topk(q, k, w, ds, K_, pos, rows, opts, full: bool):
    from dsa_kernels import indexer_topk_ref
    from dsa_kernels.ops.indexer_topk import indexer_topk_at_positions_ref

    if full:
        return indexer_topk_ref(q, k, w, ds, K_, chunk_size=_ref_chunk(opts, 64))
    return indexer_topk_at_positions_ref(q[:, rows], k, w[:, rows], ds, K_, pos[rows], chunk_size=_ref_chunk(opts, 64))


TOPK_NEAR_TIE = 2.0**-20  # random inputs: rows whose k-th and (k+1)-th scores differ by less (x scale) are not compared


def topk_check(T: int, cp: bool = False):
    """Two inputs. Grid values: every score is exact in fp32, so the kernel's selection must equal
    the reference's bit for bit, ties included (ties go to the lower key index); three query rows
    are zero (all their scores tie at 0) and must select the first k keys of their document.
    Random values (every mantissa bit in play, as real scores): the selected sets must be equal on
    every row whose k-th and (k+1)-th reference scores are apart by more than 2^-20 of the scale
    (the kernel and the reference sum in different orders), and the scores within 2^-12.
    Each input runs through the entry point (the autotuned select) and through each select path
    forced (the Triton radix select, torch.topk on composite keys, torch.topk on the scores with
    tied rows redone, torch.topk on the scores with one repair kernel, with k + 1 picks or with a
    tie count pass); the paths select from the same score block, so their outputs must also be
    identical to each other, near-ties included. Every run is repeated with the overlap off (each
    chunk's select on the caller's stream, not beside the next chunk's scores: `DSA_INDEXER_OVERLAP=0`):
    bit for bit the same outputs."""

    def fn(opts: Options) -> Outcome:
        d, dev = dims_for(opts.small), _device(opts)
        ds = doc_start_of(doc_lengths(T), dev)
        pos = cp_positions(T, dev) if cp else torch.arange(T, device=dev)
        Tq = pos.shape[0]
        tie_rows = torch.tensor([Tq - 1, Tq // 2, Tq // 3], device=dev)  # local rows, all scores 0
        rows = compared_rows(Tq, d, ds, pos).to(dev)
        rows = torch.unique(torch.cat([rows, tie_rows]))
        full = rows.shape[0] == Tq and not cp

        # grid values: exact
        q = grid((1, T, d.H_I, d.D_I), dev, seed=T + 21)[:, pos].clone()
        k = grid((1, T, d.D_I), dev, seed=T + 22)
        w = grid((1, T, d.H_I), dev, seed=T + 23, dtype=torch.float32)[:, pos].contiguous()
        q[:, tie_rows] = 0
        ridx, rval = _ref_topk(q, k, w, ds, d.K, pos, rows, opts, full)
        short = int(((ridx < 0).any(-1)).sum())
        # off the GPU the entry point runs the radix default (nothing is timed): not run twice
        paths = TOPK_PATHS if opts.device == "cuda" else (None, "composite", "fix-ties", "repair", "repair-count")
        # overlap on / off compared on every path; off the GPU (CPU streams do nothing, only the
        # issue order differs; tests/test_indexer_topk_overlap.py compares every path) on the
        # composite path only, to keep the interpreter run short
        overlap_paths = paths if opts.device == "cuda" else ("composite",)
        grid_res, overlap_same = {}, {}
        for path in paths:
            idx, val = _run_topk(q, k, w, ds, d.K, pos, cp, path)
            if path in overlap_paths:
                overlap_same[f"grid {path or 'entry'}"] = _same_without_overlap((idx, val), q, k, w, ds, d.K, pos,
                                                                               cp, path)
            got_i, got_v = idx[:, rows], val[:, rows]
            tie_bad = 0
            for r in tie_rows.tolist():  # the k lowest visible keys, ascending
                p = int(pos[r])
                start = int(ds[0, p])
                n = min(d.K, p - start + 1)
                want = torch.full((d.K,), -1, dtype=torch.int32, device=dev)
                want[:n] = torch.arange(start, start + n, device=dev, dtype=torch.int32)
                tie_bad += int(not torch.equal(idx[0, r], want))
            grid_res[path or "entry"] = {"rows_index_mismatch": int((got_i != ridx).any(-1).sum()),
                                         "rows_score_mismatch": int((got_v != rval).any(-1).sum()),
                                         "all_tie_rows_wrong": tie_bad, "rows_with_fewer_than_k": short}
            del idx, val, got_i, got_v
        del q, k, w

        # random values: equal sets away from near-ties, scores within tolerance
        q = randn((1, Tq, d.H_I, d.D_I), dev, seed=T + 24)
        k = randn((1, T, d.D_I), dev, seed=T + 25)
        w = randn((1, Tq, d.H_I), dev, seed=T + 26, dtype=torch.float32, std=(d.H_I * d.D_I) ** -0.5)
        ridx1, rval1 = _ref_topk(q, k, w, ds, d.K + 1, pos, rows, opts, full)  # one more: the margin
        ridx, rval = ridx1[..., : d.K], rval1[..., : d.K]
        scale = float(rval[torch.isfinite(rval)].abs().max().clamp_min(1e-30))
        kth, next_ = rval1[..., d.K - 1], rval1[..., d.K]
        clear = ~torch.isfinite(next_) | ((kth - next_) > TOPK_NEAR_TIE * scale)
        near = int((~clear).sum())
        rand_res, picks = {}, {}
        for path in paths:
            idx, val = _run_topk(q, k, w, ds, d.K, pos, cp, path)
            if path in overlap_paths:
                overlap_same[f"random {path or 'entry'}"] = _same_without_overlap((idx, val), q, k, w, ds, d.K, pos,
                                                                                 cp, path)
            got_i, got_v = idx[:, rows], val[:, rows]
            same_set = (torch.sort(got_i, -1).values == torch.sort(ridx, -1).values).all(-1)
            rand_res[path or "entry"] = {"rows_set_mismatch": int((clear & ~same_set).sum()),
                                         "near_tie_rows_not_compared": near,
                                         "scores": compare(got_v[clear], rval[clear], TOL["scores"])}
            picks[path] = idx
        # the paths select from the same score block: identical outputs on every row, near-ties too
        radix = picks.get("radix", picks[None])
        paths_equal = all(bool(torch.equal(radix, picks[p])) for p in TOPK_PATHS[2:])
        del picks

        metrics = {"rows_compared": int(rows.shape[0]), "queries": Tq, "grid": grid_res["entry"],
                   "random": rand_res["entry"], "paths": {"grid": grid_res, "random": rand_res,
                                                          "paths_equal_random": paths_equal},
                   "overlap_on_equals_off": overlap_same}
        overlap_ok = all(overlap_same.values())
        no_sync = _repair_without_host_sync(dev) if opts.device == "cuda" else None
        if no_sync is not None:  # reported, not gating: the repair path's design (no host sync), checked
            metrics["repair_path_host_sync_free"] = no_sync
            # a later layer's call: the same doc_start (and positions) tensors, read in the calls above
            # (`dsa_kernels.host_values`), the radix select: no host sync at all
            metrics["later_layer_host_sync_free"] = _without_host_sync(
                lambda: _run_topk(q, k, w, ds, d.K, pos, cp, "radix"))
        ok = paths_equal and overlap_ok and all(
            g["rows_index_mismatch"] == 0 and g["rows_score_mismatch"] == 0 and g["all_tie_rows_wrong"] == 0
            and r["rows_set_mismatch"] == 0 and r["scores"]["ok"] for g, r in zip(grid_res.values(), rand_res.values()))
        g, r = grid_res["entry"], rand_res["entry"]
        bad_paths = [p for p in grid_res if any(grid_res[p][x] for x in ("rows_index_mismatch", "rows_score_mismatch",
                                                                         "all_tie_rows_wrong"))
                     or rand_res[p]["rows_set_mismatch"] or not rand_res[p]["scores"]["ok"]]
        summary = (f"{'' if ok else 'MISMATCH: '}grid: {g['rows_index_mismatch']} index / {g['rows_score_mismatch']} "
                   f"score rows differ of {rows.shape[0]} ({short} with < k keys), all-tie rows "
                   f"{len(tie_rows) - g['all_tie_rows_wrong']}/{len(tie_rows)} take the lowest keys; random: "
                   f"{r['rows_set_mismatch']} sets differ ({near} near-tie rows not compared), scores "
                   f"{r['scores']['err']:.2g}/{r['scores']['tol']:.2g}; radix, composite, fix-ties, repair and "
                   "repair-count paths "
                   + ("exact too, equal to each other" if ok else f"failing: {bad_paths or 'none'}, equal to each "
                                                                   f"other: {paths_equal}"))
        summary += ("; overlap on = off bit for bit" if overlap_ok else
                    f"; OVERLAP ON != OFF: {[p for p, same in overlap_same.items() if not same]}")
        if no_sync is not None:
            summary += (f"; repair path {'without' if no_sync else 'WITH'} a host sync; a later layer's radix call "
                        f"{'without' if metrics['later_layer_host_sync_free'] else 'WITH'} one")
        return Outcome("pass" if ok else "fail", summary, metrics)

    return _budget(T, 5.0, 0.6)(fn)


def _without_host_sync(fn) -> bool:
    """Whether `fn()` runs under CUDA's sync debug mode "error" (a host sync raises)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return True
    except RuntimeError:
        return False
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _repair_without_host_sync(dev) -> bool:
    """Whether the repair selects (torch.topk + the kernel, with k + 1 picks or the tie count) run
    under CUDA's sync debug mode "error" (a host sync raises) on rows with ties across the k-th
    score and a NaN."""
    from dsa_kernels.ops.indexer_topk.repair import topk_repair

    s = torch.randn(1, 64, 4099, device=dev)
    s[0, :8, ::3] = 0.0
    s[0, 9, 5] = float("nan")
    for count in (False, True):
        topk_repair(s, 2048, 0, count=count)  # compiled before the check
    return _without_host_sync(lambda: [topk_repair(s, 2048, 0, count=count) for count in (False, True)])


# ----------------------------------------------------------------------------- indexer KL
def _indexer_inputs(d, Tq: int, T: int, dev, seed: int):
    qi = randn((1, Tq, d.H_I, d.D_I), dev, seed=seed)
    ki = randn((1, T, d.D_I), dev, seed=seed + 1)
    wi = randn((1, Tq, d.H_I), dev, seed=seed + 2, dtype=torch.float32, std=(d.H_I * d.D_I) ** -0.5)
    return qi, ki, wi


def _kl_results(kl, stats, grads, rkl, rstats, rgrads) -> dict:
    res = {}
    for name, a, b in (("kl", kl, rkl), ("kl_uniform", stats["kl_uniform"], rstats["kl_uniform"])):
        a, b = float(torch.as_tensor(a).detach()), float(torch.as_tensor(b).detach())
        err = abs(a - b) / max(abs(b), 1e-30)
        res[name] = {"err": err, "tol": TOL["kl"], "ok": err <= TOL["kl"] and math.isfinite(a), "value": a, "ref": b}
    for name, a, b in zip(("dq_I", "dk_I", "dw"), grads, rgrads):
        c = compare(a, b, TOL["kl_grad"])
        if c["ok"] and c["rel_l2"] > TOL["kl_grad_l2"]:
            c["ok"], c["note"] = False, f"relative L2 {c['rel_l2']:.2g} > {TOL['kl_grad_l2']:.2g}"
        res[name] = c
    return res


def sparse_kl_check(T: int, cp: bool = False):
    def fn(opts: Options) -> Outcome:
        import dsa_kernels as K
        from dsa_kernels import sparse_indexer_kl_ref

        d, dev = dims_for(opts.small), _device(opts)
        ds = doc_start_of(doc_lengths(T), dev)
        pos = cp_positions(T, dev) if cp else torch.arange(T, device=dev)
        Tq = pos.shape[0]
        idx = topk_lists(ds, pos, d.K, seed=T + 31)
        qm = randn((1, Tq, d.H, d.D), dev, seed=T + 32)
        kvm = randn((1, T, d.D), dev, seed=T + 33)
        scale = d.D**-0.5
        with torch.no_grad():
            _, lse = K.sparse_mla(qm, kvm, idx, scale, d.D_V)  # an input of the KL (the target's normalizer)
        qi, ki, wi = _indexer_inputs(d, Tq, T, dev, seed=T + 34)
        ins = [x.clone().requires_grad_() for x in (qi, ki, wi)]
        kl, stats = K.sparse_indexer_kl(*ins, idx, qm, kvm, lse, scale)
        grads = torch.autograd.grad(kl, ins)
        ref_ins = [x.float().requires_grad_() for x in (qi, ki, wi)]
        rkl, rstats = sparse_indexer_kl_ref(*ref_ins, idx, qm, kvm, lse, scale, chunk_size=_ref_chunk(opts, 128))
        rgrads = torch.autograd.grad(rkl, ref_ins)
        results = _kl_results(kl, stats, grads, rkl, rstats, rgrads)
        if opts.device == "cuda":  # on the CPU tests/test_kernels_kl_target.py covers both ways (interpreter)
            results.update(_kl_with_attention_target(ins, idx, qm, kvm, scale, d.D_V, rkl, rstats, rgrads))
        return _outcome(results, {"queries": Tq, "keys": T})

    return _budget(T, 3.0, 0.3)(fn)


def _kl_with_attention_target(ins, idx, qm, kvm, scale: float, d_v: int, rkl, rstats, rgrads) -> dict:
    """Issue 31: the sparse stage's KL with its target from the attention's forward
    (`sparse_mla(..., return_target=True)`), each way of forming it forced in turn (kernel.TARGET_CONFIGS;
    a way the chosen forward config lacks is left out), against the same reference. Outputs
    "<name> (<way>)". Nothing on the chunked CPU path (it returns no target)."""
    import os

    import dsa_kernels as K
    from dsa_kernels.ops.sparse_mla.kernel import TARGET_CONFIGS

    out = {}
    for how in TARGET_CONFIGS:
        before = os.environ.get("DSA_SPARSE_MLA_TARGET")
        os.environ["DSA_SPARSE_MLA_TARGET"] = how
        try:
            with torch.no_grad():
                _, lse, p_sum = K.sparse_mla(qm, kvm, idx, scale, d_v, return_target=True)
        except ValueError:  # e.g. "forward-pass" with a Gluon forward config
            continue
        finally:
            if before is None:
                os.environ.pop("DSA_SPARSE_MLA_TARGET", None)
            else:
                os.environ["DSA_SPARSE_MLA_TARGET"] = before
        if p_sum is None:
            break
        leaves = [x.detach().clone().requires_grad_() for x in ins]
        kl, stats = K.sparse_indexer_kl(*leaves, idx, qm, kvm, lse, scale, target=p_sum)
        grads = torch.autograd.grad(kl, leaves)
        out.update({f"{k} ({how})": v for k, v in _kl_results(kl, stats, grads, rkl, rstats, rgrads).items()})
    # tensor parallelism 2: each half of the heads' forward sums its own P, the two sums added (what
    # `TensorParallelHeads.sum_heads` all-reduces), the KL told the layer's head count
    H = qm.shape[2]
    if H % 2 == 0:
        with torch.no_grad():
            halves = [K.sparse_mla(qm[:, :, h : h + H // 2].contiguous(), kvm, idx, scale, d_v, return_target=True)
                      for h in (0, H // 2)]
        if halves[0][2] is not None:
            leaves = [x.detach().clone().requires_grad_() for x in ins]
            kl, stats = K.sparse_indexer_kl(*leaves, idx, qm[:, :, : H // 2], kvm, halves[0][1], scale,
                                            target=halves[0][2] + halves[1][2], heads=H)
            grads = torch.autograd.grad(kl, leaves)
            out.update({f"{k} (tp2 head shards)": v for k, v in _kl_results(kl, stats, grads, rkl, rstats, rgrads).items()})
    return out


def dense_kl_check(T: int):
    def fn(opts: Options) -> Outcome:
        import dsa_kernels as K
        from dsa_kernels import dense_indexer_kl_ref

        d, dev = dims_for(opts.small), _device(opts)
        lengths = dense_lengths(T, d)
        ds = doc_start_of(lengths, dev)
        qm = randn((1, T, d.H_MHA, d.D_MHA), dev, seed=T + 41)
        km = randn((1, T, d.H_MHA, d.D_MHA), dev, seed=T + 42)
        scale = d.D_MHA**-0.5
        qi, ki, wi = _indexer_inputs(d, T, T, dev, seed=T + 43)
        ins = [x.clone().requires_grad_() for x in (qi, ki, wi)]
        kl, stats = K.dense_indexer_kl(*ins, qm, km, scale, ds)
        grads = torch.autograd.grad(kl, ins)
        rkl, rklu = 0.0, 0.0
        rgrads = [torch.empty_like(x, dtype=torch.float32) for x in (qi, ki, wi)]
        for sl, s in _documents(lengths):
            doc_ins = [x[:, sl].float().requires_grad_() for x in (qi, ki, wi)]
            k_, st = dense_indexer_kl_ref(*doc_ins, qm[:, sl], km[:, sl], scale, ds[:, sl] - s,
                                          chunk_size=_ref_chunk(opts, 64))
            for g, gd in zip(rgrads, torch.autograd.grad(k_, doc_ins)):
                g[:, sl] = gd
            rkl, rklu = rkl + float(k_.detach()), rklu + float(st["kl_uniform"])
        res = _kl_results(kl, stats, grads, rkl, {"kl_uniform": rklu}, rgrads)
        return _outcome(res, {"documents": lengths})

    return _budget(T, 3.0, 0.3)(fn)


def dense_kl_cp_check(T: int):
    """The dense KL kernel at a query offset (a CP rank's two runs of queries over the whole
    sequence's keys, MQA form as the warm-up runs it under CP) against the same kernel over the whole
    sequence (checked against the reference by correctness.dense_indexer_kl.*) with w = 0 on the
    rows the rank does not hold (so they add nothing to dk_I): per-row KL, dq_I and dw of the run's
    rows, and dk_I summed over both runs."""

    def fn(opts: Options) -> Outcome:
        from dsa_kernels._triton_common import kernel_input
        from dsa_kernels.ops.indexer_kl.kernel import plan_dense_kl, plan_dense_lse

        d, dev = dims_for(opts.small), _device(opts)
        lengths = doc_lengths(T)
        ds = doc_start_of(lengths, dev)
        qm = kernel_input(randn((1, T, d.H, d.D), dev, seed=T + 71), None)
        km = kernel_input(randn((1, T, 1, d.D), dev, seed=T + 72), None)
        qi, ki, wi = (kernel_input(x, None) for x in _indexer_inputs(d, T, T, dev, seed=T + 73))
        wi = wi.float()
        scale = d.D**-0.5
        lse2 = torch.empty(1, d.H, T, dtype=torch.float32, device=dev)
        plan_dense_lse(qm, km, ds, lse2, scale).run()
        pos = cp_positions(T, dev)
        L = pos.numel() // 2
        runs = [int(pos[0]), int(pos[L])]

        def rows(q0: int, n: int, w):
            kl = torch.empty(1, n, dtype=torch.float32, device=dev)
            klu = torch.empty_like(kl)
            dq = torch.zeros(1, n, d.H_I, d.D_I, dtype=torch.float32, device=dev)
            dk = torch.zeros(1, T, d.D_I, dtype=torch.float32, device=dev)
            dw = torch.zeros(1, n, d.H_I, dtype=torch.float32, device=dev)
            sl = slice(q0, q0 + n)
            plan_dense_kl(qm[:, sl], km, qi[:, sl], ki, w[:, sl], ds, lse2[:, :, sl].contiguous(), kl, klu, dq, dk,
                          dw, scale, True, q0).run()
            return kl, klu, dq, dk, dw

        w_held = torch.zeros_like(wi)
        w_held[:, pos] = wi[:, pos]
        full = rows(0, T, w_held)
        got = [rows(a, L, wi) for a in runs]
        res = {}
        for i, name in enumerate(("kl", "kl_uniform", "dq_I")):
            res[name] = compare(torch.cat([g[i] for g in got], 1), torch.cat([full[i][:, a:a + L] for a in runs], 1),
                                TOL["kl_grad"] if name == "dq_I" else TOL["kl"])
        res["dw"] = compare(torch.cat([g[4] for g in got], 1), torch.cat([full[4][:, a:a + L] for a in runs], 1),
                            TOL["kl_grad"])
        res["dk_I"] = compare(got[0][3] + got[1][3], full[3], TOL["kl_grad"])
        return _outcome(res, {"documents": lengths, "runs": runs})

    return _budget(T, 3.0, 0.3)(fn)


# ----------------------------------------------------------------------------- dense attention
def dense_attention_check(T: int):
    def fn(opts: Options) -> Outcome:
        import dsa_kernels as K
        from dsa_kernels import dense_attention_ref

        d, dev = dims_for(opts.small), _device(opts)
        lengths = dense_lengths(T, d)
        ds = doc_start_of(lengths, dev)
        q = randn((1, T, d.H_MHA, d.D_MHA), dev, seed=T + 51).requires_grad_()
        k = randn((1, T, d.H_MHA, d.D_MHA), dev, seed=T + 52).requires_grad_()
        v = randn((1, T, d.H_MHA, d.DV_MHA), dev, seed=T + 53).requires_grad_()
        dout = randn((1, T, d.H_MHA, d.DV_MHA), dev, seed=T + 54)
        scale = d.D_MHA**-0.5
        out, lse = K.dense_attention(q, k, v, scale, ds)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        ref = {n: torch.empty(t.shape, device=dev, dtype=torch.float32)
               for n, t in (("out", out), ("lse", lse), ("dq", q), ("dk", k), ("dv", v))}
        for sl, s in _documents(lengths):
            ins = [x.detach()[:, sl].float().requires_grad_() for x in (q, k, v)]
            ro, rl = dense_attention_ref(*ins, scale, ds[:, sl] - s, chunk_size=_ref_chunk(opts, 64))
            rg = torch.autograd.grad(ro, ins, dout[:, sl].float())
            for name, t in zip(("out", "lse", "dq", "dk", "dv"), (ro, rl, *rg)):
                ref[name][:, sl] = t.detach()
        res = {"out": compare(out, ref["out"], TOL["out"]), "lse": compare(lse, ref["lse"], TOL["lse"])}
        for name, g in zip(("dq", "dk", "dv"), grads):
            res[name] = compare(g, ref[name], TOL["grad"])
        return _outcome(res, {"documents": lengths})

    return _budget(T, 3.0, 0.3)(fn)


# ----------------------------------------------------------------------------- the warm-up's frozen attention
def warmup_attention_check(T: int, cp: bool = False):
    """The dense warm-up's main attention forward (no gradient) with its lse against the fp32
    reference: `dense_attention_lse` (on CUDA torch's memory-efficient attention over packed
    documents) or, with cp, `mla_attention_rows` (a CP rank's two runs of queries over the latent of
    the whole sequence, up-projected block by block: fewer queries than keys)."""

    def fn(opts: Options) -> Outcome:
        from dsa_kernels import dense_attention_ref
        from dsa_kernels.ops.dense_attention import dense_attention_lse, library, mla_attention_rows

        d, dev = dims_for(opts.small), _device(opts)
        lengths = dense_lengths(T, d) if not cp else doc_lengths(T)
        ds = doc_start_of(lengths, dev)
        H, D, DV = d.H_MHA, d.D_MHA, d.DV_MHA
        rope = 64 if not opts.small else 8
        nope, R = D - rope, 512 if not opts.small else 32
        scale = D**-0.5
        q = randn((1, T, H, D), dev, seed=T + 61)
        if not cp:
            k, v = randn((1, T, H, D), dev, seed=T + 62), randn((1, T, H, DV), dev, seed=T + 63)
            out, lse = dense_attention_lse(q, k, v, scale, ds)
        else:
            latent, k_rope = randn((1, T, R), dev, seed=T + 64), randn((1, T, rope), dev, seed=T + 65)
            w_kv = randn((H * (nope + DV), R), dev, seed=T + 66, std=R**-0.5)
            k, v = library._up_project(latent, k_rope, w_kv, H, nope)
            pos = cp_positions(T, dev)
            L = pos.numel() // 2
            runs = [(0, int(pos[0]), L), (L, int(pos[L]), L)]
            parts = [mla_attention_rows(q[:, int(a):int(a) + n], latent, k_rope, w_kv, scale, ds, a, nope)
                     for _, a, n in runs]
            out, lse = torch.cat([o for o, _ in parts], 1), torch.cat([x for _, x in parts], 1)
        ref_out = torch.empty(1, T, H, DV, device=dev, dtype=torch.float32)
        ref_lse = torch.empty(1, T, H, device=dev, dtype=torch.float32)
        with torch.no_grad():
            for sl, s in _documents(lengths):
                ro, rl = dense_attention_ref(*(x[:, sl].float() for x in (q, k, v)), scale, ds[:, sl] - s,
                                             chunk_size=_ref_chunk(opts, 64))
                ref_out[:, sl], ref_lse[:, sl] = ro, rl
        if cp:
            ref_out, ref_lse = ref_out[:, pos], ref_lse[:, pos]
        res = {"out": compare(out, ref_out, TOL["out"]), "lse": compare(lse, ref_lse, TOL["lse"])}
        ran = library.LAST_BACKEND[0] if not cp else library.backend_for(q)
        extra, note = {"documents": lengths, "backend": ran}, f"; backend {ran}"
        if dev == "cuda" and ran == "efficient":  # reported, not gating: a later layer's call (same doc_start)
            later = (lambda: dense_attention_lse(q, k, v, scale, ds)) if not cp else (
                lambda: [mla_attention_rows(q[:, a:a + n], latent, k_rope, w_kv, scale, ds, a, nope) for _, a, n in runs])
            extra["later_layer_host_sync_free"] = free = _without_host_sync(later)
            note += f"; a later layer's call {'without' if free else 'WITH'} a host sync"
        return _outcome(res, extra, note=note)

    return _budget(T, 3.0, 0.3)(fn)


# ----------------------------------------------------------------------------- the list
def checks(opts: Options) -> list[Check]:
    d = dims_for(opts.small)
    out = []
    big = d.seq_lens[-1]
    for T in d.seq_lens:
        docs = "+".join(str(n) for n in doc_lengths(T))
        sample = "all rows" if T <= d.full_rows_max else f"~{d.sample_rows} sampled rows"
        dense_docs = dense_lengths(T, d)
        dd = "+".join(str(n) for n in dense_docs) if len(dense_docs) <= 4 else f"{len(dense_docs)}x{dense_docs[0]}"
        sm = f"T={T} H={d.H} D={d.D} D_V={d.D_V} k={d.K} docs {docs}"
        ix = f"T={T} H_I={d.H_I} d_I={d.D_I} docs {docs}"
        out += [
            Check(f"correctness.sparse_mla.T{T}", "correctness", f"{sm}; fwd out/lse + bwd dq/dkv, {sample}",
                  sparse_mla_check(T)),
            Check(f"correctness.index_scores_bf16.T{T}", "correctness", f"{ix}; 2 blocks of rows x key window; "
                                                                        f"autotuned and each config forced",
                  index_scores_check(T, fp8=False)),
            Check(f"correctness.index_scores_fp8.T{T}", "correctness", f"{ix}; e4m3 q/k, 128-channel scales (fp32 and ue8m0)",
                  index_scores_check(T, fp8=True)),
            Check(f"correctness.indexer_topk.T{T}", "correctness", f"{ix} k={d.K}; grid inputs exact (ties to the lower "
                                                                   f"index), random inputs same sets; entry point, "
                                                                   f"radix, composite, fix-ties, repair and "
                                                                   f"repair-count paths; overlap on = off "
                                                                   f"bitwise; {sample}", topk_check(T)),
            Check(f"correctness.sparse_indexer_kl.T{T}", "correctness",
                  f"{ix} k={d.K} H={d.H} D={d.D}; value + dq_I/dk_I/dw", sparse_kl_check(T)),
            Check(f"correctness.dense_indexer_kl.T{T}", "correctness",
                  f"T={T} H_I={d.H_I} d_I={d.D_I} MHA H={d.H_MHA} D={d.D_MHA} docs {dd}; value + grads",
                  dense_kl_check(T)),
            Check(f"correctness.dense_attention.T{T}", "correctness",
                  f"T={T} MHA H={d.H_MHA} q/k {d.D_MHA} v {d.DV_MHA} docs {dd}; out/lse + dq/dk/dv",
                  dense_attention_check(T)),
        ]
    cp = f"CP rank 1 of 4: {big // 4} queries over T={big} keys"
    out += [
        Check(f"correctness.sparse_mla.cp.T{big}", "correctness", f"{cp}, H={d.H} D={d.D} k={d.K}; fwd + bwd",
              sparse_mla_check(big, cp=True)),
        Check(f"correctness.indexer_topk.cp.T{big}", "correctness", f"{cp}, H_I={d.H_I} k={d.K}; exact / same sets; overlap on = off",
              topk_check(big, cp=True)),
        Check(f"correctness.sparse_indexer_kl.cp.T{big}", "correctness", f"{cp}, k={d.K}; value + grads",
              sparse_kl_check(big, cp=True)),
    ]
    first, mid = d.seq_lens[0], d.seq_lens[0] * 4
    out += [
        Check(f"correctness.warmup_attention.T{first}", "correctness",
              f"T={first} MHA H={d.H_MHA} q/k {d.D_MHA} v {d.DV_MHA}; frozen forward out/lse (library kernel)",
              warmup_attention_check(first)),
        Check(f"correctness.warmup_attention.cp.T{mid}", "correctness",
              f"CP rank 1 of 4: {mid // 4} queries over T={mid} keys, latent up-projected in blocks; out/lse",
              warmup_attention_check(mid, cp=True)),
        Check(f"correctness.dense_indexer_kl.cp.T{mid}", "correctness",
              f"CP rank 1 of 4: {mid // 4} queries at their offsets over T={mid} keys, MQA H={d.H} D={d.D}; "
              f"KL rows + grads vs the whole-sequence kernel", dense_kl_cp_check(mid)),
    ]
    from .fakes import custom_op_fakes_check  # the memory trace's stand-ins for the launchers (plan --trace)

    out.append(Check("correctness.custom_op_fakes", "correctness",
                     "T=9, every kernel custom op (dsa_kernels.custom_ops): fake outputs' shapes / dtypes == the "
                     "launcher's", custom_op_fakes_check))
    return out
