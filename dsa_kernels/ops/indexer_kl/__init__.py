"""Indexer KL losses (report eqs. 3 and 4).

    eq. 3 (dense warm-up):  sum_t KL( p[t, :]   || softmax(I[t, :]) )     over valid s <= t
    eq. 4 (sparse stage):   sum_t KL( p[t, S_t] || softmax(I[t, S_t]) )   over the selected keys
    p[t, :] = L1-normalize( sum_h softmax_s(main attention logits of head h) )   (no gradient)

Entry points (both -> (kl_sum, stats); kl_sum differentiable w.r.t. q_idx, k_idx, w_idx only):
  dense_indexer_kl(q_idx, k_idx, w_idx, q_main, k_main, scale, doc_start, chunk_size=None, lse_main=None)
  sparse_indexer_kl(q_idx, k_idx, w_idx, indices, q_main, kv_main, lse_main, scale, chunk_size=None, target=None,
                    heads=None)
    q_idx [B, T, H_I, D_I], k_idx [B, T, D_I], w_idx [B, T, H_I] fp32 (scales folded in)
    q_main [B, T, H, D]; dense: k_main [B, T, H or 1, D]; sparse: kv_main [B, T, D] (the MQA key),
    indices [B, T, K] int (-1 empty), lse_main [B, T, H] fp32 (from sparse_mla's forward; dense:
    optional, from dense_attention's forward, reused for the target instead of a softmax pass)
    target [B, T, K] fp32 (sparse, Triton path): Sigma_h P per slot from sparse_mla(..., return_target=True),
    read instead of gathering kv_main and forming the main logits (kept for the backward)
    heads (with target): the layer's head count H when q_main / lse_main hold only this rank's heads
    (tensor parallelism: target is then the sum over every rank's heads; q_main is not read)
  stats: "kl", "kl_uniform", "queries" (detached sums)

Files: `reference.py` (PyTorch, the specification), `chunked.py` (eq. 4's memory-bounded
autograd Function run on the CPU: gradients formed with the value, chunk by chunk), `kernel.py` (Triton kernels and their launch
plans), `function.py` (the autograd Function and the Triton entry points), `specs.py` (the
launches the compile report compiles at the 671B shapes), `fused.py` + `fused_specs.py` (eq. 3's
value and gradients in one pass, selected by DSA_DENSE_KL=fused; its gate cases and analysis).
"""

from ..._triton_common import use_triton as _use_triton
from .chunked import sparse_indexer_kl_chunked
from .reference import dense_indexer_kl_ref, dense_mass_recall, kl_rows, sparse_indexer_kl_ref


def dense_indexer_kl(q_idx, k_idx, w_idx, q_main, k_main, scale, doc_start, chunk_size=None, lse_main=None):
    """CUDA tensors (or DSA_KERNELS=triton) -> the Triton kernels; otherwise the reference."""
    if _use_triton(q_idx, k_idx, w_idx, q_main, k_main):
        from .function import dense_indexer_kl_triton

        return dense_indexer_kl_triton(q_idx, k_idx, w_idx, q_main, k_main, scale, doc_start, lse_main=lse_main)
    return dense_indexer_kl_ref(q_idx, k_idx, w_idx, q_main, k_main, scale, doc_start, chunk_size, lse_main)


def sparse_indexer_kl(q_idx, k_idx, w_idx, indices, q_main, kv_main, lse_main, scale, chunk_size=None, target=None,
                      heads=None):
    """CUDA tensors (or DSA_KERNELS=triton) -> the Triton kernels; otherwise the chunked PyTorch
    Function (`chunked.py`, the reference's computation, gradients formed chunk by chunk).
    target: Sigma_h P per slot from `sparse_mla(..., return_target=True)` (Triton path: the KL reads
    it instead of gathering KV rows; the chunked path ignores it and forms its own).
    heads: the layer's head count where q_main holds only some of them (tensor parallelism), with
    the target summed over every head: the Triton path only (the chunked one needs every head's q)."""
    if _use_triton(q_idx, k_idx, w_idx, q_main, kv_main):
        from .function import sparse_indexer_kl_triton

        return sparse_indexer_kl_triton(q_idx, k_idx, w_idx, indices, q_main, kv_main, lse_main, scale,
                                        target=target, heads=heads)
    if heads is not None and heads != q_main.shape[2]:
        raise ValueError(f"sparse_indexer_kl: heads={heads} but q_main holds {q_main.shape[2]} heads; the chunked "
                         f"(CPU) path forms the target from every head's q and lse: pass them gathered, without heads")
    return sparse_indexer_kl_chunked(q_idx, k_idx, w_idx, indices, q_main, kv_main, lse_main, scale, chunk_size)


__all__ = ["dense_indexer_kl", "dense_indexer_kl_ref", "dense_mass_recall", "kl_rows", "sparse_indexer_kl", "sparse_indexer_kl_chunked",
           "sparse_indexer_kl_ref"]
