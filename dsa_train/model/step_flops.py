"""One training step's FLOPs per token, part by part, in two columns: what users count (the MFU's
numerator) and what the step issues on CUDA (the plan's time).

    step_flops(cfg, seq_len, attention, topk, main_backward=..., lm_head=..., ...) -> StepFlops

`StepFlops.model` is the model FLOPs per token of docs/training.md's convention ("How FLOPs are
counted"): a multiply-add = 2 FLOPs, matmuls only, training = 3x the forward of what trains, the
indexer's projections and O(T^2) scores included; causal dense attention at FlashAttention's half
count, sparse attention at FlashMLA's k (576 + 512) per head. It equals the closed form
`dsa_train.model.flops.flops_per_token` (a test holds them together) and does not depend on the
layout: the trainer's `perf/mfu` divides it by the step's wall time (`Stage.flops_per_token`).

`StepFlops.issued` (and each part's `hbm_bytes`) counts what the CUDA path runs, the same path
`dsa-train plan --trace` traces; `dsa-train plan` times each part at max(issued FLOPs at the MFU,
bytes at the HBM bandwidth) (`dsa_train.plan.compute`). The kernels' FLOPs and bytes are the compile
report's analysis of the launches the launchers make at these shapes (each op's `specs.py`,
meta-device tensors, the default config of each autotuning space): issued FLOPs with every tile's
padding, bytes with every re-read; not measurements. Parts (summed over the layers):

Sparse training (kind "all", attention "sparse"; report eq. 4):
  attention_projections  q_a / q_b / kv_a / kv_b / o_proj: forward, input and weight gradients (x3),
                         + 1 forward where the recompute covers the attention
  mlp / moe              dense MLPs / the active experts, shared experts and router: x3, + 1 forward
                         where the recompute re-runs them (full; moe for MoE layers)
  lm_head                x3
  absorption             q_nope W_UK and the latent output's W_UV (MQA form): x3 (+ recompute)
  sparse_mla_forward     the sparse MLA forward kernel over each query's k_t = min(t + 1, k) slots
                         (model: 2 H k_t (576 + 512)); again in the recompute
  sparse_mla_backward    its backward kernel (model: 2x the forward, the convention; the kernel
                         issues S, dP, dq, dkv: 2 H k_t (3 x 576 + 2 x 512) and more)
  kl_target              Sigma_h P per selected slot, formed after the forward from its lse (the
                         target kernel, the default; docs/kernels.md "The sparse KL's target from
                         the sparse MLA forward"); again in the recompute (it re-runs the forward)
  index_scores           the indexer's scores over every causal key (model: 2 H_I d_I + 2 H_I per
                         key, the indexer's forward); the recompute scores again only in layers
                         whose top-k indices the memo did not keep (`indexer_topk.memo`)
  select                 the top-k select over the score rows: no FLOPs, its bytes (radix default)
  sparse_kl              the sparse KL's statistics pass (forward; again in the recompute) and its
                         gradient pass (backward) over the k selected slots (model: the backward of
                         the indexer's scores at the k_t selected slots, 2 x (2 H_I d_I + 2 H_I) per
                         slot: eq. 4 differentiates only those)
  indexer_projections    wq_b / wk / weights_proj: forward and weight gradients (the input is
                         detached: no input gradient); model x3 (the convention)
Not counted: norms, RoPE, softmax, routing and the optimizer (elementwise); the top-k recall
measurement of logged steps (64 queries per layer: ~0.2% of the 671B step); the MTP layer (no
shipped recipe trains it).

Dense warm-up (kind "indexer", attention "dense"; report eq. 3; what `MLA._forward_frozen` runs):
  main_forward           the frozen layers' projections and MLP / MoE once (no backward, no recompute,
                         no LM head)
  attention              library attention with its lse, MHA form: 2 H (192 + 128) per causal key
  cp_up_projection       under context parallelism the gathered latent up-projected per run of
                         queries ((2 CP + 1) / 2 up-projections of a key per local token instead of
                         the one in main_forward) and the KL's absorbed query (model: 0)
  indexer                the indexer's projections, forward and weight gradients (model x3)
  recompute              the checkpoint's recompute of the KL inputs and the indexer (model: 0)
  kl_stats / kl_grad     the dense KL kernel's statistics pass (forward) and gradient-only pass
                         (backward), each forming the main scores (MHA form without CP, the shared
                         576-dim key under it) and the indexer scores per causal key tile; bytes from
                         the same analysis (the shared key counted once per key tile: its other
                         heads' loads are L2 hits). Model: the convention's KL target pass over the
                         main scores (2 H (192 + 128) per key) and the indexer's scores, forward
                         (stats) and backward (grad, 2x) over every causal key.
  At the 671B shapes the KL's bytes decide; measured at T = 32K (MHA form) on an H200
  (docs/gpu-check/NVIDIA-H200) the kernel took 1059 ms forward and 2910 ms backward per layer where
  this bound gives 319 and 494 ms at 4.8 TB/s: a lower bound on the KL's time, not a prediction.

Other kinds (dense pretraining, or a kind the two above do not describe): the model count, plus one
forward of the main layers where the recompute re-runs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .config import DSAConfig
from .flops import attention_flops_per_token, layer_linear_params

RECOMPUTE_MODES = ("none", "attention", "moe", "full")


@dataclass(frozen=True)
class StepPart:
    """One part of a step, per token (summed over the layers)."""

    model: float  # FLOPs users count (MFU's numerator)
    issued: float  # FLOPs the step issues on CUDA
    hbm_bytes: float = 0.0  # bytes a kernel part moves (0: a matmul part, timed by its FLOPs)
    recomputed: float = 0.0  # of `issued`, the FLOPs the activation recompute runs again
    # of `issued` (and `hbm_bytes`), the share tensor parallelism splits over its group (the heads'
    # projections and attention, dense MLPs, shared experts, and the routed experts and router, which
    # run on each TP rank's share of the tokens); the rest every TP rank runs whole for the group's
    # tokens (the indexer, its scores / select / KL, the LM head, q_a / kv_a):
    # `dsa_train.plan.compute.compute_seconds(..., tensor=TP)`
    tp_split: float = 1.0


@dataclass(frozen=True)
class StepFlops:
    """The parts of one training step per token (`step_flops`)."""

    parts: dict[str, StepPart] = field(default_factory=dict)

    @property
    def model(self) -> float:
        return sum(p.model for p in self.parts.values())

    @property
    def issued(self) -> float:
        return sum(p.issued for p in self.parts.values())

    @property
    def hbm_bytes(self) -> float:
        return sum(p.hbm_bytes for p in self.parts.values())

    @property
    def recomputed(self) -> float:
        return sum(p.recomputed for p in self.parts.values())


def step_flops(cfg: DSAConfig, seq_len: int, attention: str = "sparse", topk: int | None = None, *,
               main_backward: bool = True, lm_head: bool = True, kl_recomputes_main_scores: bool = False,
               indexer_loss: bool = True, context: int = 1, recompute: str = "none", micro_batch: int = 1,
               index_scores: str = "bf16", issued: bool = True, tensor: int = 1) -> StepFlops:
    """The step's parts per token (module docstring). The stage's kind gives `main_backward`,
    `lm_head` and `kl_recomputes_main_scores` (`dsa_train.stage.Stage.step_flops`); the layout
    `context` (CP size), `recompute` (`parallel.recompute`) and `micro_batch` (sequences per
    micro-batch: the score chunks and the top-k memo's budget), `tensor` (TP size: without it the
    dense MLPs and shared experts run row-chunked, `model.moe._RowChunkedMLP`, whose backward forms
    gate and up again). `issued=False`: the model column only (no kernel planning; the issued column
    is then 0)."""
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}; got {recompute!r}")
    k = topk or cfg.index_topk
    if attention == "sparse" and main_backward and lm_head and not kl_recomputes_main_scores:
        parts = _sparse_parts(cfg, seq_len, k, indexer_loss, recompute, context, micro_batch, index_scores, issued,
                              row_chunked=tensor == 1)
    elif attention == "dense" and not main_backward and not lm_head and kl_recomputes_main_scores:
        parts = _warmup_parts(cfg, seq_len, context, recompute, issued)
    else:
        parts = _other_parts(cfg, seq_len, attention, k, main_backward, lm_head, kl_recomputes_main_scores, recompute)
    return StepFlops(parts)


# ------------------------------------------------------------------------------ shared pieces
def _keys(seq_len: int, k: int) -> float:
    """Mean selected slots per query, min(t + 1, k) over t (as `attention_flops_per_token`)."""
    return k - k * (k - 1) / (2 * seq_len) if k <= seq_len else (seq_len + 1) / 2


def _layer_split(cfg: DSAConfig, i: int) -> dict[str, float]:
    """2 x the matmul parameters of layer i: attention projections, MLP (dense or MoE), indexer; and
    of those, the ones tensor parallelism splits over its group (`parallel/tensor.py`: q_b (or q),
    kv_b and o_proj of the attention, the whole MLP -- a dense MLP, the shared experts by their
    weights, the router and routed experts by the tokens (each TP rank runs them on its share);
    not q_a / kv_a or the indexer): `attention_tp`, `mlp_tp`; and `mlp_row_chunked`, the MLPs that
    run row-chunked at TP 1 (`model.moe._RowChunkedMLP`: a dense MLP, the shared experts)."""
    h, H = cfg.hidden_size, cfg.num_attention_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    q = h * cfg.q_lora_rank + cfg.q_lora_rank * H * qk if cfg.q_lora_rank else h * H * qk
    kv_a = h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    kv = kv_a + cfg.kv_lora_rank * H * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    attn = q + kv + H * cfg.v_head_dim * h
    p = layer_linear_params(cfg, i)
    mlp = p["main"] - attn
    if cfg.is_moe_layer(i):
        row_chunked = 3 * h * cfg.moe_intermediate_size * cfg.n_shared_experts  # the shared experts only
    else:
        row_chunked = mlp
    return {"attention": 2.0 * attn, "mlp": 2.0 * mlp, "indexer": 2.0 * p["indexer"],
            "attention_tp": 2.0 * (attn - h * (cfg.q_lora_rank or 0) - kv_a), "mlp_tp": 2.0 * mlp,
            "mlp_row_chunked": 2.0 * row_chunked, "kv_b": 2.0 * (kv - kv_a)}


def _hadamard(cfg: DSAConfig) -> float:
    """FLOPs per token and layer of the indexer's Hadamard rotation of q_I and k_I (`index_hadamard`:
    a [d_I, d_I] matmul per head and for the key), forward; its backward (the input gradient, the
    matrix is a buffer) issues as many again."""
    return 2.0 * cfg.index_head_dim**2 * (cfg.index_n_heads + 1) if getattr(cfg, "index_hadamard", False) else 0.0


def _share(part: float, split: float) -> float:
    """The TP-split share of a part (1.0 for an empty part)."""
    return split / part if part else 1.0


# ------------------------------------------------------------------------------ sparse training
def _sparse_parts(c: DSAConfig, T: int, k: int, indexer_loss: bool, recompute: str, context: int,
                  micro_batch: int, index_scores: str, issued: bool, row_chunked: bool = True) -> dict[str, StepPart]:
    L, H = c.num_hidden_layers, c.num_attention_heads
    r_attn = 1.0 if recompute in ("full", "attention") else 0.0
    keys = _keys(T, k)
    d_qk, d_v = c.kv_lora_rank + c.qk_rope_head_dim, c.kv_lora_rank
    proj = {"attention": 0.0, "mlp": 0.0, "moe": 0.0, "indexer": 0.0}
    split = {"attention": 0.0, "mlp": 0.0, "moe": 0.0}  # of proj, what TP splits (`_layer_split`)
    rec = {"attention": 0.0, "mlp": 0.0, "moe": 0.0}
    again = {"mlp": 0.0, "moe": 0.0}  # the row-chunked MLPs' backward recompute (not the checkpoint's)
    kv_b = 0.0
    for i in range(L):
        s = _layer_split(c, i)
        kind = "moe" if c.is_moe_layer(i) else "mlp"
        proj["attention"] += s["attention"]
        proj[kind] += s["mlp"]
        proj["indexer"] += s["indexer"]
        # the absorbed (MQA) form runs kv_b's weight as the absorption's two products (`absorption`),
        # not as a linear: the issued column leaves it out here
        kv_b += s["kv_b"]
        split["attention"] += s["attention_tp"] - s["kv_b"]
        split[kind] += s["mlp_tp"]
        rec["attention"] += r_attn * (s["attention"] - s["kv_b"])
        rec[kind] += s["mlp"] * (recompute == "full" or (recompute == "moe" and kind == "moe"))
        if row_chunked:  # its backward forms gate and up again: 2 of the MLP's 3 forward GEMMs
            again[kind] += 2.0 / 3.0 * s["mlp_row_chunked"]  # a dense MLP whole, of a MoE layer the shared experts
    issued_attn = proj["attention"] - kv_b
    tp = {name: _share(proj[name], split[name]) for name in split}
    tp["attention"] = _share(issued_attn, split["attention"])
    absorb = L * 2.0 * 2.0 * H * c.qk_nope_head_dim * c.kv_lora_rank
    mla_fwd = L * 2.0 * H * keys * (d_qk + d_v)
    a = attention_flops_per_token(c, T, "sparse", k)
    scores, scores_bwd = L * a["indexer"], L * a["indexer_backward"]
    parts = {
        "attention_projections": StepPart(3 * proj["attention"], 3 * issued_attn + rec["attention"],
                                          recomputed=rec["attention"], tp_split=tp["attention"]),
        "mlp": StepPart(3 * proj["mlp"], 3 * proj["mlp"] + rec["mlp"] + again["mlp"], recomputed=rec["mlp"],
                        tp_split=tp["mlp"]),
        "moe": StepPart(3 * proj["moe"], 3 * proj["moe"] + rec["moe"] + again["moe"], recomputed=rec["moe"],
                        tp_split=_share(3 * proj["moe"] + rec["moe"] + again["moe"],
                                        tp["moe"] * (3 * proj["moe"] + rec["moe"]) + again["moe"])),
        "lm_head": StepPart(3 * 2.0 * c.hidden_size * c.vocab_size, 3 * 2.0 * c.hidden_size * c.vocab_size,
                            tp_split=0.0),
        "absorption": StepPart(3 * absorb, (3 + r_attn) * absorb, recomputed=r_attn * absorb),
    }
    grads = 2.0 if indexer_loss else 1.0  # forward, and weight gradients when the KL trains it
    idx_proj, rot = proj["indexer"], L * _hadamard(c)  # the rotation: forward, input gradient (if trained)
    parts["indexer_projections"] = StepPart(3 * idx_proj, (grads + r_attn) * (idx_proj + rot),
                                            recomputed=r_attn * (idx_proj + rot), tp_split=0.0)
    if not issued:
        parts.update(sparse_mla_forward=StepPart(mla_fwd, 0.0), sparse_mla_backward=StepPart(2 * mla_fwd, 0.0),
                     index_scores=StepPart(scores, 0.0, tp_split=0.0), sparse_kl=StepPart(scores_bwd, 0.0, tp_split=0.0))
        return parts
    w = _sparse_kernel_work(c, T, k, micro_batch, index_scores)
    per_layer = keys / k  # the analysis is per row with all k slots valid; rows t < k walk t + 1
    # the top-k memo keeps the first layers' indices for their recompute (its budget for all layers)
    from dsa_kernels.ops.indexer_topk.memo import DEFAULT_BUDGET_BYTES

    idx_bytes = micro_batch * (T // max(context, 1)) * k * 4
    replayed = min(L, DEFAULT_BUDGET_BYTES // max(idx_bytes, 1)) if r_attn else 0
    select_runs = L + (L - replayed) * r_attn

    def kernel(name, model, runs, again=0.0, scale=per_layer, tp_split=1.0):
        f, b = w[name]
        return StepPart(model, runs * f * scale, runs * b * scale, recomputed=again * f * scale, tp_split=tp_split)

    # the attention's kernels and the KL target (the local heads' sums, all-reduced) split over TP;
    # the indexer's scores, select and KL run whole on every TP rank
    parts["sparse_mla_forward"] = kernel("mla_fwd", mla_fwd, (1 + r_attn) * L, r_attn * L)
    parts["sparse_mla_backward"] = kernel("mla_bwd", 2 * mla_fwd, L)
    if indexer_loss:
        parts["kl_target"] = kernel("target", 0.0, (1 + r_attn) * L, r_attn * L)
    parts["index_scores"] = kernel("scores", scores, select_runs, select_runs - L, 1.0, tp_split=0.0)
    parts["select"] = kernel("select", 0.0, select_runs, select_runs - L, 1.0, tp_split=0.0)
    if indexer_loss:
        f_s, b_s = w["kl_stats"]
        f_g, b_g = w["kl_grad"]
        runs = 1 + r_attn
        parts["sparse_kl"] = StepPart(scores_bwd, L * per_layer * (runs * f_s + f_g), L * per_layer * (runs * b_s + b_g),
                                      recomputed=L * per_layer * r_attn * f_s, tp_split=0.0)
    else:  # no KL: the indexer's scores train nothing, the convention's backward of them is not run
        parts["sparse_kl"] = StepPart(scores_bwd, 0.0, tp_split=0.0)
    return parts


def _sparse_kernel_work(c: DSAConfig, T: int, k: int, B: int, index_scores: str) -> dict[str, tuple[float, float]]:
    """Per token and layer, (issued FLOPs, bytes) of each sparse-stage kernel at these shapes: the
    launchers' own planning functions on meta tensors, the compile report's analysis of each launch
    (rows with all k slots valid; the index scores and the select averaged over the query chunks
    the driver makes, each over its causal key window)."""
    import torch

    from dsa_kernels._triton_common import target_capability
    from dsa_kernels.ops.indexer_kl.kernel import plan_sparse_kl
    from dsa_kernels.ops.indexer_kl.specs import sparse_kl_work, sparse_target_work
    from dsa_kernels.ops.indexer_topk.kernel import (DEFAULT_SCORE_BUDGET, candidate_buffers, plan_scores,
                                                     plan_select, scores_work, select_work)
    from dsa_kernels.ops.sparse_mla.kernel import fwd_config_space, plan_bwd, plan_fwd
    from dsa_kernels.ops.sparse_mla.specs import _bwd_work_of, fwd_work
    from dsa_kernels.ops.sparse_mla.target import plan_sparse_kl_target

    H, HI, DI = c.num_attention_heads, c.index_n_heads, c.index_head_dim
    D, d_v = c.kv_lora_rank + c.qk_rope_head_dim, c.kv_lora_rank
    k = min(k, T)
    m = dict(device="meta")
    bf, f32, i32 = torch.bfloat16, torch.float32, torch.int32
    Tr = 1  # one query row per launch: the analysis is per row
    q = torch.empty(1, Tr, H, D, dtype=bf, **m)
    kv = torch.empty(1, T, D, dtype=bf, **m)
    idx = torch.empty(1, Tr, k, dtype=i32, **m)
    n_slots = torch.empty(1, Tr, dtype=i32, **m)
    lse = torch.empty(1, Tr, H, dtype=f32, **m)
    out = torch.empty(1, Tr, H, d_v, dtype=bf, **m)
    fwd = fwd_work(plan_fwd(q, kv, idx, n_slots, out, lse, D**-0.5, d_v, fwd_config_space(target_capability(q))[0]))
    dkv = torch.empty(1, T, D, dtype=f32, **m)
    bwd = _bwd_work_of(plan_bwd(q, kv, idx, n_slots, out, lse, torch.empty_like(lse), torch.empty_like(q), dkv,
                                D**-0.5, d_v))
    p_sum = torch.empty(1, Tr, k, dtype=f32, **m)
    target = sparse_target_work(plan_sparse_kl_target(q, kv, idx, n_slots, lse, p_sum, 0, D**-0.5))
    qi = torch.empty(1, Tr, HI, DI, dtype=bf, **m)
    ki = torch.empty(1, T, DI, dtype=bf, **m)
    wi, kl = torch.empty(1, Tr, HI, dtype=f32, **m), torch.empty(1, Tr, dtype=f32, **m)
    dq, dk = torch.empty(1, Tr, HI, DI, dtype=f32, **m), torch.empty(1, T, DI, dtype=f32, **m)
    kl_s, kl_g = (sparse_kl_work(plan_sparse_kl(qi, ki, wi, idx, n_slots, p_sum, 0, H, kl, kl, dq, dk, wi, g))
                  for g in (False, True))
    # the index scores and the select, chunk by chunk as `indexer_topk_triton` runs them (one document)
    fp8 = index_scores != "bf16"
    qs_dtype = torch.float8_e4m3fn if fp8 else bf
    qa = torch.empty(B, T, HI, DI, dtype=qs_dtype, **m)
    ka = torch.empty(B, T, DI, dtype=qs_dtype, **m)
    wa, ds = torch.empty(B, T, HI, dtype=f32, **m), torch.empty(B, T, dtype=torch.int64, **m)
    pos = torch.empty(T, dtype=i32, **m)
    scales = (torch.empty(B, T, HI, 1, dtype=f32, **m), torch.empty(B, T, 1, dtype=f32, **m)) if fp8 else (None, None)
    chunk = max(1, min(T, DEFAULT_SCORE_BUDGET // max(B * T, 1)))
    s_f = s_b = sel_b = 0.0
    for r0 in range(0, T, chunk):
        r1 = min(T, r0 + chunk)
        scores = torch.empty(B, r1 - r0, r1, dtype=f32, **m)
        sw = scores_work(plan_scores(qa, ka, wa, ds, scores, pos, r0, r1, 0, *scales))
        s_f += sw.issued_flops * (r1 - r0)
        s_b += (sw.read_bytes + sw.write_bytes) * (r1 - r0)
        sel = select_work(plan_select(scores, torch.empty(B, r1 - r0, k, dtype=i32, **m),
                                      torch.empty(B, r1 - r0, k, dtype=f32, **m),
                                      *candidate_buffers(B, r1 - r0, device="meta"), 0, k))
        sel_b += (sel.read_bytes + sel.write_bytes) * (r1 - r0)

    def fb(work):
        return work.issued_flops, work.read_bytes + work.write_bytes

    return {"mla_fwd": fb(fwd), "mla_bwd": fb(bwd), "target": fb(target), "kl_stats": fb(kl_s), "kl_grad": fb(kl_g),
            "scores": (s_f / T, s_b / T), "select": (0.0, sel_b / T)}


# ------------------------------------------------------------------------------ dense warm-up
def _warmup_parts(c: DSAConfig, T: int, context: int, recompute: str, issued: bool) -> dict[str, StepPart]:
    h, H, R = c.hidden_size, c.num_attention_heads, c.kv_lora_rank
    nope, rope, v = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    ql = c.q_lora_rank or 0
    L = c.num_hidden_layers
    cp = context > 1
    attn = attention_flops_per_token(c, T, "dense")
    main_fwd = main_split = idx_proj = rec = rec_split = 0.0
    up = 2.0 * R * H * (nope + v)  # kv_b: one key / value up-projection
    absorb = 2.0 * H * nope * R  # q_nope W_UK: the KL's query in the absorbed form
    for i in range(L):
        p = layer_linear_params(c, i)
        s = _layer_split(c, i)
        main_fwd += 2.0 * p["main"]
        main_split += s["attention_tp"] + s["mlp_tp"]
        idx_proj += 2.0 * p["indexer"]
        if recompute in ("full", "attention"):
            q_split = 2.0 * (ql or h) * H * (nope + rope)  # q_b (or q): split over TP; q_a is not
            q_proj = 2.0 * h * ql + q_split if ql else q_split
            rec += q_proj + 2.0 * h * (R + rope) + (absorb if cp else up) + 2.0 * p["indexer"] + _hadamard(c)
            rec_split += q_split + (absorb if cp else up)
    cp_up = L * ((2 * context + 1) / 2 - 1) * up + L * absorb if cp else 0.0
    scores = L * attn["indexer"]
    # TP splits the heads' work (projections, attention, up-projections) and the MLPs (dense MLPs /
    # shared experts by weights, router and routed experts by tokens); the indexer and the dense KL
    # (every head gathered on each TP rank) run whole
    parts = {
        "main_forward": StepPart(main_fwd, main_fwd, tp_split=_share(main_fwd, main_split)),
        "attention": StepPart(L * attn["main"], L * attn["main"]),
        "cp_up_projection": StepPart(0.0, cp_up),
        "indexer": StepPart(3 * idx_proj, 2 * (idx_proj + L * _hadamard(c)), tp_split=0.0),
        "recompute": StepPart(0.0, rec, recomputed=rec, tp_split=_share(rec, rec_split)),
    }
    kl = _dense_kl_work(c, T, cp) if issued else {"kl_stats": (0.0, 0.0), "kl_grad": (0.0, 0.0)}
    # the convention: the KL target's pass over the main scores, the indexer's scores x3
    parts["kl_stats"] = StepPart(L * attn["main"] + scores, L * kl["kl_stats"][0], L * kl["kl_stats"][1], tp_split=0.0)
    parts["kl_grad"] = StepPart(L * attn["indexer_backward"], L * kl["kl_grad"][0], L * kl["kl_grad"][1], tp_split=0.0)
    return parts


def _dense_kl_work(c: DSAConfig, T: int, cp: bool) -> dict[str, tuple[float, float]]:
    """Per token: (issued FLOPs, bytes) of the dense KL's statistics pass and of its gradient pass, at
    the launcher's block sizes (meta tensors), in the form the warm-up runs it."""
    import torch

    from dsa_kernels.ops.dense_attention.specs import causal_blocks
    from dsa_kernels.ops.indexer_kl.kernel import plan_dense_kl
    from dsa_kernels.ops.indexer_kl.specs import dense_kl_work

    B, H, HI, DI = 1, c.num_attention_heads, c.index_n_heads, c.index_head_dim
    D, kh = ((c.kv_lora_rank + c.qk_rope_head_dim), 1) if cp else (c.qk_nope_head_dim + c.qk_rope_head_dim, H)
    m = dict(device="meta")
    qm, km = torch.empty(B, T, H, D, dtype=torch.bfloat16, **m), torch.empty(B, T, kh, D, dtype=torch.bfloat16, **m)
    qi, ki = torch.empty(B, T, HI, DI, dtype=torch.bfloat16, **m), torch.empty(B, T, DI, dtype=torch.bfloat16, **m)
    wi, kl = torch.empty(B, T, HI, dtype=torch.float32, **m), torch.empty(B, T, dtype=torch.float32, **m)
    dq, dk = torch.empty(B, T, HI, DI, dtype=torch.float32, **m), torch.empty(B, T, DI, dtype=torch.float32, **m)
    ds, lse2 = torch.empty(B, T, dtype=torch.int64, **m), torch.empty(B, H, T, dtype=torch.float32, **m)
    out = {}
    for name, grad in (("kl_stats", False), ("kl_grad", True)):
        launch = plan_dense_kl(qm, km, qi, ki, wi, ds, lse2, kl, kl, dq, dk, wi, D**-0.5, grad, stats=not grad)
        w = dense_kl_work(launch)
        hbm = w.read_bytes + w.write_bytes
        if kh == 1:  # the shared key: loaded by every head's loop, from HBM once per tile (L2 serves the rest)
            a = launch.args
            loaded = sum(n for _, _, n in causal_blocks(T, a["BLOCK_M"], a["BLOCK_N"]))
            hbm -= (H - 1) * D * km.element_size() * loaded / T
        out[name] = (w.issued_flops, hbm)
    return out


# ------------------------------------------------------------------------------ other kinds
def _other_parts(c: DSAConfig, T: int, attention: str, k: int, main_backward: bool, lm_head: bool,
                 kl_recomputes_main_scores: bool, recompute: str) -> dict[str, StepPart]:
    """The model count as issued, plus one forward of the main layers where the recompute re-runs them."""
    attn = attention_flops_per_token(c, T, attention, k)
    L = c.num_hidden_layers
    x = 3 if main_backward else 1
    layers = sum(2.0 * layer_linear_params(c, i)["main"] for i in range(L)) + L * attn["main"]
    indexer = (3 * sum(2.0 * layer_linear_params(c, i)["indexer"] for i in range(L))
               + L * (attn["indexer"] + attn["indexer_backward"]))
    rec = layers if (main_backward and recompute == "full") else 0.0
    split = sum(_layer_split(c, i)["attention_tp"] + _layer_split(c, i)["mlp_tp"] for i in range(L)) + L * attn["main"]
    parts = {"main": StepPart(x * layers, x * layers + rec, recomputed=rec, tp_split=_share(layers, split)),
             "indexer": StepPart(indexer, indexer, tp_split=0.0)}
    if lm_head:
        head = 2.0 * c.hidden_size * c.vocab_size
        parts["lm_head"] = StepPart(x * head, x * head, tp_split=0.0)
    if kl_recomputes_main_scores:  # the KL's target over every head, gathered on each TP rank
        parts["kl_target"] = StepPart(L * attn["main"], L * attn["main"], tp_split=0.0)
    return parts
