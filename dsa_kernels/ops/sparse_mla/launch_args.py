"""The keyword arguments the sparse MLA kernels (Triton and Gluon, forward and backward) take alike,
built once on the host from the call's tensors (kernel.py, gluon_fwd.py and gluon_bwd.py launch with
them; a module of its own so that neither kernel module imports the other)."""

from __future__ import annotations


def _gather_args(q, kv, indices, n_slots) -> dict:
    """The arguments every sparse MLA kernel (Triton and Gluon, forward and backward) takes alike:
    q [B, T, H, D], kv [B, N, D], indices [B, T, K], n_slots [B, T] and their strides."""
    return dict(
        Q=q, KV=kv, IDX=indices, NSLOT=n_slots,
        stride_qb=q.stride(0), stride_qt=q.stride(1), stride_qh=q.stride(2),
        stride_kvb=kv.stride(0), stride_kvt=kv.stride(1),
        stride_ib=indices.stride(0), stride_it=indices.stride(1),
        stride_nb=n_slots.stride(0),
    )


def _fwd_args(q, kv, indices, n_slots, out, lse) -> dict:
    """The arguments both forward kernels (Triton, Gluon) take alike: the inputs, out [B, T, H, d_v],
    lse [B, T, H] and their strides."""
    return dict(
        **_gather_args(q, kv, indices, n_slots), O=out, LSE=lse,
        stride_ob=out.stride(0), stride_ot=out.stride(1), stride_oh=out.stride(2),
        stride_lb=lse.stride(0), stride_lt=lse.stride(1),
    )


def _bwd_args(q, kv, indices, n_slots, dout, lse, delta, dq) -> dict:
    """The arguments every backward kernel (split, interleaved, Gluon) takes alike: the inputs,
    dout [B, T, H, d_v], lse / delta [B, T, H] (one set of strides), dq [B, T, H, D] and their strides."""
    if lse.stride() != delta.stride():
        raise ValueError(f"sparse_mla backward: lse {lse.stride()} and delta {delta.stride()} must share strides")
    return dict(
        **_gather_args(q, kv, indices, n_slots), DO=dout, LSE=lse, DELTA=delta, DQ=dq,
        stride_dob=dout.stride(0), stride_dot=dout.stride(1), stride_doh=dout.stride(2),
        stride_lb=lse.stride(0), stride_lt=lse.stride(1),
        stride_dqb=dq.stride(0), stride_dqt=dq.stride(1), stride_dqh=dq.stride(2),
    )
