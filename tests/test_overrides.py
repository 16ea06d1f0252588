"""A dotted override of an object given as ``{class_path, init_args}`` lands in its ``init_args``,
for every such object of the shipped configs and for those typed loosely (``task.environment``,
``trainer.strategy``, ``trainer.logger``), where the parser used to keep it apart and the run went
on as if it had never been given; one it still cannot apply is refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rlinf_lightning.cli import algorithm_names_as_classes, build_parser, main
from rlinf_lightning.overrides import _lookup, fold_object_overrides, unapplied_override

CONFIGS = Path(__file__).parents[1] / "configs"
AUTO = "rlinf_lightning.strategies.AutoStrategy"
CSV = "lightning.pytorch.loggers.CSVLogger"


def _objects(node: object, path: str = ""):
    """``(dotted key, init_args)`` of every ``{class_path, init_args}`` object in a config."""
    if isinstance(node, dict):
        if "class_path" in node:
            yield path, node.get("init_args") or {}
        for key, value in node.items():
            if key != "class_path":
                sub = path if key == "init_args" else f"{path}.{key}".lstrip(".")
                yield from _objects(value, sub)


def _changed(value: object) -> object:
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 1
    return f"{value}-changed"


def _shipped() -> list[tuple[str, str, str, object]]:
    """``(config, object key, argument, new value)``: one numeric argument of each object."""
    out = []
    for config in sorted(CONFIGS.glob("*.yaml")):
        for key, init in _objects(yaml.safe_load(config.read_text())):
            arg = next(
                (a for a, v in init.items() if isinstance(v, int | float) and not isinstance(v, bool)), None
            )
            if arg is not None:
                out.append((config.name, key, arg, _changed(init[arg])))
    return out


SHIPPED = _shipped()
TOOLS = (
    "--task.environment={class_path: rlinf_lightning.tools.ToolEnvironment, init_args: {tools: [calculator]}}"
)
LOOSE = [  # objects the shipped configs name in comments and docs, on keys typed loosely
    ("math_grpo_tools_tiny.yaml", [TOOLS, "--task.tools=[]"], "task.environment", "reply_format", "<{}>"),
    ("math_grpo_tiny.yaml", [f"--trainer.strategy={{class_path: {AUTO}}}"], "trainer.strategy", "top", 3),
    ("math_grpo_tiny.yaml", [f"--trainer.logger={{class_path: {CSV}, init_args: {{save_dir: x}}}}"],
     "trainer.logger", "name", "zz"),
]  # fmt: skip


def _parsed(config: str, args: list[str]):
    parser = build_parser()
    argv = algorithm_names_as_classes(["fit", f"--config={CONFIGS / config}", *args])
    cfg = parser.parse_args(fold_object_overrides(parser, argv))
    assert unapplied_override(cfg.fit) is None
    return cfg.fit


def test_every_shipped_config_has_objects_to_override():
    assert {key for _, key, _, _ in SHIPPED} >= {"trainer.algorithm", "policy", "task"}


@pytest.mark.parametrize(
    ("config", "key", "arg", "value"), SHIPPED, ids=[f"{c}:{k}" for c, k, _, _ in SHIPPED]
)
def test_a_dotted_override_of_a_shipped_object_is_applied(config, key, arg, value):
    cfg = _parsed(config, [f"--{key}.init_args.{arg}={value}"])
    assert _lookup(cfg, f"{key}.init_args.{arg}") == value


@pytest.mark.parametrize(("config", "given", "key", "arg", "value"), LOOSE, ids=[c[2] for c in LOOSE])
def test_a_dotted_override_of_a_loosely_typed_object_is_applied(config, given, key, arg, value):
    """Given before and after another override, both with and without ``=``."""
    cfg = _parsed(config, [*given, f"--{key}.init_args.{arg}", str(value), "--trainer.max_iterations=2"])
    spec = _lookup(cfg, key)
    spec = spec.as_dict() if hasattr(spec, "as_dict") else spec
    assert spec["init_args"][arg] == value and set(spec) <= {"class_path", "init_args"}, spec
    assert cfg.trainer.max_iterations == 2


def test_an_override_that_cannot_be_applied_is_refused(capsys):
    config, strategy = CONFIGS / "math_grpo_tiny.yaml", f"--trainer.strategy={{class_path: {AUTO}}}"
    argv = ["fit", f"--config={config}", strategy, "--trainer.strategy.retune_patience=5"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlinf: --trainer.strategy.retune_patience=5: not applied to trainer.strategy"), err
    assert len(err.strip().splitlines()) == 1
