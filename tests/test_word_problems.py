"""Natural-language arithmetic for the SmolLM2 recipe: answers right, splits twin-free."""

import json
import re

import pytest

from rlinf_lightning.errors import InputError
from rlinf_lightning.tasks.data import load_problems, operand_multiset
from rlinf_lightning.tasks.word_problems import (
    POSSIBLE,
    generate_word_problems,
    make_word_problem_splits,
)


def _solve(prompt: str) -> int:
    """The answer read back from the wording (an independent reading of each template)."""
    n = [int(x) for x in re.findall(r"\d+", prompt)]
    if "then gives" in prompt:
        return n[0] + n[1] - n[2]
    if "plus" in prompt or prompt.startswith("Add") or "more. How many" in prompt or "in all" in prompt:
        return n[0] + n[1]
    if "minus" in prompt or "away. How many" in prompt:
        return n[0] - n[1]
    if "times" in prompt or "bags?" in prompt or "boxes?" in prompt or prompt.startswith("Multiply"):
        return n[0] * n[1]
    assert "packs of" in prompt, prompt
    return n[0] * n[1] + n[2]


@pytest.mark.parametrize("kind", ["addition", "mix", "products"])
def test_word_problems_are_seeded_and_right(kind):
    problems = generate_word_problems(400, kind, seed=3)
    assert problems == generate_word_problems(400, kind, seed=3) != generate_word_problems(400, kind, seed=4)
    for p in problems:
        assert str(_solve(p.prompt)) == p.answer and int(p.answer) >= 0, p


def test_mix_holds_every_operation():
    prompts = [p.prompt for p in generate_word_problems(400, "mix")]
    for marker in ("minus", "times", "then gives", "packs of"):
        assert any(marker in t for t in prompts), marker


@pytest.mark.parametrize("kind", ["addition", "mix", "products"])
def test_word_splits_hold_out_operand_multisets(tmp_path, kind):
    paths = make_word_problem_splits(tmp_path, kind=kind, n_train=1500, n_validation=50, n_test=200)
    train = {operand_multiset(p.prompt) for p in load_problems(paths["train"])}
    held = {s: [operand_multiset(p.prompt) for p in load_problems(paths[s])] for s in ("validation", "test")}
    for name, keys in held.items():
        assert len(set(keys)) == len(keys) and not train & set(keys), name
    assert not set(held["validation"]) & set(held["test"]) and len(held["test"]) == 200
    record = json.loads(paths["split"].read_text())
    assert record["settings"]["kind"] == kind and record["operand_multisets"]["possible"] == POSSIBLE[kind]


def test_too_many_held_out_word_problems_and_unknown_kinds_are_one_line(tmp_path, monkeypatch, capsys):
    from rlinf_lightning.cli import main
    from rlinf_lightning.tasks import data

    monkeypatch.setattr(data, "MAX_IDLE_DRAWS", 2000)  # 4,095 addition multisets: 5,000 cannot be held out
    with pytest.raises(InputError, match="no new operand multiset .* lower n_test"):
        make_word_problem_splits(tmp_path / "w", n_test=5000, n_validation=0, n_train=10)
    args = ["prepare", f"--model_dir={tmp_path / 'm'}", f"--data_dir={tmp_path}", "--word_problems=[sub]"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--word_problems: unknown kind(s) ['sub']; choose from ['addition', 'mix', 'products']" in err
    assert not (tmp_path / "m").exists()  # refused before anything is built


def test_products_are_two_three_digit_numbers():
    for p in generate_word_problems(200, "products"):
        assert [len(x) for x in re.findall(r"\d+", p.prompt)] == [3, 3], p
