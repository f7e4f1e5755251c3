"""dsa_train: continued pretraining of DeepSeek-V3-architecture checkpoints into DeepSeek Sparse
Attention (DSA) models, with the DeepSeek-V3.2 two-stage recipe."""

from __future__ import annotations

import os

import torch

from .model import DSAConfig, DSAForCausalLM, DSAOutput, tiny_config

__version__ = "0.1.0"


def from_pretrained(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> DSAForCausalLM:
    """Load a Hugging Face DeepSeek-V3 / V3.1 / V3.2 directory. A dense checkpoint gets fresh indexers."""
    return DSAForCausalLM.from_pretrained(path, dtype=dtype)


__all__ = ["DSAConfig", "DSAForCausalLM", "DSAOutput", "from_pretrained", "tiny_config", "__version__"]
