"""Autograd-aware collectives that also run on gloo (no reduce_scatter needed)."""

from __future__ import annotations

import torch
import torch.distributed as dist


class _GatherSeq(torch.autograd.Function):
    """all-gather along `dim` (rank order); backward: all-reduce the gradient, keep own slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group):
        ctx.dim, ctx.group = dim, group
        ctx.rank, ctx.size = dist.get_rank(group), dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(ctx.size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.local = x.shape[dim]
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad.narrow(ctx.dim, ctx.rank * ctx.local, ctx.local), None, None


def all_gather_autograd(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    return _GatherSeq.apply(x, dim, group)


@torch.no_grad()
def all_gather_nograd(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; backward all-reduces (sums) the gradient over the group (megatron's
    `copy_to_tensor_model_parallel_region` for tensors used by per-rank heads)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def copy_to_group(x: torch.Tensor, group) -> torch.Tensor:
    return _CopyToGroup.apply(x, group)
