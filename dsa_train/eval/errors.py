"""The evaluation's user errors (one line on the command line: dsa_train/errors.py)."""

from __future__ import annotations

from dsa_train.errors import DSATrainError


class EvalError(DSATrainError, ValueError):
    """A model, data set or option `dsa-train eval` cannot evaluate as asked; the message says the fix."""
