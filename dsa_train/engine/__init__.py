"""Training engine: stages, optimizer and schedule, training checkpoints, the trainer."""

from dsa_train.engine.engine import Engine
from dsa_train.engine.schedule import lr_multiplier
from dsa_train.engine.step import StepHooks, forward_backward, train_step
from dsa_train.engine.trainable import is_indexer_parameter, set_trainable
from dsa_train.engine.trainer import Trainer, TrainResult, train

__all__ = [
    "Engine", "StepHooks", "TrainResult", "forward_backward", "Trainer", "is_indexer_parameter", "lr_multiplier", "set_trainable",
    "train", "train_step",
]
