"""Routed experts as grouped GEMMs: the local experts of an MoE layer on their tokens (sorted by
expert) with one `torch._grouped_mm` per projection instead of a loop over experts (CPU and CUDA).

`MoE.run_experts` calls `grouped_experts` when the layer's `grouped_gemm` is set (by the
parallel layout: `parallel.grouped_experts`). The expert weights keep their per-expert (Hugging
Face) parameters, grouped into one [E, ...] operand without a copy where they sit evenly
strided in one storage (DeepSpeed's flat buffers; `stacked_weights`); `grouped_expert_mlp` takes the stacked weights and
picks, per dtype and device, grouped GEMMs, grouped GEMMs on zero-padded sizes, or a loop
(`expert_gemm_path`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch
from torch._subclasses.fake_tensor import is_fake


def grouped_mm_available() -> bool:
    return hasattr(torch, "_grouped_mm")


def per_expert(runs: Sequence[Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor, counts: Sequence[int]
               ) -> torch.Tensor:
    """The loop over experts: `runs[e]` on expert e's rows of x (sorted by expert, `counts[e]` rows
    each), the outputs concatenated in that order ([0, h] without experts)."""
    outs, start = [], 0
    for run, n in zip(runs, counts):
        outs.append(run(x[start : start + n]))
        start += n
    return torch.cat(outs) if outs else x[:0]


def _contiguous_grad(t: torch.Tensor) -> torch.Tensor:
    # grouped_mm's backward needs a materialized gradient (an expanded one, e.g. from .sum(), fails)
    if t.requires_grad:
        t.register_hook(lambda g: g.contiguous())
    return t


# CUDA's grouped GEMM (`torch._grouped_mm`, CUTLASS on sm90) takes bf16 operands only, with every
# row stride a multiple of 16 bytes (8 bf16 elements); the CPU kernel takes any float dtype and size.
CUDA_GROUPED_MM_DTYPES = (torch.bfloat16,)
GROUPED_MM_ALIGN_BYTES = 16


def expert_gemm_path(dtype: torch.dtype, device_type: str, hidden: int, inter: int) -> str:
    """How `grouped_expert_mlp` runs the experts on a device:
    "grouped"        one grouped GEMM per projection, as is;
    "grouped_padded" the same after zero-padding hidden and intermediate sizes to 16 bytes (CUDA);
    "loop"           one GEMM per expert (no grouped GEMM for this dtype there: fp32 on CUDA)."""
    if not hasattr(torch, "_grouped_mm"):
        return "loop"
    if device_type != "cuda":
        return "grouped"
    if dtype not in CUDA_GROUPED_MM_DTYPES:
        return "loop"
    per = GROUPED_MM_ALIGN_BYTES // torch.tensor([], dtype=dtype).element_size()
    return "grouped" if hidden % per == 0 and inter % per == 0 else "grouped_padded"


def _pad_last(t: torch.Tensor, size: int) -> torch.Tensor:
    return t if t.shape[-1] == size else torch.nn.functional.pad(t, (0, size - t.shape[-1]))


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def grouped_expert_mlp(x: torch.Tensor, offs: torch.Tensor | list[int], w_gate, w_up, w_down,
                       path: str | None = None) -> torch.Tensor:
    """SwiGLU experts over tokens sorted by expert: x [N, h], offs [E] int32 (cumulative token
    counts; the loop also takes them as a host list), w_gate/w_up [E, I, h], w_down [E, h, I]
    (nn.Linear layout). `path` (default: chosen by `expert_gemm_path` for x's dtype and device)
    picks grouped GEMMs, padded grouped GEMMs or a per-expert loop; all three compute the same function."""
    h, inter = x.shape[-1], w_gate.shape[1]
    path = path or expert_gemm_path(x.dtype, x.device.type, h, inter)
    if path == "loop":
        ends = offs if isinstance(offs, list) else offs.tolist()  # device offsets: one host read

        def mlp(e: int) -> Callable[[torch.Tensor], torch.Tensor]:
            return lambda xe: (torch.nn.functional.silu(xe @ w_gate[e].t()) * (xe @ w_up[e].t())) @ w_down[e].t()

        return per_expert([mlp(e) for e in range(len(ends))], x, [b - a for a, b in zip([0, *ends], ends)])
    if path == "grouped_padded":
        # zero rows/columns: the padded gate/up columns are 0, silu(0) * 0 = 0, so the padded
        # down-projection inputs add nothing; the padded output columns are dropped
        per = GROUPED_MM_ALIGN_BYTES // x.element_size()
        hp, ip = _round_up(h, per), _round_up(inter, per)
        x = _pad_last(x, hp)
        w_gate = _pad_last(_pad_last(w_gate, hp).transpose(1, 2), ip).transpose(1, 2)
        w_up = _pad_last(_pad_last(w_up, hp).transpose(1, 2), ip).transpose(1, 2)
        w_down = _pad_last(_pad_last(w_down, ip).transpose(1, 2), hp).transpose(1, 2)
        # [E, ip, hp] / [E, hp, ip], contiguous after padding
        w_gate, w_up, w_down = w_gate.contiguous(), w_up.contiguous(), w_down.contiguous()
    elif path != "grouped":
        raise ValueError(f"grouped_expert_mlp: path={path!r}; one of grouped, grouped_padded, loop")
    gate = _contiguous_grad(torch._grouped_mm(x, w_gate.transpose(1, 2), offs=offs))
    up = _contiguous_grad(torch._grouped_mm(x, w_up.transpose(1, 2), offs=offs))
    act = torch.nn.functional.silu(gate) * up
    out = _contiguous_grad(torch._grouped_mm(act, w_down.transpose(1, 2), offs=offs))
    return out[:, :h] if out.shape[-1] != h else out


class _Stacked(torch.autograd.Function):
    """[E, ...] over E same-shaped weights: a view of their common storage when they sit at one
    stride in it (as in DeepSpeed's flat ZeRO-1/2 buffers, where a layer's experts follow each
    other), else a stacked copy. Backward: the [E, ...] gradient's slices, one per weight (views)."""

    @staticmethod
    def forward(ctx, *weights):
        view = _strided_view(weights)
        return view if view is not None else torch.stack(weights)

    @staticmethod
    def backward(ctx, grad):
        return grad.unbind(0)


def _strided_view(weights) -> torch.Tensor | None:
    first = weights[0]
    try:  # fake tensors (the traced plan) have no storage address (data_ptr 0, with a warning):
        # their storages compared as objects; meta tensors: stacked (below)
        if is_fake(first):
            key = lambda w: w.untyped_storage()._cdata  # noqa: E731
        else:
            key = lambda w: w.untyped_storage().data_ptr()  # noqa: E731
        same_storage = all(key(w) == key(first) for w in weights)
    except (RuntimeError, NotImplementedError):
        return None
    if first.device.type == "meta" or not same_storage or any(w.shape != first.shape or w.stride() != first.stride()
                                                                  or w.dtype != first.dtype for w in weights):
        return None
    offsets = [w.storage_offset() for w in weights]
    step = offsets[1] - offsets[0] if len(weights) > 1 else first.numel()
    if step < first.numel() or any(b - a != step for a, b in zip(offsets, offsets[1:])):
        return None
    # CUDA's grouped GEMM takes 16-byte aligned operands only ("expected data_ptr to be aligned to 16
    # bytes"; the CPU kernel takes any): a flat buffer that leaves the experts off that (a parameter
    # of odd size before them) gets the stacked copy, which is aligned
    if not is_fake(first) and (first.data_ptr() % GROUPED_MM_ALIGN_BYTES
                               or step * first.element_size() % GROUPED_MM_ALIGN_BYTES):
        return None
    return first.as_strided((len(weights), *first.shape), (step, *first.stride()), first.storage_offset())


def stacked_weights(weights: list[torch.Tensor]) -> torch.Tensor:
    """The experts' weights as one [E, ...] operand of a grouped GEMM (no copy when they are
    evenly spaced in one storage; see `_Stacked`)."""
    return _Stacked.apply(*weights)


def expert_offsets(counts: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Cumulative token counts [E] int32 on `device`: from counts on the device (computed there, no
    host read), or from host counts (a pinned, non-blocking copy on CUDA: no wait for the device)."""
    if isinstance(counts, torch.Tensor):
        return counts.to(device).cumsum(0).to(torch.int32)
    offs = torch.tensor(counts, dtype=torch.long).cumsum(0).to(torch.int32)
    if device.type == "cuda":
        return offs.pin_memory().to(device, non_blocking=True)
    return offs.to(device)


def grouped_experts(experts: list, x_sorted: torch.Tensor, counts: list[int] | torch.Tensor,
                    weight_grad: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """The local experts on their tokens (sorted by expert) with grouped GEMMs instead of a loop.
    `counts` (tokens per expert) on the host or, read nowhere, on the device. The expert weights
    keep their per-expert (Hugging Face) parameters; `stacked_weights` groups them without a copy
    where they share one evenly strided storage (`pack_expert_weights`). `weight_grad`: applied to
    each projection's stacked [E, ...] weight (an identity whose backward, e.g., sums the gradient
    over tensor-parallel ranks: one collective per projection instead of one per expert weight)."""
    if not grouped_mm_available():
        if weight_grad is not None:
            raise RuntimeError("grouped_experts: weight_grad needs torch._grouped_mm (this torch has none)")
        return per_expert(experts, x_sorted, counts.tolist() if isinstance(counts, torch.Tensor) else counts)
    grad_of = weight_grad or (lambda w: w)

    def stack(name):
        return grad_of(stacked_weights([getattr(e, name).weight for e in experts]))

    w_gate, w_up, w_down = stack("gate_proj"), stack("up_proj"), stack("down_proj")
    path = expert_gemm_path(x_sorted.dtype, x_sorted.device.type, x_sorted.shape[-1], w_gate.shape[1])
    if path == "loop" and not isinstance(counts, torch.Tensor):
        # the loop (fp32 on CUDA) with host counts (expert parallelism): sliced on the host, not
        # sent to the device as offsets and read back (a device synchronization per layer)
        offs = list(itertools.accumulate(counts))
    else:
        offs = expert_offsets(counts, x_sorted.device)
    return grouped_expert_mlp(x_sorted, offs, w_gate, w_up, w_down, path=path)


PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def pack_expert_weights(experts: list) -> None:
    """Re-seat each projection's expert weights as views of one [E, ...] tensor (values unchanged,
    each still the same `nn.Parameter` object), so that `stacked_weights` is a view and
    a grouped-GEMM forward copies no weights. For the single process (`parallel.grouped_experts`
    there): DeepSpeed's flat buffers already hold them this way. Left as they are: meta or fake
    weights (a traced or meta start-up), weights of differing shapes, dtypes or devices, and
    weights already packed. A later `.to()` / `.cast()` unpacks them (the GEMMs then stack)."""
    if len(experts) < 2:
        return
    for name in PROJECTIONS:
        weights = [getattr(e, name).weight for e in experts]
        first = weights[0]
        if first.device.type == "meta" or is_fake(first) or _strided_view(weights) is not None:
            continue
        if any(w.shape != first.shape or w.dtype != first.dtype or w.device != first.device for w in weights):
            continue
        with torch.no_grad():
            stack = torch.stack([w.detach() for w in weights])
        for w, view in zip(weights, stack.unbind(0)):
            w.data = view  # the same Parameter object (optimizers, hooks, records keep it)
