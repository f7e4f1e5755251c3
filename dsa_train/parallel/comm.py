"""Autograd-aware collectives (NCCL and gloo: gloo has reduce_scatter_tensor since torch 2.x)."""

from __future__ import annotations

import torch
import torch.distributed as dist


class _GatherSeq(torch.autograd.Function):
    """all-gather along `dim` (rank order); backward: reduce-scatter of the gradient, each rank
    receiving only its own slice summed over the group (a reduce-scatter moves (size-1)/size of
    the gradient per rank where an all-reduce moves twice that, and no rank holds the others' sums)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group):
        ctx.dim, ctx.group = dim, group
        ctx.size = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(ctx.size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.local = x.shape[dim]
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # grad [..., size * local (dim), ...] -> rank-major rows [size * local, ...] (rank r's slice
        # is rows r*local ...), reduce-scattered to this rank's [local, ...]
        rows = grad.movedim(ctx.dim, 0).contiguous()
        mine = rows.new_empty((ctx.local, *rows.shape[1:]))
        dist.reduce_scatter_tensor(mine, rows, group=ctx.group)
        return mine.movedim(0, ctx.dim), None, None


def all_gather_autograd(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    return _GatherSeq.apply(x, dim, group)


@torch.no_grad()
def all_gather_nograd(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


@torch.no_grad()
def all_reduce_nograd(x: torch.Tensor, group) -> torch.Tensor:
    """x summed over `group`, in place (x must be a tensor nothing else reads: a fresh output)."""
    dist.all_reduce(x, group=group)
    return x


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


def row_share(n_rows: int, group) -> tuple[int, int]:
    """This rank's contiguous share [start, stop) of `n_rows` rows split over `group`: ceil(n / size)
    rows a rank in rank order, the last ranks fewer (or none) when the size does not divide n."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    per = -(-n_rows // size)
    return min(rank * per, n_rows), min((rank + 1) * per, n_rows)


def _gather_rows(x: torch.Tensor, n_rows: int, group) -> torch.Tensor:
    """Every rank's share (`row_share`) of `n_rows` rows, gathered in rank order: each share padded
    to ceil(n / size) rows for the all-gather (the padding travels, then is dropped)."""
    size = dist.get_world_size(group)
    per = -(-n_rows // size)
    padded = x if x.shape[0] == per else torch.cat([x, x.new_zeros((per - x.shape[0], *x.shape[1:]))])
    parts = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat(parts)[:n_rows]


class _ScatterRows(torch.autograd.Function):
    """This rank's share of the rows of x, which every rank of the group holds whole (`row_share`);
    backward: every rank's share of the gradient all-gathered (x is replicated: each rank needs
    its full gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group):
        ctx.group, ctx.n_rows = group, x.shape[0]
        start, stop = row_share(x.shape[0], group)
        return x[start:stop].clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather_rows(grad, ctx.n_rows, ctx.group), None


class _GatherRows(torch.autograd.Function):
    """The whole [n_rows, ...] tensor from each rank's share (`row_share`); backward: this rank's
    share of the gradient (every rank continues with the same gathered tensor and computes the same
    gradient of it)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, n_rows: int, group):
        ctx.group, ctx.n_rows = group, n_rows
        return _gather_rows(x, n_rows, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start, stop = row_share(ctx.n_rows, ctx.group)
        return grad[start:stop].contiguous(), None, None


def scatter_rows(x: torch.Tensor, group) -> torch.Tensor:
    return _ScatterRows.apply(x, group)


def gather_rows(x: torch.Tensor, n_rows: int, group) -> torch.Tensor:
    return _GatherRows.apply(x, n_rows, group)
