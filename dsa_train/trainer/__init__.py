"""The trainer (torchtitan's `trainer` floor): `Trainer` / `train` (`trainer`) composing the layout,
the model, the data and the checkpoints; the engine of a stage (`Engine` in one process,
`DeepSpeedEngine` over N ranks; `make_engine`), one optimizer step (`train_step` and its
`StepHooks`), the checkpoint manager, the meta-device start-up (`startup`), probes, the run lock,
and the fault hook the reliability tests inject (only under DSA_FAULT). `trainer.trainer` is not
imported here: `import dsa_train.trainer` stays light."""

from dsa_train.trainer.engine import Engine

from dsa_train.training_engine import TrainingEngine
from dsa_train.trainer.schedule import lr_multiplier
from dsa_train.trainer.step import StepHooks, forward_backward, train_step

__all__ = [
    "Engine", "StepHooks", "TrainingEngine", "forward_backward", "lr_multiplier", "train_step",
]
