"""The README stays short and its Python example is the example file users run, word for word."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_readmes_python_example_is_examples_math_grpo_py():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```python\n(.*?)^```$", readme, re.S | re.M)
    assert len(blocks) == 1, "one Python example in the README"
    assert blocks[0] == (ROOT / "examples" / "math_grpo.py").read_text(encoding="utf-8")


def test_the_readme_is_under_15_kb_and_links_pages_that_exist():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.encode()) < 15_000
    for link in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / link).is_file(), link
