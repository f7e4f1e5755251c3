"""The checkpoint's tensors under the model's parameter names, and reading them.

A stored tensor is one model parameter as the checkpoint keeps it: in place, FP8 with its
`weight_scale_inv` block scales, or one expert's slice of a transformers-5 fused expert tensor
(`mlp.experts.gate_up_proj` [E, 2I, H] / `mlp.experts.down_proj` [E, H, I]). Reading gives the
value in fp32 for FP8 (dequantized) and in the stored dtype otherwise.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import CheckpointError
from .fp8 import SCALE_SUFFIX, dequantize_fp8_blocks, scale_shape
from .safetensors_file import SafetensorsReader, TensorEntry

FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
SCALE_DTYPES = ("F32", "BF16", "F16", "F8_E8M0")
_FUSED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


@dataclass(frozen=True)
class StoredTensor:
    name: str  # the model's parameter name
    shape: tuple[int, ...]  # the parameter's shape as stored
    entry: TensorEntry  # where its bytes are
    scale: TensorEntry | None = None  # FP8 block scales
    expert: int | None = None  # fused experts: index along dim 0
    rows: tuple[int, int] | None = None  # fused gate_up: rows of that expert's slice

    @property
    def dtype(self) -> str:
        return self.entry.dtype

    @property
    def file(self) -> Path:
        return self.entry.file

    def where(self) -> str:
        stored = self.entry.name if self.entry.name == self.name else f"{self.entry.name} (holding {self.name})"
        return f"{stored} in {self.file}"


def stored_tensors(entries: dict[str, TensorEntry]) -> dict[str, StoredTensor]:
    """{parameter name: StoredTensor}. A scale without its weight is kept under its own name
    (so it shows up as unexpected)."""
    out: dict[str, StoredTensor] = {}
    for name, entry in entries.items():
        if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in entries:
            continue
        scale = entries.get(name + SCALE_SUFFIX)
        m = _FUSED_EXPERTS.match(name)
        if m and len(entry.shape) == 3 and scale is None:
            prefix, kind = m.groups()
            n_experts, rows, cols = entry.shape
            for e in range(n_experts):
                if kind == "gate_up_proj":
                    half = rows // 2
                    for j, proj in enumerate(("gate_proj", "up_proj")):
                        pname = f"{prefix}.{e}.{proj}.weight"
                        out[pname] = StoredTensor(pname, (half, cols), entry, None, e, (j * half, (j + 1) * half))
                else:
                    pname = f"{prefix}.{e}.down_proj.weight"
                    out[pname] = StoredTensor(pname, (rows, cols), entry, None, e)
            continue
        out[name] = StoredTensor(name, entry.shape, entry, scale)
    return out


def check_dtype(st: StoredTensor, block: int) -> None:
    """CheckpointError unless the tensor is floating point, or FP8 with well-formed block scales."""
    if st.dtype in FLOAT_DTYPES:
        return
    if st.dtype not in FP8_DTYPES:
        raise CheckpointError(
            f"tensor {st.where()} has dtype {st.dtype}; model weights must be F32, BF16, F16 or "
            "F8_E4M3 with weight_scale_inv. The file is corrupt or not a DeepSeek-V3 checkpoint"
        )
    if st.scale is None:
        raise CheckpointError(
            f"FP8 tensor {st.where()} has no {st.name}{SCALE_SUFFIX}; an FP8 weight needs its block scales "
            "(re-download the checkpoint, or check the index maps the scale)"
        )
    if len(st.shape) != 2:
        raise CheckpointError(f"FP8 tensor {st.where()} has shape {list(st.shape)}; block-scaled FP8 weights must be 2-D")
    if st.scale.dtype not in SCALE_DTYPES:
        raise CheckpointError(
            f"tensor {st.scale.name} in {st.scale.file} has dtype {st.scale.dtype}; block scales must be F32, BF16 or F8_E8M0"
        )
    expect = scale_shape(st.shape, block)
    if tuple(st.scale.shape) != expect:
        raise CheckpointError(
            f"tensor {st.scale.name} in {st.scale.file} has shape {list(st.scale.shape)}, but the {list(st.shape)} "
            f"weight {st.name} with {block}x{block} blocks needs {list(expect)}; check weight_block_size in "
            "quantization_config"
        )


class TensorReader:
    """Reads stored tensors, keeping one open handle per file and the last fused-expert tensor."""

    def __init__(self, block: int = 128):
        self.block = block
        self._readers: dict[Path, SafetensorsReader] = {}
        self._fused: tuple[str, torch.Tensor] | None = None

    def __enter__(self) -> "TensorReader":
        return self

    def __exit__(self, *exc) -> None:
        for r in self._readers.values():
            r.__exit__()
        self._readers.clear()
        self._fused = None

    def _raw(self, entry: TensorEntry) -> torch.Tensor:
        reader = self._readers.get(entry.file)
        if reader is None:
            reader = self._readers[entry.file] = SafetensorsReader(entry.file).__enter__()
        return reader.read(entry)

    def read(self, st: StoredTensor) -> torch.Tensor:
        """fp32 for FP8 weights (dequantized), the stored dtype otherwise."""
        if st.expert is not None:
            if self._fused is None or self._fused[0] != st.entry.name:
                self._fused = (st.entry.name, self._raw(st.entry))
            t = self._fused[1][st.expert]
            if st.rows is not None:
                t = t[st.rows[0] : st.rows[1]]
            return t.clone()
        t = self._raw(st.entry)
        if st.scale is not None and st.dtype in FP8_DTYPES:
            t = dequantize_fp8_blocks(t, self._raw(st.scale), self.block, st.name)
        return t
