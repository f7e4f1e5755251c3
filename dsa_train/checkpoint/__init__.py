"""Every checkpoint format (docs/checkpoints.md): a streaming loader for Hugging Face DeepSeek-V3 /
V3.1 / V3.2 directories (sharded, FP8 block-quantized, MTP), export to the V3.2-Exp layout,
tiny V3.1-Terminus-layout checkpoints, `dsa-train export | inspect | make-tiny-checkpoint`, and the
training checkpoints (`training`: atomic step directories, manifests, verification;
`sharded_state`: the DCP tensors of every rank; `training_source`: a training checkpoint read for
export and for `dsa-train eval`: `from_training_checkpoint`). Who writes them when is the trainer's (dsa_train.trainer.checkpoint_manager)."""

from .errors import CheckpointError
from .export import ExportOptions, save_pretrained, write_hf_dir
from .fp8 import dequantize_fp8_blocks, quantize_fp8_blocks
from .loader import CheckpointPlan, examine_checkpoint, from_pretrained, from_training_checkpoint, open_checkpoint

__all__ = [
    "CheckpointError", "CheckpointPlan", "ExportOptions", "dequantize_fp8_blocks", "examine_checkpoint",
    "from_pretrained", "from_training_checkpoint", "open_checkpoint", "quantize_fp8_blocks", "save_pretrained", "write_hf_dir",
]
