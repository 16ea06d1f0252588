"""The user-written environment of docs/tools.md runs unchanged: its class from the page's Python
block, chosen by the page's YAML block via ``class_path``, on top of the shipped tools config."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from rlinf_lightning.tools import environment_factory

ROOT = Path(__file__).parents[1]


def _blocks(language: str) -> list[str]:
    text = (ROOT / "docs" / "tools.md").read_text()
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def _write_example(tmp_path: Path) -> Path:
    (module,) = [b for b in _blocks("python") if "class DictionarySearch" in b]
    (config,) = [b for b in _blocks("yaml") if "DictionarySearch" in b]
    (tmp_path / "my_search.py").write_text(module)
    (tmp_path / "search.yaml").write_text(config)
    return tmp_path / "search.yaml"


def test_the_docs_environment_answers_from_its_dictionary(tmp_path, monkeypatch):
    config = yaml.safe_load(_write_example(tmp_path).read_text())
    monkeypatch.syspath_prepend(str(tmp_path))
    env = environment_factory(config["task"]["environment"], [])()
    assert env.reset("What is 12*34?=") == "What is 12*34?="
    assert env.step("I look it up: <search>12*34</search>") == ("<res>408</res>", False)
    assert env.step("<search>the moon</search>") == ("<res>no entry</res>", False)


def test_the_docs_environment_runs_unchanged_from_yaml(tmp_path, assets):
    """``rlinf fit`` with the tools config and the page's YAML, the page's module on the path:
    one iteration trains, evaluates and checkpoints."""
    search = _write_example(tmp_path)
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run(
        [sys.executable, "-m", "rlinf_lightning.cli", "fit",
         f"--config={ROOT / 'configs' / 'math_grpo_tools_tiny.yaml'}", f"--config={search}",
         f"--policy.model_path={assets['sft']}", f"--task.train_path={assets['train']}",
         f"--task.test_path={assets['test']}", f"--trainer.default_root_dir={run}",
         "--trainer.max_iterations=1", "--trainer.ckpt_every=1", "--task.eval_size=4",
         "--task.rollout_batch_size=16", "--trainer.logger=false", "--trainer.enable_progress_bar=false"],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["iterations"] == 1 and (run / "checkpoints" / "iter-000001").is_dir(), summary
