"""dsa_train: continued pretraining of DeepSeek-V3-architecture checkpoints into DeepSeek Sparse
Attention (DSA) models, with the DeepSeek-V3.2 two-stage recipe.

The model (`dsa_train.model`) knows nothing of files: `from_pretrained` / `save_pretrained` are
the checkpoint package's (`dsa_train.checkpoint`), re-exported here."""

from __future__ import annotations

from .checkpoint import from_pretrained, save_pretrained
from .model import DSAConfig, DSAForCausalLM, DSAOutput, tiny_config

__version__ = "0.1.0"

__all__ = [
    "DSAConfig", "DSAForCausalLM", "DSAOutput", "from_pretrained", "save_pretrained", "tiny_config", "__version__",
]
