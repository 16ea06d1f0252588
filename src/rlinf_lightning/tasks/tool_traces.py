"""Warm-start problems for the calculator recipe: easier problems whose tool-use traces teach the
call format and copying, not the task (docs/tools.md, benchmarks/tools.py).

The task is products of two numbers up to 999; no trace is a product of two three-digit numbers,
and none shares its operands with a held-out problem. Each kind is there for a failure seen in the
warm start's greedy calls on held-out products without it:

* products up to 99x99: the ``*`` and short results;
* a three-digit number times a digit, either side: without them every three-digit call it had seen
  was a sum, and it wrote ``<calc>833+394</calc>`` for ``864*394``;
* a three-digit number times a number up to 99 (the three-digit one first): without them it wrote
  a digit for the ``*`` or miscopied the operand after it (``<calc>8649394</calc>``) on most calls;
  with them also the other way round it copied the task itself (right on 61-63% before any RL);
* sums and differences up to 999: three-digit operands after the operator;
* sums and differences up to 999999: copying five- and six-digit replies into the answer (without
  them it cut ``<res>483608</res>`` to ``4308``).
"""

from __future__ import annotations

import random
import re
from pathlib import Path

from rlinf_lightning.tasks.data import (
    WORD_OPERATORS,
    Problem,
    expression_of,
    generate_arithmetic,
    load_problems,
    operand_multiset,
    write_jsonl,
)

#: traces of each kind
PER_KIND = 200


def _by_three_digits(rng: random.Random, n: int, small: int, either_side: bool) -> list[Problem]:
    """``n`` products of a three-digit number and a number up to ``small`` (the three-digit one
    first, or alternately either side)."""
    pairs = [(rng.randint(100, 999), rng.randint(0, small)) for _ in range(n)]
    return [
        Problem(f"What is {x}*{y}?=" if i % 2 or not either_side else f"What is {y}*{x}?=", str(x * y))
        for i, (x, y) in enumerate(pairs)
    ]


def calculator_traces(held_out: list[str | Path], out: str | Path, per_kind: int = PER_KIND) -> Path:
    """Write the warm-start problems (``per_kind`` of each kind of the module docstring, less those
    sharing an operand multiset with a problem of the ``held_out`` files) to ``out``; its path."""
    skip = {operand_multiset(p.prompt) for path in held_out for p in load_problems(path)}
    rng = random.Random(3)
    problems = [
        *generate_arithmetic(per_kind, max_value=99, ops="*", seed=1),
        *_by_three_digits(rng, per_kind, 9, either_side=True),
        *_by_three_digits(rng, per_kind, 99, either_side=False),
        *generate_arithmetic(per_kind, max_value=999, ops="+-", seed=2),
        *generate_arithmetic(per_kind, max_value=999999, ops="+-", seed=4),
    ]
    return write_jsonl([p for p in problems if operand_multiset(p.prompt) not in skip], out)


def word_traces(held_out: list[str | Path], out: str | Path, per_kind: int = PER_KIND) -> Path:
    """:func:`calculator_traces`' problems asked in words, for a chat model
    (``configs/math_sft_tools_smollm2.yaml``): ``What is 12*34?=`` becomes ``What is 12 times
    34?``, which :func:`~rlinf_lightning.tasks.data.expression_of` reads back as ``12*34`` for the
    trace's call. One wording, so that the call is always the same copy of the question's numbers;
    the task's other wordings are left to RL."""
    words = {op: word for word, op in WORD_OPERATORS.items()}
    calculator_traces(held_out, out, per_kind)
    problems = []
    for p in load_problems(out):
        a, op, b = re.fullmatch(r"(\d+)([*+-])(\d+)", expression_of(p.prompt)).groups()
        problems.append(Problem(f"What is {a} {words[op]} {b}?", p.answer))
    return write_jsonl(problems, out)
