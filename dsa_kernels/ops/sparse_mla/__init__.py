"""Sparse MLA attention in MQA (absorbed) mode over the top-k indices (report eq. 2).

    o[t, h] = sum_{i: idx[t,i] >= 0} softmax_i(scale * q[t,h] . kv[idx[t,i]]) * kv[idx[t,i], :d_v]

Entry point `sparse_mla(q, kv, indices, scale, d_v, chunk_size=None, return_target=False) -> (out, lse)`
(with return_target: `(out, lse, p_sum)`, p_sum [B, T, K] fp32 the sparse indexer KL's target Sigma_h P
per slot on the Triton path, None on the chunked one; docs/kernels.md "The sparse KL's target"):
  q       [B, T, H, D]   D = kv_lora_rank + qk_rope_head_dim (576 = 512 + 64 in the 671B model),
                         the nope part already multiplied by W_UK
  kv      [B, N, D]      the shared key [latent | k_rope]; its first d_v columns are the value
                         (N = T, or under context parallelism the whole sequence's N >= T keys)
  indices [B, T, K] int  selected key positions in [0, N), -1 = empty slot (never read)
  out     [B, T, H, d_v] q's dtype;  lse [B, T, H] fp32 (-inf on a row with no valid slot)
Differentiable w.r.t. q and kv (and through lse).

Triton path policies (docs/kernels.md): an index outside [0, N) is an empty slot (masked in the
kernels), or one clear error under DSA_KERNELS_CHECK=1; compiled fp32 q / kv are computed in bf16
with one warning (DSA_KERNELS_FP32=error refuses), results in the caller's dtypes.

Files: `reference.py` (PyTorch, the specification), `chunked.py` (the memory-bounded autograd
Function run on the CPU: saves q, kv, indices, lse; recomputes per query chunk in backward),
`kernel.py` (Triton forward/backward kernels and their launch plans), `function.py` (autograd
Function over them), `specs.py` (the launches the compile report compiles at the 671B shapes).
"""

from ..._triton_common import use_triton as _use_triton
from .chunked import sparse_mla_chunked
from .reference import gather_kv, safe_softmax, sparse_attention_scores, sparse_mla_ref


def sparse_mla(q, kv, indices, scale, d_v, chunk_size=None, return_target=False):
    """CUDA tensors (or DSA_KERNELS=triton) -> the Triton kernels; otherwise the chunked PyTorch
    Function (`chunked.py`, the reference's computation with a memory-bounded backward).
    return_target: -> (out, lse, p_sum): on the Triton path p_sum [B, T, K] fp32 is the sparse
    indexer KL's target Sigma_h P per slot from the forward (pass it as `sparse_indexer_kl`'s
    `target`); on the chunked path None (the KL then forms its target itself)."""
    if _use_triton(q, kv, indices):
        from .function import sparse_mla_triton

        return sparse_mla_triton(q, kv, indices, scale, d_v, return_target=return_target)
    out = sparse_mla_chunked(q, kv, indices, scale, d_v, chunk_size)
    return (*out, None) if return_target else out


__all__ = ["gather_kv", "safe_softmax", "sparse_attention_scores", "sparse_mla", "sparse_mla_chunked", "sparse_mla_ref"]
