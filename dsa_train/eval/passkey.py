"""Passkey retrieval: a random number hidden at a given depth of filler text, asked for at the end.

One example of length T (token ids, built from separately tokenized pieces so that its length is
exact):

    [bos] intro  filler[:d]  needle(key)  filler[d:]  question  key

`needle(key)` = " The pass key is" + key + ". Remember it. " + key + " is the pass key." and the
question " What is the pass key? The pass key is"; `key` is the tokenization of " " + a random
`digits`-digit number, the same ids in the needle and in the answer. The depth is the needle's
place in the filler as a fraction (0: right after the intro, 1: right before the question).

Scoring is teacher-forced greedy decoding: one forward of the whole example, and the answer counts
as retrieved when the argmax at every answer position is the next key token (what greedy decoding
would generate, token by token). `token_accuracy` is the fraction of answer tokens predicted; a
model that ignores the context gets about 1 / vocab_size of them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

import torch

from dsa_train.data import Tokenizer

from .errors import EvalError

INTRO = "There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it."
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
QUESTION = " What is the pass key? The pass key is"
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass
class PasskeyExample:
    input_ids: torch.Tensor  # [T] int64
    answer_start: int  # position of the first key token of the answer
    answer: list[int]  # the key's token ids
    depth: float
    key: str


def build_example(tokenizer: Tokenizer, seq_len: int, depth: float, key: str) -> PasskeyExample:
    enc = tokenizer.encode
    answer = enc(" " + key)
    needle = enc(" The pass key is") + answer + enc(". Remember it.") + answer + enc(" is the pass key.")
    head = [tokenizer.bos_id] + enc(INTRO)
    tail = enc(QUESTION) + answer
    filler_len = seq_len - len(head) - len(needle) - len(tail)
    if filler_len < 0:
        raise EvalError(f"--seq-len {seq_len} is too short for a passkey example "
                        f"({seq_len - filler_len} tokens without filler)",
                        "use a longer --seq-len for --passkey")
    unit = enc(FILLER)
    filler = (unit * (filler_len // len(unit) + 1))[:filler_len]
    cut = round(depth * filler_len)
    ids = head + filler[:cut] + needle + filler[cut:] + tail
    return PasskeyExample(torch.tensor(ids, dtype=torch.int64), seq_len - len(answer), answer, depth, key)


def passkey_examples(tokenizer: Tokenizer, seq_len: int, depths=DEFAULT_DEPTHS, per_depth: int = 1,
                     digits: int = 5, seed: int = 0) -> list[PasskeyExample]:
    rng = random.Random(seed * 1_000_003 + seq_len)
    return [build_example(tokenizer, seq_len, d, str(rng.randrange(10 ** (digits - 1), 10 ** digits)))
            for d in depths for _ in range(per_depth)]


@dataclass
class PasskeyResult:
    depth: float
    retrieved: bool
    answer_tokens: int
    correct_tokens: int


def score_example(logits_fn: Callable[[torch.Tensor], torch.Tensor], example: PasskeyExample) -> PasskeyResult:
    """logits_fn(input_ids [1, T]) -> logits [1, T, V]."""
    logits = logits_fn(example.input_ids[None])
    n = len(example.answer)
    predicted = logits[0, example.answer_start - 1: example.answer_start - 1 + n].argmax(-1)
    correct = int((predicted == torch.tensor(example.answer, device=predicted.device)).sum())
    return PasskeyResult(example.depth, correct == n, n, correct)


def summarize(results: list[PasskeyResult]) -> dict:
    def acc(rs):
        return {"accuracy": sum(r.retrieved for r in rs) / len(rs),
                "token_accuracy": sum(r.correct_tokens for r in rs) / sum(r.answer_tokens for r in rs),
                "examples": len(rs)}

    depths = sorted({r.depth for r in results})
    return {**acc(results), "by_depth": {f"{d:g}": acc([r for r in results if r.depth == d]) for d in depths}}
