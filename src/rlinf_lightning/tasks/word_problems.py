"""Arithmetic in natural language, for a pretrained chat model (the SmolLM2 recipe).

A chat model reads "Sam has 37 apples and gets 48 more. How many apples does Sam have now?" as it
reads its users, where the tiny recipe's ``What is 37+48?=`` suits a character model that only
ever writes bare numbers. Two kinds:

* ``addition``: two two-digit numbers added, in several wordings;
* ``mix``: the harder mix: subtraction, multiplication by a one-digit number, and two-step word
  problems (add then take away; groups of equal size then more);
* ``products``: two three-digit numbers multiplied, the calculator recipe's task
  (``configs/math_grpo_smollm2_tools.yaml``), which a 135 M model cannot compute in its head.

Each wording is drawn with the numbers, and the splits are twin-free as the tiny recipe's are
(:func:`~rlinf_lightning.tasks.data.write_splits`): the only digits in a prompt are its operands, so
a held-out problem shares its operands, in any order and under any wording or operation, with no
training one. The answer format ("The answer is N.") is the task's ``prompt_template``, not the
data's, so the same files serve any anchored format.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Iterator
from pathlib import Path

from rlinf_lightning.errors import InputError
from rlinf_lightning.tasks.data import Problem, write_splits

NAMES = ("Sam", "Mia", "Leo", "Ana", "Tom", "Zoe", "Ben", "Ivy")
ITEMS = ("apples", "marbles", "stickers", "books", "coins", "shells", "cards", "pencils")

Wording = Callable[[random.Random], tuple[str, int]]  # rng -> (problem text, answer)


def _two_digit(rng: random.Random) -> int:
    return rng.randint(10, 99)


def _addition(rng: random.Random) -> tuple[str, int]:
    a, b, name, item = _two_digit(rng), _two_digit(rng), rng.choice(NAMES), rng.choice(ITEMS)
    text = rng.choice((
        f"What is {a} plus {b}?",
        f"Add {a} and {b}.",
        f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?",
        f"One box holds {a} {item} and another holds {b}. How many {item} are there in all?",
    ))  # fmt: skip
    return text, a + b


def _subtraction(rng: random.Random) -> tuple[str, int]:
    a, b = sorted((_two_digit(rng), _two_digit(rng)), reverse=True)
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    text = rng.choice((
        f"What is {a} minus {b}?",
        f"{name} has {a} {item} and gives {b} of them away. How many {item} are left?",
    ))  # fmt: skip
    return text, a - b


def _multiplication(rng: random.Random) -> tuple[str, int]:
    a, b, item = _two_digit(rng), rng.randint(2, 9), rng.choice(ITEMS)
    text = rng.choice((
        f"What is {a} times {b}?",
        f"Each bag holds {a} {item}. How many {item} are in {b} bags?",
    ))  # fmt: skip
    return text, a * b


def _two_step(rng: random.Random) -> tuple[str, int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    if rng.random() < 0.5:
        a, b = _two_digit(rng), _two_digit(rng)
        c = rng.randint(10, min(99, a + b))
        return (
            f"{name} has {a} {item}, gets {b} more, then gives {c} away. How many {item} does "
            f"{name} have now?",
            a + b - c,
        )
    a, b, c = rng.randint(2, 9), _two_digit(rng), _two_digit(rng)
    text = f"{name} buys {a} packs of {b} {item} and already had {c}. How many {item} does {name} have?"
    return text, a * b + c


def _product(rng: random.Random) -> tuple[str, int]:
    a, b, item = rng.randint(100, 999), rng.randint(100, 999), rng.choice(ITEMS)
    text = rng.choice((
        f"What is {a} times {b}?",
        f"Multiply {a} by {b}.",
        f"Each box holds {a} {item}. How many {item} are in {b} boxes?",
    ))  # fmt: skip
    return text, a * b


#: the wordings each kind draws from, uniformly
KINDS: dict[str, tuple[Wording, ...]] = {
    "addition": (_addition,),
    "mix": (_subtraction, _multiplication, _two_step),
    "products": (_product,),
}

#: operand multisets each kind can draw: two values in 10..99; for the mix also a one-digit
#: multiplier with one or two two-digit values, and three two-digit values; two values in 100..999
POSSIBLE = {
    "addition": math.comb(91, 2),
    "mix": math.comb(91, 2) + 8 * 90 + math.comb(92, 3) + 8 * math.comb(91, 2),
    "products": math.comb(901, 2),
}


def word_problem_draws(kind: str, seed: int = 0) -> Iterator[Problem]:
    """An endless, seeded stream of ``kind``'s problems (:data:`KINDS`)."""
    if kind not in KINDS:
        raise InputError(f"word problems: unknown kind {kind!r}; choose one of {sorted(KINDS)}")
    rng = random.Random(seed)
    while True:
        text, answer = rng.choice(KINDS[kind])(rng)
        yield Problem(text, str(answer))


def generate_word_problems(n: int, kind: str = "addition", seed: int = 0) -> list[Problem]:
    """``n`` problems of ``kind`` (duplicates possible, no split)."""
    return list(itertools.islice(word_problem_draws(kind, seed), n))


def make_word_problem_splits(
    out_dir: str | Path,
    *,
    kind: str = "addition",
    n_train: int = 5000,
    n_validation: int = 100,
    n_test: int = 200,
    seed: int = 0,
) -> dict[str, Path]:
    """Write twin-free ``train``/``validation``/``test.jsonl`` and ``split.json`` of ``kind``'s
    problems to ``out_dir`` (as :func:`~rlinf_lightning.tasks.data.make_arithmetic_splits` does for
    expressions); returns their paths."""
    settings = {k: v for k, v in locals().items() if k != "out_dir"}
    draws = word_problem_draws(kind, seed)
    return write_splits(draws, out_dir, settings, n_train, n_validation, n_test, POSSIBLE[kind])
