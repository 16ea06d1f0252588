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

import json
import random
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rlinf_lightning.errors import DataError


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
    if operands < 2:
        raise ValueError("operands must be >= 2")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        nums = [rng.randint(0, max_value) for _ in range(operands)]
        expr = str(nums[0])
        for x in nums[1:]:
            expr += rng.choice(ops) + str(x)
        out.append(Problem(f"What is {expr}?=", str(eval(expr))))  # expr is digits and + - * only
    return out


def write_jsonl(problems: list[Problem], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for p in problems:
            f.write(json.dumps({"prompt": p.prompt, "answer": p.answer}) + "\n")
    tmp.replace(path)
    return path


def make_arithmetic_splits(
    out_dir: str | Path,
    *,
    n_train: int = 20000,
    n_test: int = 500,
    operands: int = 2,
    max_value: int = 49,
    ops: str = "+",
    seed: int = 0,
) -> tuple[Path, Path]:
    """Write ``train.jsonl`` and ``test.jsonl``; test prompts never appear in train."""
    problems = generate_arithmetic(
        (n_train + n_test) * 3, operands=operands, max_value=max_value, ops=ops, seed=seed
    )
    seen: set[str] = set()
    test: list[Problem] = []
    for p in problems:
        if len(test) == n_test:
            break
        if p.prompt not in seen:
            seen.add(p.prompt)
            test.append(p)
    train = [p for p in problems if p.prompt not in seen][:n_train]
    out_dir = Path(out_dir)
    return write_jsonl(train, out_dir / "train.jsonl"), write_jsonl(test, out_dir / "test.jsonl")
