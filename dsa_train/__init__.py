"""dsa_train: continued pretraining of DeepSeek-V3-architecture checkpoints into DeepSeek Sparse
Attention (DSA) models, with the DeepSeek-V3.2 two-stage recipe.

The model (`dsa_train.model`) knows nothing of files: `from_pretrained` / `save_pretrained` are
the checkpoint package's (`dsa_train.checkpoint`), re-exported here.

The re-exports are lazy (PEP 562): `import dsa_train.data` or `dsa-train --help` loads neither the
model nor the kernels; `dsa_train.from_pretrained` imports `dsa_train.checkpoint` on first use
(tests/test_structure.py checks which modules a light import loads)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dsa_train.lazy import lazy_exports
from dsa_train.version import __version__

# public name -> the module that defines it
_EXPORTS = {
    "from_pretrained": "dsa_train.checkpoint",
    "save_pretrained": "dsa_train.checkpoint",
    "DSAConfig": "dsa_train.model",
    "DSAForCausalLM": "dsa_train.model",
    "DSAOutput": "dsa_train.model",
    "tiny_config": "dsa_train.model",
}

__all__ = [
    "DSAConfig", "DSAForCausalLM", "DSAOutput", "from_pretrained", "save_pretrained", "tiny_config", "__version__",
]

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ imports on first use
    from dsa_train.checkpoint import from_pretrained, save_pretrained
    from dsa_train.model import DSAConfig, DSAForCausalLM, DSAOutput, tiny_config


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
