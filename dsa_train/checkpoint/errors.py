"""The one error type of the checkpoint tools."""

from __future__ import annotations

from dsa_train.errors import DSATrainError


class CheckpointError(DSATrainError, ValueError):
    """A checkpoint that cannot be read, loaded or written as asked.

    The message names the tensor and the file involved and says what to fix. Raised before a
    model is returned: a load that fails never hands back a partly loaded model.
    """
