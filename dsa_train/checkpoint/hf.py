"""Hugging Face DeepSeek-V3 / V3.2 directories <-> DSAForCausalLM (what DSAForCausalLM's
`from_pretrained` / `save_pretrained` call). Reading is loader.py, writing export.py."""

from __future__ import annotations

from .errors import CheckpointError
from .export import save_pretrained
from .fp8 import dequantize_fp8_blocks, quantize_fp8_blocks
from .hf_layout import INDEX_FILE
from .loader import load_pretrained

__all__ = ["CheckpointError", "INDEX_FILE", "dequantize_fp8_blocks", "load_pretrained", "quantize_fp8_blocks", "save_pretrained"]
