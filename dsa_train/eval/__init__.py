"""`dsa-train eval`: held-out evaluation of DSA models, dense vs sparse vs oracle top-k, by position.

    run.py        the evaluation: models x sequence lengths x attention modes -> the eval.json document
    attention.py  per-layer reference measurements from a layer's own weights (mass, oracle top-k,
                  recall, overlap, KL-captured, bf16-vs-FP8 overlap) and the forward hooks that run them
    positions.py  LM loss by query-position bucket
    data.py       held-out rows of the training data path's packed stream
    passkey.py    passkey retrieval examples and scoring
    report.py     terminal tables, eval.json, PNG plots
    cli.py        the command line

See docs/eval.md.
"""

from .run import MODES, EvalOptions, evaluate

__all__ = ["MODES", "EvalOptions", "evaluate"]
