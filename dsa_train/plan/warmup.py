"""The dense warm-up's step compute as the code runs it (`dsa-train plan`'s per-step time).

The warm-up (report eq. 3; stage kind "indexer") freezes the main model: `MLA._forward_frozen`
(dsa_train/model/mla.py) runs it once per micro-batch without autograd and never recomputes it,
and only the indexer and its KL carry a graph. Per token and layer, what runs on CUDA:

  main forward      the frozen layer's projections and MLP / MoE once (no backward, no recompute,
                    no LM head): 2 x its matmul parameters (`model.flops.layer_linear_params`);
  attention         library attention with the log-sum-exp in the MHA form (torch's memory-
                    efficient attention; `dense_attention.library`): 2 H (d_qk + d_v) per causal
                    key. Under context parallelism each rank's two runs of queries attend over
                    the gathered latent, up-projected locally (`mla_attention_rows`): keys [0, a + C)
                    per run, (2 CP + 1) / 2 up-projections of a key per local token instead of one,
                    and the KL's queries in the absorbed form (q_nope W_UK);
  indexer           forward, plus its weight gradients (its input is detached: no input gradient);
  recompute         with `parallel.recompute` full / attention the indexer and KL are checkpointed
                    from the layer's input: the backward forms the KL's main-model inputs again
                    (q_a / q_b / kv_a projections, kv_b (MHA) or the absorbed query (CP)) and the
                    indexer's forward; the KL's statistics pass is not re-run (its row statistics
                    are kept);
  KL                the dense KL kernel (`indexer_kl.kernel._dense_kl_kernel`): its statistics pass
                    in the forward and its gradient-only pass in the backward, each forming the main
                    scores (MHA form, d = 192, without CP; the shared 576-dim key under it) and the
                    indexer scores per causal key tile. FLOPs and bytes from the compile report's
                    analysis of the same launch (`indexer_kl.specs.dense_kl_work`: issued FLOPs,
                    every load / store / atomic add; the shared 576-dim key of the CP form counted
                    once per key tile, not once per head: its other heads' loads are L2 hits), timed
                    as max(FLOPs at the MFU, bytes at the HBM bandwidth). At the 671B shapes the
                    bytes decide (the per-head keys of the MHA form re-read per query block, the
                    q / w re-reads and the dq_I atomics per key tile). Measured at T = 32K (MHA form)
                    on an H200 (docs/gpu-check/NVIDIA-H200) the kernel took 1059 ms forward and
                    2910 ms backward per layer where this bound gives 319 and 494 ms at the H200's
                    4.8 TB/s: the figure is a lower bound on the KL's time, not a prediction.

The old figure (`Stage.flops_per_token` with `kl_recomputes_main_scores`) counted a dense-lse pass,
the KL forward and backward (x3 of the indexer scores) and a recompute of the main scores; it
ignored the KL kernel's bytes and the CP up-projection.
"""

from __future__ import annotations

HBM_BYTES_PER_S = 3.35e12  # H100 SXM HBM3 (`dsa_kernels.analysis.H100`), the default of --hbm-tbps


def _kl_work(c, seq_len: int, cp: bool):
    """Per token: (issued FLOPs, bytes) of the dense KL's statistics pass and of its gradient pass, at
    the launcher's block sizes (meta tensors), in the form the warm-up runs it."""
    import torch

    from dsa_kernels.ops.indexer_kl.kernel import plan_dense_kl
    from dsa_kernels.ops.dense_attention.specs import causal_blocks
    from dsa_kernels.ops.indexer_kl.specs import dense_kl_work

    B, T, H, HI, DI = 1, seq_len, c.num_attention_heads, c.index_n_heads, c.index_head_dim
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
            loaded = sum(k for _, _, k in causal_blocks(T, a["BLOCK_M"], a["BLOCK_N"]))
            hbm -= (H - 1) * D * km.element_size() * loaded / T
        out[name] = (w.issued_flops, hbm)
    return out


def warmup_step_work(c, seq_len: int, context: int, recompute: str) -> dict:
    """Per token, summed over the layers: FLOPs of each part (see the module doc) and the KL's bytes."""
    from dsa_train.model.flops import layer_linear_params

    h, H, R = c.hidden_size, c.num_attention_heads, c.kv_lora_rank
    nope, rope, v = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    ql = c.q_lora_rank or 0
    keys = (seq_len + 1) / 2
    cp = context > 1
    up = 2.0 * R * H * (nope + v)  # kv_b: one key / value up-projection
    absorb = 2.0 * H * nope * R  # q_nope W_UK: the KL's query in the absorbed form
    kl = _kl_work(c, seq_len, cp)
    L = c.num_hidden_layers
    f = dict(main_forward=0.0, attention=0.0, cp_up_projection=0.0, indexer=0.0, recompute=0.0, kl_stats=0.0, kl_grad=0.0)
    for i in range(L):
        p = layer_linear_params(c, i)
        f["main_forward"] += 2.0 * p["main"]
        f["indexer"] += 2.0 * p["indexer"] * 2  # forward + weight gradients
        if recompute in ("full", "attention"):
            q_proj = 2.0 * (h * ql + ql * H * (nope + rope)) if ql else 2.0 * h * H * (nope + rope)
            f["recompute"] += q_proj + 2.0 * h * (R + rope) + (absorb if cp else up) + 2.0 * p["indexer"]
    f["attention"] = L * 2.0 * H * keys * (nope + rope + v)
    if cp:
        f["cp_up_projection"] = L * ((2 * context + 1) / 2 - 1) * up + L * absorb
    f["kl_stats"], f["kl_grad"] = L * kl["kl_stats"][0], L * kl["kl_grad"][0]
    kl_bytes = L * (kl["kl_stats"][1] + kl["kl_grad"][1])
    return {"flops": f, "kl_bytes": kl_bytes, "total_flops": sum(f.values())}


def warmup_compute_seconds(work: dict, tokens_per_rank: float, peak_flops: float, mfu: float,
                           hbm_bytes_per_s: float = HBM_BYTES_PER_S) -> dict:
    """Seconds per step of one rank: every part at the MFU, the KL kernel at max(its FLOPs at the
    MFU, its bytes at the HBM bandwidth)."""
    rate = peak_flops * mfu
    f = work["flops"]
    kl_flops = f["kl_stats"] + f["kl_grad"]
    kl_s = tokens_per_rank * max(kl_flops / rate, work["kl_bytes"] / hbm_bytes_per_s)
    other_s = tokens_per_rank * (work["total_flops"] - kl_flops) / rate
    return {"compute_s": other_s + kl_s, "kl_s": kl_s, "kl_bound": "memory" if work["kl_bytes"] / hbm_bytes_per_s
            > kl_flops / rate else "compute", "parts_s": {k: tokens_per_rank * x / rate for k, x in f.items()}}
