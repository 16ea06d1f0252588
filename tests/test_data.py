import json
import math

import pytest

from rlinf_lightning.errors import DataError, InputError
from rlinf_lightning.tasks.data import (
    generate_arithmetic,
    load_problems,
    make_arithmetic_splits,
    operand_multiset,
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
    paths = make_arithmetic_splits(tmp_path, n_train=300, n_validation=20, n_test=50, max_value=20)
    tr = {p.prompt for p in load_problems(paths["train"])}
    va = [p.prompt for p in load_problems(paths["validation"])]
    te = [p.prompt for p in load_problems(paths["test"])]
    assert len(te) == 50 and len(set(te)) == 50 and len(va) == 20 and len(set(va)) == 20
    assert not tr & set(te) and not tr & set(va) and not set(va) & set(te)


def test_no_held_out_problem_shares_its_operands_with_train(tmp_path):
    """Not only the prompt: ``b+a`` must not be in train when ``a+b`` is held out (the old split,
    which held out prompts only, had 405 of its 500 test problems' swapped twins in train)."""
    paths = make_arithmetic_splits(
        tmp_path, n_train=2000, n_validation=100, n_test=200, max_value=30, ops="+*"
    )
    train = {operand_multiset(p.prompt) for p in load_problems(paths["train"])}
    held = {
        name: [operand_multiset(p.prompt) for p in load_problems(paths[name])]
        for name in ("validation", "test")
    }
    for name, keys in held.items():
        assert not train & set(keys), (name, len(train & set(keys)))
        assert len(set(keys)) == len(keys), name  # one problem per held-out multiset
    assert len(train) == math.comb(32, 2) - 300  # every multiset not held out is drawn for train
    assert not set(held["validation"]) & set(held["test"])
    record = json.loads(paths["split"].read_text())
    assert record["counts"] == {"test": 200, "validation": 100, "train": 2000}
    assert record["operand_multisets"] == {"possible": 496, "test": 200, "validation": 100, "train": 196}
    assert record["settings"]["seed"] == 0 and record["method"] == "operand multisets held out"
    assert operand_multiset("What is 12+7?=") == operand_multiset("What is 7*12?=") == (7, 12)


def test_prepare_keeps_current_splits_and_rewrites_older_ones(tmp_path):
    from rlinf_lightning.tasks.data import arithmetic_splits_on_disk

    settings = dict(n_train=100, n_validation=10, n_test=20, operands=2, max_value=20, ops="+", seed=0)
    paths = make_arithmetic_splits(tmp_path, **settings)
    assert arithmetic_splits_on_disk(tmp_path, **settings) == paths
    assert arithmetic_splits_on_disk(tmp_path, **{**settings, "seed": 1}) is None
    paths["split"].unlink()  # data from before split.json: prompts held out, twins in train
    assert arithmetic_splits_on_disk(tmp_path, **settings) is None


def test_too_many_held_out_problems_name_the_keys(tmp_path, capsys):
    from rlinf_lightning.cli import main

    with pytest.raises(InputError, match="n_test \\+ n_validation = 70 .* none of the 66 possible"):
        make_arithmetic_splits(tmp_path, n_test=60, n_validation=10, max_value=10)
    assert main(["prepare", f"--model_dir={tmp_path / 'm'}", f"--data_dir={tmp_path}", "--n_test=2000"]) == 2
    assert "rlinf prepare: n_test + n_validation = 2250" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()  # refused before the model is built


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
