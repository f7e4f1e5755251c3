"""`correctness.custom_op_fakes`: the kernel custom ops' fake implementations (what `dsa-train plan
--trace` allocates in place of each launcher's outputs, `dsa_kernels.custom_ops`) against the
launchers' real outputs on this device: same shapes and dtypes for every op. On CUDA this covers
the launchers the CPU form cannot run (torch's memory-efficient attention with lse, the compiled
kernels' dtypes); the CPU form (`--device cpu --small`, the Triton interpreter) runs in make test
(tests/test_custom_ops.py)."""

from __future__ import annotations

import torch

from .core import Options, Outcome


def op_cases(dev: str, dtype: torch.dtype = torch.float32) -> dict:
    """Real inputs of every kernel custom op (tiny shapes; q / k / v in `dtype`), by op name."""
    from dsa_kernels import custom_ops as C
    from dsa_kernels import doc_starts_from_position_ids
    from dsa_kernels.ops.dense_attention.kernel import doc_ends
    from dsa_kernels.ops.sparse_mla.kernel import slot_counts

    B, T, H, D, DV, K, HI, DI = 1, 9, 2, 32, 16, 4, 2, 16
    g = torch.Generator().manual_seed(0)

    def r(*s, dt=dtype):
        return torch.randn(*s, generator=g).to(dev, dt)

    idx = torch.full((B, T, K), -1, dtype=torch.int32)
    for t in range(T):
        n = min(K, t + 1)
        idx[0, t, :n] = torch.randperm(t + 1, generator=g)[:n].to(torch.int32)
    idx = idx.to(dev)
    row = torch.cat([torch.arange(4), torch.arange(5)])
    ds = doc_starts_from_position_ids(row.expand(B, -1).contiguous()).to(dev)
    q, kv = r(B, T, H, D), r(B, T, D)
    n_slots = slot_counts(idx, T)
    scale = D**-0.5
    with torch.no_grad():
        out, lse, _ = C.sparse_mla_fwd(q, kv, idx, n_slots, scale, DV)
        _, _, target = C.sparse_mla_fwd(q, kv, idx, n_slots, scale, DV, True)  # the KL's target
        ds32, de = ds.to(torch.int32).contiguous(), doc_ends(ds.to(torch.int32)).to(torch.int32).contiguous()
        qa, ka, va = r(B, T, H, 16), r(B, T, H, 16), r(B, T, H, 16)
        oa, la = C.dense_attention_fwd(qa, ka, va, ds32, 0.25)
        qi, ki, wi = r(B, T, HI, DI), r(B, T, DI), torch.rand(B, T, HI, generator=g).to(dev)
        qm, km = r(B, T, H, 16), r(B, T, H, 16)
        lse2 = C.dense_kl_lse(qm, km, ds, 0.25)
        _, _, lse_i, p_sum = C.dense_kl_stats(qi, ki, wi, qm, km, ds, lse2, 0.25, 0)
    pos = torch.tensor([1, 2, 7, 8], device=dev)
    return {
        "sparse_mla_fwd": (q, kv, idx, n_slots, scale, DV),
        "sparse_mla_fwd@target": (q, kv, idx, n_slots, scale, DV, True),
        "sparse_mla_bwd": (q, kv, idx, n_slots, out, lse, r(B, T, H, DV), None, scale, DV),
        "dense_attention_fwd": (qa, ka, va, ds32, 0.25),
        "dense_attention_bwd": (qa, ka, va, oa, la, r(B, T, H, 16), ds32, de, 0.25),
        "dense_kl_lse": (qm, km, ds, 0.25),
        "dense_kl_stats": (qi, ki, wi, qm, km, ds, lse2, 0.25, 0),
        "dense_kl_grads": (qi, ki, wi, qm, km, ds, lse2, 0.25, 0, lse_i, p_sum),
        "sparse_kl_stats": (qi, ki, wi, idx, n_slots, q, kv, lse, scale),
        "sparse_kl_grads": (qi, ki, wi, idx, n_slots, q, kv, lse, scale),
        "sparse_kl_stats_target": (qi, ki, wi, idx, n_slots, target, H, scale),
        "sparse_kl_grads_target": (qi, ki, wi, idx, n_slots, target, H, scale),
        "indexer_topk": (qi, ki, wi, ds, 3, 0, None),
        "indexer_topk@positions": (qi[:, :4].contiguous(), ki, wi[:, :4].contiguous(), ds, 5, 0, pos),
        "attention_lse": (qa, ka, va, 0.25, ds),
    }


def _meta(x) -> list:
    return [(tuple(t.shape), str(t.dtype).replace("torch.", "")) for t in (x if isinstance(x, (tuple, list)) else (x,))]


def compare_fakes(dev: str, dtype: torch.dtype = torch.float32) -> dict:
    """op name -> {"real": [(shape, dtype)], "fake": [...], "ok": bool}."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dsa_kernels import custom_ops as C

    out = {}
    for name, args in op_cases(dev, dtype).items():
        fn = getattr(C, name.split("@")[0])
        with torch.no_grad():
            real = fn(*args)  # real tensors: the launcher itself
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            with mode:
                fake = fn(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])  # the custom op
        out[name] = {"real": _meta(real), "fake": _meta(fake), "ok": _meta(real) == _meta(fake)}
    return out


def custom_op_fakes_check(opts: Options) -> Outcome:
    dev = "cuda" if opts.device == "cuda" else "cpu"
    res = compare_fakes(dev, torch.bfloat16 if dev == "cuda" else torch.float32)
    bad = [k for k, v in res.items() if not v["ok"]]
    summary = (f"FAILED {', '.join(bad)}: " if bad else "") + f"{len(res) - len(bad)}/{len(res)} ops' fakes match"
    return Outcome("fail" if bad else "pass", summary, {"ops": res})
