"""The DSA ops, one folder each (flash-linear-attention's `fla/ops/<op>/` layout). The dispatchers
are re-exported by `dsa_kernels` itself; this package deliberately exports nothing, so that
`dsa_kernels.ops.<op>` is always the op's folder."""
