import json

import pytest

from rlinf_lightning.errors import DataError
from rlinf_lightning.tasks.data import (
    generate_arithmetic,
    load_problems,
    make_arithmetic_splits,
)


def test_generator_is_deterministic_and_correct():
    a = generate_arithmetic(50, operands=3, max_value=9, ops="+-", seed=3)
    assert a == generate_arithmetic(50, operands=3, max_value=9, ops="+-", seed=3)
    assert a != generate_arithmetic(50, operands=3, max_value=9, ops="+-", seed=4)
    for p in a:
        expr = p.prompt.removeprefix("What is ").removesuffix("?=")
        assert str(eval(expr)) == p.answer
        assert sum(ch in "+-" for ch in expr) == 2


def test_splits_are_disjoint(tmp_path):
    train, test = make_arithmetic_splits(tmp_path, n_train=300, n_test=50, max_value=20)
    tr = {p.prompt for p in load_problems(train)}
    te = [p.prompt for p in load_problems(test)]
    assert len(te) == 50 and len(set(te)) == 50
    assert not tr & set(te)


def test_loader_reads_three_formats(tmp_path):
    f = tmp_path / "mixed.jsonl"
    rows = [
        {"prompt": "What is 1+1?=", "answer": "2"},
        {"question": "Tom has 3 apples and buys 1,000 more.", "answer": "3 + 1000 = 1003\n#### 1,003"},
        {"problem": "Compute $\\frac{1}{2}$.", "solution": "It is $\\boxed{\\frac{1}{2}}$."},
    ]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    probs = load_problems(f)
    assert [p.answer for p in probs] == ["2", "1003", "\\frac{1}{2}"]
    assert probs[1].prompt.startswith("Tom has")


@pytest.mark.parametrize(
    "bad, needle",
    [
        ("{not json", "Expecting"),
        ('{"question": "q", "answer": "no marker"}', "####"),
        ('{"problem": "p", "solution": "no box"}', "boxed"),
        ('{"text": "x"}', "unrecognised keys"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, bad, needle):
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "a", "answer": "1"}\n' + bad + "\n")
    with pytest.raises(DataError) as err:
        load_problems(f)
    assert f"{f}:2:" in str(err.value) and needle in str(err.value)
