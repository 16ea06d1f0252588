"""The documentation's configuration reference documents every key the ``rlinf`` parsers accept.

The reference page is generated at build time by ``docs/hooks/config_reference.py`` (a MkDocs
hook). Here the accepted keys are derived from the parsers a second way, by parsing: a namespace
of defaults with each built-in policy / task class selected (jsonargparse fills its ``init_args``)
and ``task.sampling`` set (so its dataclass fields appear), flattened to dotted keys. The
strategy, launcher, algorithm and train-engine classes are typed ``Any`` in ``RLTrainer``, so their
keys come from their constructors' signatures.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import sys
import typing
from pathlib import Path

import pytest

from rlinf_lightning.cli import _fit_parser, build_parser, subcommand_parser

ROOT = Path(__file__).resolve().parents[1]


def _load_hook():
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "docs/hooks/config_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


ref = _load_hook()


@pytest.fixture(scope="module")
def markdown() -> str:
    return ref.render_reference()


def _flat(ns, kind: str) -> set[str]:
    return {k for k in ns.keys() if k.split(".")[0] == kind}


def fit_expected(fit) -> dict[str, set[str]]:
    """Section anchor -> the keys ``fit`` accepts there, found by parsing."""
    from rlinf_lightning.policies.module import RLModule
    from rlinf_lightning.tasks.base import Task

    defaults = fit.parse_args([], _skip_validation=True)
    expected = {
        "fit": {k for k in defaults.keys() if k.split(".")[0] not in ("policy", "task")},
        "policy": {"policy.class_path"},
        "task": {"task.class_path"},
    }
    for kind, base in (("policy", RLModule), ("task", Task)):
        for cls in ref.shipped_subclasses(base):
            # a dataclass-typed argument (MathTask.sampling) set to its defaults shows its fields
            dataclass_args = [
                f"--{kind}.init_args.{name}={{}}"
                for name, hint in typing.get_type_hints(cls.__init__).items()
                if any(dataclasses.is_dataclass(t) for t in (hint, *typing.get_args(hint)))
            ]
            argv = [f"--{kind}.class_path={ref.public_path(cls)}", *dataclass_args]
            ns = fit.parse_args(argv, _skip_validation=True)
            expected[ref.section_id(kind, cls)] = _flat(ns, kind) - {f"{kind}.class_path"}
    return expected


def component_expected() -> dict[str, set[str]]:
    expected = {}
    for kind, prefix, registry in ref.component_classes():
        for name in registry:
            obj = registry.get(name)
            if inspect.isclass(obj):
                params = inspect.signature(obj).parameters
                if params:
                    expected[ref.section_id(kind, obj)] = {f"{prefix}.{p}" for p in params}
    return expected


def subcommand_expected(name: str) -> set[str]:
    return set(subcommand_parser(build_parser(), name).get_defaults().keys())


def test_the_builtin_classes_are_found():
    import rlinf_lightning.policies as policies
    import rlinf_lightning.tasks as tasks
    from rlinf_lightning.policies.module import RLModule
    from rlinf_lightning.tasks.base import Task

    for module, base in ((policies, RLModule), (tasks, Task)):
        exported = {
            getattr(module, n)
            for n in module.__all__
            if inspect.isclass(getattr(module, n))
            and issubclass(getattr(module, n), base)
            and getattr(module, n) is not base
        }
        assert exported and exported <= set(ref.shipped_subclasses(base))


def test_every_key_is_in_the_reference(markdown):
    expected = {
        **fit_expected(_fit_parser()),
        **component_expected(),
        "sft": subcommand_expected("sft"),
        "prepare": subcommand_expected("prepare"),
        "export": subcommand_expected("export"),
        "rlinf": set(build_parser().get_defaults().keys()) - {"command"},
    }
    assert all(expected.values())
    assert (
        "task.init_args.sampling.temperature" in expected["task-mathtask"] and "policy-lmpolicy" in expected
    )
    assert ref.missing_keys(markdown, expected) == {}


def test_a_key_missing_from_the_reference_fails(markdown):
    fit = _fit_parser()
    fit.add_argument("--trainer.undocumented_knob", type=int, default=3, help="added by the test")
    expected = fit_expected(fit)
    assert ref.missing_keys(markdown, expected) == {"fit": {"trainer.undocumented_knob"}}
    # a reference generated from that parser documents it, with its help
    sections = ref.build_sections()
    sections[0].keys = ref.parser_keys(fit)
    assert ref.missing_keys(ref.render(sections), expected) == {}
    # a key documented in the wrong section does not count
    moved = markdown.replace("| `policy.init_args.model_path` |", "| `policy.init_args.renamed` |", 1)
    assert "policy-lmpolicy" in ref.missing_keys(moved, expected)


def test_mkdocs_uses_the_hook():
    config = (ROOT / "mkdocs.yml").read_text()
    assert "docs/hooks/config_reference.py" in config and ref.PAGE in config
    assert not (ROOT / "docs" / ref.PAGE).exists()  # generated at build time, never committed
