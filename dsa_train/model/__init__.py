"""The DeepSeek-V3 architecture with DeepSeek Sparse Attention (see docs/model.md)."""

from . import flops
from .config import DSAConfig, tiny_config
from .indexer import LightningIndexer
from .mla import MLA
from .moe import MoE, Router
from .transformer import DSAForCausalLM, DSAOutput

__all__ = ["DSAConfig", "DSAForCausalLM", "DSAOutput", "LightningIndexer", "MLA", "MoE", "Router", "flops", "tiny_config"]
