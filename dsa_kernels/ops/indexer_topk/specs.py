"""Indexer score and top-k launches at the 671B shapes (the last query chunk of a 128K row,
whose key window is the whole row), for the compile report."""

from __future__ import annotations

import torch

from ...analysis import Work
from ...registry import SHAPES_671B, KernelCase, register
from ..._triton_common import target_capability
from .composite import COMPOSITE_BUDGET_ELEMS, plan_composite_keys
from .quant import plan_fp8_quant
from .kernel import (DEFAULT_SCORE_BUDGET, SCORE_CONFIG_SPACE, candidate_buffers, plan_scores, plan_select,
                     gluon_scores_work, score_config_space, scores_work, select_config_space, select_work)
from .repair import count_work, plan_count_ties, plan_topk_repair, repair_work


def _chunk():
    s = SHAPES_671B
    B, T = s["B"], s["T"]
    C = max(1, min(T, DEFAULT_SCORE_BUDGET // (B * T)))  # the driver's chunk size
    return B, T, C, T - C, T, 0


def _config(launch) -> str:
    a = launch.args
    keys = [k for k in a if k.startswith("BLOCK") or k in ("FP8", "KEY_SPAN", "DIGIT_BITS", "PASSES", "CAP", "TILE", "STAGES")]
    if launch.args.get("KEYS_MAJOR"):
        keys.append("KEYS_MAJOR")
    return " ".join(f"{k}={a[k]}" for k in keys) + f" warps={launch.num_warps} grid={launch.grid}"


@register("indexer_scores")
def _scores():
    s = SHAPES_671B
    B, T, C, q0, q1, k0 = _chunk()
    meta = dict(device="meta")
    k = torch.empty(B, T, s["D_I"], dtype=torch.bfloat16, **meta)
    w = torch.empty(B, T, s["H_I"], dtype=torch.float32, **meta)
    ds = torch.empty(B, T, dtype=torch.int64, **meta)
    scores = torch.empty(B, C, q1 - k0, dtype=torch.float32, **meta)
    pos = torch.empty(T, dtype=torch.int32, **meta)
    cases = []
    q = torch.empty(B, T, s["H_I"], s["D_I"], dtype=torch.bfloat16, **meta)
    q8 = torch.empty(B, T, s["H_I"], s["D_I"], dtype=torch.float8_e4m3fn, **meta)
    k8 = torch.empty(B, T, s["D_I"], dtype=torch.float8_e4m3fn, **meta)
    qs = torch.empty(B, T, s["H_I"], 1, dtype=torch.float32, **meta)
    ks = torch.empty(B, T, 1, dtype=torch.float32, **meta)
    scores16 = torch.empty(B, C, q1 - k0, dtype=torch.bfloat16, **meta)  # score_dtype=torch.bfloat16
    for i, (name, _) in enumerate(SCORE_CONFIG_SPACE):  # every config of the autotuning space
        label = "" if i == 0 else f"autotune config {name} "
        launch = plan_scores(q, k, w, ds, scores, pos, q0, q1, k0, config=name)
        cases.append(KernelCase("bf16 " + label + _config(launch), launch, work=scores_work(launch)))
        launch = plan_scores(q8, k8, w, ds, scores, pos, q0, q1, k0, qs, ks, config=name)
        cases.append(KernelCase("fp8 " + label + _config(launch), launch, work=scores_work(launch)))
        launch = plan_scores(q, k, w, ds, scores16, pos, q0, q1, k0, config=name)
        cases.append(KernelCase("bf16 q/k, bf16 score block " + label + _config(launch), launch,
                                work=scores_work(launch)))
    # the FP8 path's quantization of q_I (and k_I, the same kernel over fewer rows), fp32 and ue8m0 scales
    for ue8m0 in (False, True):
        q2 = q.view(B * T * s["H_I"], s["D_I"])
        q8_bits = torch.empty(B * T * s["H_I"], s["D_I"], dtype=torch.uint8, **meta)
        launch = plan_fp8_quant(q2, q8_bits, qs.view(B * T * s["H_I"], 1), ue8m0)
        cases.append(KernelCase(f"q_I to e4m3, {'ue8m0' if ue8m0 else 'fp32'} scales " + _config(launch), launch,
                                work=quant_work(launch, s["H_I"])))
    # the Gluon kernel's configs on sm_90 (bf16 q/k only: FP8 stays on the Triton kernel)
    for name, kind in score_config_space(target_capability(q)):
        if kind != "gluon":
            continue
        for what, block in (("bf16 ", scores), ("bf16 q/k, bf16 score block ", scores16)):
            launch = plan_scores(q, k, w, ds, block, pos, q0, q1, k0, config=name)
            cases.append(KernelCase(f"{what}autotune config {name} " + _config(launch), launch,
                                    work=gluon_scores_work(launch)))
    return cases


@register("indexer_topk")
def _topk():
    s = SHAPES_671B
    B, T, C, q0, q1, k0 = _chunk()
    meta = dict(device="meta")
    idx = torch.empty(B, C, s["K"], dtype=torch.int32, **meta)
    val = torch.empty(B, C, s["K"], dtype=torch.float32, **meta)
    cand_idx, cand_val, bin_count = candidate_buffers(B, C, device="meta")
    cases = []
    for dtype, name in ((torch.float32, "fp32 scores "), (torch.bfloat16, "bf16 scores ")):
        scores = torch.empty(B, C, q1 - k0, dtype=dtype, **meta)
        # every config of the autotuning space for the target architecture (the gate checks each)
        for i, cfg in enumerate(select_config_space(target_capability(scores))):
            launch = plan_select(scores, idx, val, cand_idx, cand_val, bin_count, k0, s["K"], config=cfg)
            label = name + ("" if i == 0 else f"autotune config {cfg[0]} ")
            cases.append(KernelCase(label + _config(launch), launch, work=select_work(launch)))
        # the composite path's key pass (one slice of rows of the int64 block; then torch.topk)
        rows = min(B * C, max(1, COMPOSITE_BUDGET_ELEMS // (q1 - k0)))
        comp = torch.empty(rows, q1 - k0, dtype=torch.int64, **meta)
        launch = plan_composite_keys(scores.view(B * C, q1 - k0)[:rows], comp)
        cases.append(KernelCase(name + "composite int64 keys " + _config(launch), launch,
                                work=composite_work(launch)))
        # the repair path's kernel after torch.topk (k + 1 sorted picks of every row of the chunk)
        rows2 = scores.view(B * C, q1 - k0)
        picks_v = torch.empty(B * C, s["K"] + 1, dtype=dtype, **meta)
        picks_i = torch.empty(B * C, s["K"] + 1, dtype=torch.int64, **meta)
        launch = plan_topk_repair(rows2, picks_v, picks_i, idx.view(B * C, s["K"]), val.view(B * C, s["K"]),
                                  s["K"], k0)
        cases.append(KernelCase(name + "torch.topk repair " + _config(launch), launch, work=repair_work(launch)))
        # the repair-count path: k picks, the tie count pass, the repair kernel told by the counts
        picks_v = torch.empty(B * C, s["K"], dtype=dtype, **meta)
        picks_i = torch.empty(B * C, s["K"], dtype=torch.int64, **meta)
        counts = torch.empty(B * C, dtype=torch.int32, **meta)
        launch = plan_count_ties(rows2, picks_v, counts, s["K"])
        cases.append(KernelCase(name + "torch.topk tie count " + _config(launch), launch, work=count_work(launch)))
        launch = plan_topk_repair(rows2, picks_v, picks_i, idx.view(B * C, s["K"]), val.view(B * C, s["K"]),
                                  s["K"], k0, counts)
        cases.append(KernelCase(name + "torch.topk repair, counted ties " + _config(launch), launch,
                                work=repair_work(launch)))
    return cases


def quant_work(launch, rows_per_token: int) -> Work:
    """Per token of the FP8 quantization (`quant.py`): its rows (q_I: one per indexer head) of D
    channels read once, e4m3 values and one fp32 scale per 128 channels written; no FLOPs."""
    a = launch.args
    D, G = a["D"], a["G"]
    return Work(useful_flops=0.0, issued_flops=0.0, read_bytes=rows_per_token * D * a["X"].element_size(),
                write_bytes=rows_per_token * (D + 4 * G))


def composite_work(launch) -> Work:
    """Per query row of the composite key pass: its W scores read, W int64 composites written (then
    torch.topk reads them: not this launch); no FLOPs."""
    a = launch.args
    return Work(useful_flops=0.0, issued_flops=0.0, read_bytes=a["W_LEN"] * a["S"].element_size(),
                write_bytes=a["W_LEN"] * a["OUT"].element_size())
