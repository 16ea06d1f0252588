"""Math problem data: a deterministic arithmetic generator and a loader for three record layouts.

Files are JSONL (read line by line, so an error names its line) or Parquet (read with Hugging Face
``datasets``: one file, a glob such as ``gsm8k/main/train-*.parquet``, or a directory of them, as a
dataset snapshot from the Hub lays out a split). Every record becomes ``{"prompt": str, "answer":
str}``; the loader accepts, record by record:

* native: ``{"prompt": ..., "answer": ...}``
* GSM8K-style: ``{"question": ..., "answer": "... #### 42"}`` (gold answer after ``####``)
* MATH-style: ``{"problem": ..., "solution": "... \\boxed{42} ..."}`` (gold answer in the last box)
"""

from __future__ import annotations

import itertools
import json
import math
import random
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlinf_lightning.errors import DataError, InputError


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


def last_boxed(text: str) -> str | None:
    """Contents of the last ``\\boxed{...}`` in ``text`` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def _record_to_problem(rec: object) -> Problem:
    problem = _parse_record(rec)
    if not problem.answer:
        raise ValueError("the gold answer is empty")
    return problem


def _parse_record(rec: object) -> Problem:
    if not isinstance(rec, dict):
        raise ValueError("expected a JSON object")
    rec = {k: v for k, v in rec.items() if v is not None}  # null / a Parquet cell left empty
    if "prompt" in rec and "answer" in rec:
        return Problem(str(rec["prompt"]), str(rec["answer"]).strip())
    if "question" in rec and "answer" in rec:
        ans = str(rec["answer"])
        if "####" not in ans:
            raise ValueError("GSM8K-style 'answer' must end with '#### <number>'")
        return Problem(str(rec["question"]), ans.rsplit("####", 1)[1].strip().replace(",", ""))
    if "problem" in rec and "solution" in rec:
        boxed = last_boxed(str(rec["solution"]))
        if boxed is None:
            raise ValueError("MATH-style 'solution' has no \\boxed{...} answer")
        return Problem(str(rec["problem"]), boxed.strip())
    for question, gold in (("prompt", "answer"), ("question", "answer"), ("problem", "solution")):
        if question in rec:
            raise ValueError(f"no gold answer: a record with {question!r} needs {gold!r}")
    raise ValueError(
        f"unrecognised keys {sorted(rec)}; expected prompt/answer, question/answer (GSM8K) "
        "or problem/solution (MATH)"
    )


def load_problems(path: str | Path) -> list[Problem]:
    """Read problems in any of the three layouts (they may be mixed) from JSONL or Parquet.

    Raises :class:`DataError` naming the file, and the line (JSONL) or record (Parquet) of a bad
    record (invalid JSON or UTF-8, no gold answer, unknown layout), or saying the file is missing,
    unreadable or has no problems.
    """
    files = parquet_files(path)
    if files is not None:
        return _load_parquet(files)
    return _load_jsonl(Path(path))


def is_pattern(path: str | Path) -> bool:
    """Whether ``path`` is a glob pattern (``*``, ``?`` or ``[``) rather than one file's path."""
    return any(c in str(path) for c in "*?[")


def parquet_files(path: str | Path) -> list[Path] | None:
    """The Parquet files ``path`` names (a ``.parquet`` file, a glob, or a directory holding
    ``.parquet`` files), or ``None`` when it names something else (read as JSONL)."""
    path = Path(path)
    if is_pattern(path):
        files = sorted(path.parent.glob(path.name))
        if not files:
            raise DataError(f"{path}: no file matches this pattern")
        return files
    if path.is_dir():
        files = sorted(path.glob("*.parquet"))
        if not files:
            raise DataError(f"{path}: a directory with no .parquet files; name a .jsonl or .parquet file")
        return files
    return [path] if path.suffix == ".parquet" else None


def _load_parquet(files: list[Path]) -> list[Problem]:
    from datasets import Dataset

    problems = []
    for file in files:
        if not file.is_file():
            raise DataError(f"{file}: dataset file not found")
        try:  # in memory: nothing is written to the datasets cache for a local file
            with _quiet_datasets():
                records = Dataset.from_parquet(str(file), keep_in_memory=True)
        except Exception as exc:  # pyarrow's errors for a truncated or non-Parquet file vary
            raise DataError(f"{file}: not a readable Parquet file ({type(exc).__name__}: {exc})") from None
        for i, rec in enumerate(records, start=1):
            try:
                problems.append(_record_to_problem(rec))
            except ValueError as exc:
                raise DataError(f"{file}: record {i}: {exc}") from None
    if not problems:
        raise DataError(f"{', '.join(map(str, files))}: no problems found (no records)")
    return problems


@contextmanager
def _quiet_datasets():
    """No progress bar per file and no log line of its own: a bad file is reported once, by us."""
    from datasets.utils import logging

    bars, level = logging.is_progress_bar_enabled(), logging.get_verbosity()
    logging.disable_progress_bar()
    logging.set_verbosity(logging.CRITICAL)
    try:
        yield
    finally:
        logging.set_verbosity(level)
        if bars:
            logging.enable_progress_bar()


def _load_jsonl(path: Path) -> list[Problem]:
    if not path.is_file():
        raise DataError(f"{path}: dataset file not found")
    problems = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
                if not line.strip():
                    continue
                problems.append(_record_to_problem(json.loads(line)))
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"{path}:{lineno}: not UTF-8 text ({exc.reason} at byte {exc.start})"
                ) from None
            except ValueError as exc:  # json.JSONDecodeError is a ValueError
                raise DataError(f"{path}:{lineno}: {exc}") from None
    if not problems:
        raise DataError(f"{path}: no problems found (the file is empty); expected one JSON object per line")
    return problems


def generate_arithmetic(
    n: int, *, operands: int = 2, max_value: int = 49, ops: str = "+", seed: int = 0
) -> list[Problem]:
    """``n`` problems like ``What is 12+7?=`` -> ``19``. Difficulty knobs: operand count and size."""
    return list(itertools.islice(_arithmetic_draws(operands, max_value, ops, seed), n))


def _arithmetic_draws(operands: int, max_value: int, ops: str, seed: int) -> Iterator[Problem]:
    if operands < 2:
        raise ValueError("operands must be >= 2")
    rng = random.Random(seed)
    while True:
        nums = [rng.randint(0, max_value) for _ in range(operands)]
        expr = str(nums[0])
        for x in nums[1:]:
            expr += rng.choice(ops) + str(x)
        yield Problem(f"What is {expr}?=", str(eval(expr)))  # expr is digits and + - * only


#: the operators a word-problem trace names (``tasks.tool_traces.word_traces``)
WORD_OPERATORS = {"times": "*", "plus": "+", "minus": "-"}


def expression_of(prompt: str) -> str:
    """The arithmetic of a generated problem: ``What is 12*34?=`` -> ``12*34``, and of a
    warm-start trace in words, ``What is 12 times 34?`` -> ``12*34`` (what a tool-use trace hands
    the calculator)."""
    match = re.fullmatch(r"What is (.+)\?=", prompt)
    if match is not None:
        return match.group(1)
    words = "|".join(WORD_OPERATORS)
    match = re.fullmatch(rf"What is (-?\d+) ({words}) (-?\d+)\?", prompt)
    if match is None:
        raise ValueError(f"not a generated arithmetic problem: {prompt!r}")
    return f"{match.group(1)}{WORD_OPERATORS[match.group(2)]}{match.group(3)}"


def operand_multiset(prompt: str) -> tuple[int, ...]:
    """The operands of a generated problem, sorted: ``What is 12+7?=`` and ``What is 7+12?=`` (and
    ``7*12``) share ``(7, 12)``. The unit the splits hold out: a model that saw ``7+12`` has seen the
    answer to ``12+7``, so a held-out problem must not share its operands with a training one."""
    return tuple(sorted(int(x) for x in re.findall(r"\d+", prompt)))


def write_jsonl(problems: list[Problem], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for p in problems:
            f.write(json.dumps({"prompt": p.prompt, "answer": p.answer}) + "\n")
    tmp.replace(path)
    return path


SPLIT_RULE = (
    "each operand multiset (a problem's operands, sorted: 12+7 and 7+12 are one) belongs to one "
    "split: the first n_test distinct multisets drawn are the test problems, the next n_validation "
    "the validation problems (one problem each), and train draws only from the multisets neither holds"
)


def make_arithmetic_splits(
    out_dir: str | Path,
    *,
    n_train: int = 20000,
    n_validation: int = 250,
    n_test: int = 500,
    operands: int = 2,
    max_value: int = 49,
    ops: str = "+",
    seed: int = 0,
) -> dict[str, Path]:
    """Write ``train.jsonl``, ``validation.jsonl``, ``test.jsonl`` and ``split.json`` (how they were
    made) to ``out_dir``; returns their paths under the keys ``train``, ``validation``, ``test``,
    ``split``.

    Held-out problems share no operand multiset with train (:data:`SPLIT_RULE`), so held-out accuracy
    measures addition the model was not shown, not recall of a swapped twin. Validation is for
    choices made while training (settings, checkpoints); test stays untouched until the end.
    """
    settings = {k: v for k, v in locals().items() if k != "out_dir"}
    possible = math.comb(max_value + operands, operands)  # multisets of `operands` values in 0..max_value
    if n_test + n_validation >= possible:
        raise InputError(
            f"n_test + n_validation = {n_test + n_validation} held-out operand multisets leave none of "
            f"the {possible} possible ({operands} operands up to {max_value}) for train; lower them or "
            "raise max_value"
        )
    draws = _arithmetic_draws(operands, max_value, ops, seed)
    return write_splits(draws, out_dir, settings, n_train, n_validation, n_test, possible)


#: draws in a row that bring no new problem to any split before :func:`write_splits` gives up
#: (held-out splits asking for more operand multisets than the generator can draw)
MAX_IDLE_DRAWS = 100_000


def write_splits(
    draws: Iterator[Problem],
    out_dir: str | Path,
    settings: dict[str, Any],
    n_train: int,
    n_validation: int,
    n_test: int,
    possible: int,
) -> dict[str, Path]:
    """Deal ``draws`` into test, validation and train by :data:`SPLIT_RULE` and write them with a
    ``split.json`` recording ``settings`` (how the draws were made) and ``possible`` (how many
    operand multisets the generator can draw); the splitting half of :func:`make_arithmetic_splits`,
    shared by every generator of problems whose operands are the numbers in their prompt."""
    want = {"test": n_test, "validation": n_validation, "train": n_train}  # filled in this order
    splits: dict[str, list[Problem]] = {name: [] for name in want}
    home: dict[tuple[int, ...], str] = {}
    idle = 0
    while any(len(splits[name]) < n for name, n in want.items()):
        p = next(draws)
        key = operand_multiset(p.prompt)
        idle += 1
        if key not in home:  # a new multiset: the first held-out split still open, else train
            open_ = [name for name in ("test", "validation") if len(splits[name]) < want[name]]
            home[key] = open_[0] if open_ else "train"
            splits[home[key]].append(p)
            idle = 0
        elif home[key] == "train":  # a held-out split keeps one problem per multiset
            splits["train"].append(p)
            idle = 0
        if idle > MAX_IDLE_DRAWS:
            raise InputError(
                f"{out_dir}: {MAX_IDLE_DRAWS} draws in a row found no new operand multiset for the "
                f"held-out splits ({n_test} test + {n_validation} validation asked); lower n_test or "
                "n_validation"
            )
    out_dir = Path(out_dir)
    paths = {name: write_jsonl(probs, out_dir / f"{name}.jsonl") for name, probs in splits.items()}
    record = {
        "method": "operand multisets held out",
        "rule": SPLIT_RULE,
        "settings": settings,
        "counts": {name: len(probs) for name, probs in splits.items()},
        "operand_multisets": {
            "possible": possible,
            **{name: len({operand_multiset(p.prompt) for p in probs}) for name, probs in splits.items()},
        },
        "distinct_train_prompts": len({p.prompt for p in splits["train"]}),
    }
    split = out_dir / "split.json"
    split.write_text(json.dumps(record, indent=1) + "\n")
    return {**paths, "split": split}


def arithmetic_splits_on_disk(out_dir: str | Path, **settings: Any) -> dict[str, Path] | None:
    """The paths :func:`make_arithmetic_splits` wrote to ``out_dir`` with these keyword arguments
    and the current :data:`SPLIT_RULE`, or ``None``: files missing, other settings, or data split by
    an older rule (no ``split.json``: test problems whose swapped twins are in train)."""
    out_dir = Path(out_dir)
    paths = {name: out_dir / f"{name}.jsonl" for name in ("train", "validation", "test")}
    paths["split"] = out_dir / "split.json"
    if not all(path.is_file() for path in paths.values()):
        return None
    record = json.loads(paths["split"].read_text())
    return paths if record.get("rule") == SPLIT_RULE and record.get("settings") == settings else None
