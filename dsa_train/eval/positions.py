"""LM loss by query position.

A token's position is its `position_ids` value: how many tokens of its own document precede it (a
held-out row can hold several packed documents; positions restart at each). Buckets are half-open
ranges [lo, hi): by default [0, k), [k, 2k), [2k, 4k), ... up to the sequence length, so that
everything sparse attention can change (queries that see more than k keys) lies past the first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.nn import functional as F

from dsa_train.data import IGNORE_INDEX

from .errors import EvalError


def default_buckets(topk: int, seq_len: int) -> list[int]:
    """Bucket edges [0, k, 2k, 4k, ..., >= seq_len]."""
    edges = [0, topk]
    while edges[-1] < seq_len:
        edges.append(edges[-1] * 2)
    return edges if topk < seq_len else [0, seq_len]


def check_buckets(edges: list[int]) -> list[int]:
    if len(edges) < 2 or edges[0] != 0 or any(b <= a for a, b in zip(edges, edges[1:])):
        raise EvalError(f"--buckets {' '.join(map(str, edges))} are not increasing edges starting at 0",
                        "give edges like --buckets 0 512 1024 2048 (bucket i is [edge i, edge i+1))")
    return edges


def bucket_name(lo: int, hi: int) -> str:
    return f"[{lo},{hi})"


def token_losses(logits: torch.Tensor, labels: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """Cross-entropy per token in fp32, logits [B, T, V], labels [B, T] (-100 ignored) -> [B, T]
    (0 at ignored labels), one row chunk of `chunk` tokens at a time."""
    flat_logits, flat_labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    out = torch.cat([F.cross_entropy(flat_logits[i:i + chunk].float(), flat_labels[i:i + chunk],
                                     ignore_index=IGNORE_INDEX, reduction="none")
                     for i in range(0, flat_labels.numel(), chunk)])
    return out.view(labels.shape)


@dataclass
class LossByPosition:
    """Sums of token losses and counts per bucket; the overall loss is the sum over buckets (every
    valid token lies in exactly one bucket; positions past the last edge go to the last bucket)."""

    edges: list[int]
    loss_sum: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.edges) - 1
        self.loss_sum = self.loss_sum or [0.0] * n
        self.tokens = self.tokens or [0] * n

    def add(self, losses: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor) -> None:
        """losses, labels, position_ids [B, T]."""
        valid = labels != IGNORE_INDEX
        bucket = torch.bucketize(position_ids, torch.tensor(self.edges[1:-1], device=position_ids.device), right=True)
        for i in range(len(self.edges) - 1):
            sel = valid & (bucket == i)
            self.loss_sum[i] += float(losses[sel].double().sum())
            self.tokens[i] += int(sel.sum())

    @property
    def loss(self) -> float:
        n = sum(self.tokens)
        return sum(self.loss_sum) / n if n else float("nan")

    def as_dict(self) -> dict:
        loss = self.loss
        return {
            "loss": loss,
            "perplexity": math.exp(loss) if loss == loss and loss < 700 else None,
            "tokens": sum(self.tokens),
            "buckets": [{"bucket": bucket_name(lo, hi), "lo": lo, "hi": hi, "tokens": n,
                         "loss_sum": s, "loss": (s / n if n else None),
                         "perplexity": (math.exp(s / n) if n and s / n < 700 else None)}
                        for lo, hi, s, n in zip(self.edges, self.edges[1:], self.loss_sum, self.tokens)],
        }
