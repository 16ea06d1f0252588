"""The configuration reference page, generated from the real ``rlinf`` parsers when the site builds.

MkDocs hook (``hooks:`` in ``mkdocs.yml``): :func:`on_files` adds ``reference/configuration.md``
to the build from :func:`render_reference`, so the page is never a stale committed copy. It walks
``rlinf_lightning.cli.build_parser()`` (jsonargparse): every ``rlinf fit`` key of ``trainer``
(dataclass values such as ``task.sampling`` expanded field by field), every built-in
``RLModule`` / ``Task`` class (the core package's and those of installed plugins) with its
``init_args``, the classes registered under ``trainer.strategy`` / ``launcher`` / ``algorithm`` /
``train_engine`` with theirs, the registries' names, and the ``rlinf sft``, ``rlinf prepare`` and
``rlinf export`` keys. Types and defaults come from the signatures, descriptions from the docstrings (what
``--help`` prints). ``tests/test_docs.py`` checks that every key the parsers accept is on the page.
"""

from __future__ import annotations

import dataclasses
import html
import inspect
import json
import re
import types
import typing
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

PAGE = "reference/configuration.md"
_SKIP_DESTS = {"help", "print_config"}


@dataclass
class Key:
    name: str  # dotted, as in YAML nesting and on the command line (``--trainer.devices=2``)
    type: str
    default: str
    help: str


@dataclass
class Section:
    id: str  # heading anchor; tests find a section's keys by it
    title: str
    level: int
    intro: str = ""
    keys: list[Key] = field(default_factory=list)


# -- walking parsers ---------------------------------------------------------------------------------
def _type_text(hint: Any) -> str:
    if hint is None or hint is inspect.Parameter.empty:
        return ""
    if hint is typing.Any:
        return "Any"
    if hint is type(None):
        return "None"
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " | ".join(_type_text(a) for a in typing.get_args(hint))
    if inspect.isclass(hint) and not isinstance(hint, types.GenericAlias):
        return hint.__name__
    text = str(hint).replace("typing.", "").replace("NoneType", "None")
    return re.sub(r"\b(?:[A-Za-z_]\w*\.)+([A-Za-z_]\w*)", r"\1", text)  # drop module paths


def _default_text(action: Any) -> str:
    if getattr(action, "required", False):
        return "required"
    value = action.default
    if hasattr(value, "class_path"):  # a Namespace(class_path=...) default of a subclass key
        return f"class_path: {value.class_path}"
    try:
        return json.dumps(value)
    except TypeError:
        return repr(value)


def _help_text(text: str | None) -> str:
    text = " ".join((text or "").split())
    text = re.sub(r":(?:meth|class|func|attr|data|mod):`~?([^`]+)`", r"`\1`", text)  # Sphinx roles
    return text.replace("``", "`")


def _dataclasses_in(hint: Any) -> list[type]:
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    return [a for a in args if dataclasses.is_dataclass(a)]


def _class_parser(cls: Any) -> Any:
    """The parser jsonargparse builds for a class's ``init_args``."""
    from jsonargparse import ArgumentParser

    p = ArgumentParser(exit_on_error=False)
    p.add_class_arguments(cls, fail_untyped=False)
    return p


def parser_keys(parser: Any, prefix: str = "") -> list[Key]:
    """Every key ``parser`` accepts, with dataclass-typed keys expanded into their fields.

    A key whose type is a class hierarchy (``policy``, ``task``) is listed as ``<key>.class_path``;
    each class's ``init_args`` are documented in a section of their own (:func:`class_sections`).
    """
    keys: list[Key] = []
    for action in parser._actions:
        dest = action.dest
        name = type(action).__name__
        skipped = ("_ActionConfigLoad", "_ActionHelpClassPath", "_HelpAction", "ActionSubCommands")
        if dest in _SKIP_DESTS or name in skipped:
            continue
        hint = getattr(action, "_typehint", None)
        full = prefix + dest
        if name == "_StoreTrueAction":
            keys.append(Key(full, "flag", "", _help_text(action.help)))
            continue
        if name == "ActionConfigFile":
            keys.append(Key(full, "path", "", "a YAML file of these keys (`--config` on the command line)"))
            continue
        keys.append(Key(full, _type_text(hint), _default_text(action), _help_text(action.help)))
        if hint is not None and _is_class_hierarchy(hint):
            keys[-1] = Key(
                f"{full}.class_path",
                f"{hint.__name__} subclass",
                keys[-1].default,
                f"import path of any `{hint.__name__}` subclass (a user's own too); its constructor "
                f"arguments go under `{full}.init_args` (or directly under `{full}`)",
            )
        for dc in _dataclasses_in(hint):
            keys += parser_keys(_class_parser(dc), prefix=f"{full}.")
    return keys


def _is_class_hierarchy(hint: Any) -> bool:
    return (
        inspect.isclass(hint)
        and hint is not typing.Any  # a class since Python 3.11
        and not dataclasses.is_dataclass(hint)
        and hint.__module__ != "builtins"
    )


def class_keys(cls: Any, prefix: str) -> list[Key]:
    return parser_keys(_class_parser(cls), prefix=prefix)


# -- which classes ship ------------------------------------------------------------------------------
def _shipped_packages() -> set[str]:
    from rlinf_lightning.registry import PLUGIN_GROUP, load_plugins

    load_plugins()
    return {"rlinf_lightning"} | {
        ep.value.split(":")[0].split(".")[0] for ep in entry_points(group=PLUGIN_GROUP)
    }


def public_path(cls: type) -> str:
    """``package.Class`` when the defining module's package re-exports it, else ``module.Class``."""
    import importlib

    module = cls.__module__
    parent = module.rpartition(".")[0]
    if parent and getattr(importlib.import_module(parent), cls.__name__, None) is cls:
        return f"{parent}.{cls.__name__}"
    return f"{module}.{cls.__name__}"


def shipped_subclasses(base: type) -> list[type]:
    """Concrete subclasses of ``base`` defined in the core package or an installed plugin."""
    import rlinf_lightning.policies  # noqa: F401  (defines the built-in policies)
    import rlinf_lightning.tasks  # noqa: F401  (and tasks)

    packages = _shipped_packages()
    found: set[type] = set()
    stack = list(base.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if (
            cls.__module__.split(".")[0] in packages
            and not inspect.isabstract(cls)
            and not cls.__name__.startswith("_")
        ):
            found.add(cls)
    return sorted(found, key=public_path)


def section_id(kind: str, cls: Any) -> str:
    """Anchor of a class's section, e.g. ``policy-lmpolicy``."""
    return f"{kind}-{cls.__name__.lower()}"


def _summary(obj: Any) -> str:
    doc = inspect.getdoc(obj) or ""
    return _help_text(doc.split("\n\n")[0])


# -- the page ----------------------------------------------------------------------------------------
def component_classes() -> list[tuple[str, str, Any]]:
    """(registry kind, trainer key, registry) of the registries whose entries take arguments."""
    from rlinf_lightning.algorithms import ALGORITHMS
    from rlinf_lightning.engines import TRAIN_ENGINES
    from rlinf_lightning.launchers import LAUNCHERS
    from rlinf_lightning.strategies import STRATEGIES

    return [
        ("strategy", "trainer.strategy.init_args", STRATEGIES),
        ("launcher", "trainer.launcher.init_args", LAUNCHERS),
        ("algorithm", "trainer.algorithm.init_args", ALGORITHMS),
        ("train_engine", "trainer.train_engine_options", TRAIN_ENGINES),
    ]


def build_sections(parser: Any = None) -> list[Section]:
    """The page's sections, from ``parser`` (default: ``rlinf_lightning.cli.build_parser()``)."""
    from rlinf_lightning.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSSES
    from rlinf_lightning.cli import build_parser, subcommand_parser
    from rlinf_lightning.engines import ROLLOUT_ENGINES
    from rlinf_lightning.envs import ENVS
    from rlinf_lightning.loggers import LOGGERS
    from rlinf_lightning.rewards import REWARDS
    from rlinf_lightning.tools import TOOLS

    parser = parser or build_parser()
    fit = subcommand_parser(parser, "fit")
    fit_keys = parser_keys(fit)
    out = [
        Section(
            "fit",
            "`rlinf fit`",
            2,
            "RL training. Keys of `RLTrainer` (`trainer.*`), the policy and the task, and `ckpt_path`.",
            [k for k in fit_keys if not k.name.startswith(("policy", "task"))],
        )
    ]
    for kind, base_name in (("policy", "RLModule"), ("task", "Task")):
        action = next(a for a in fit._actions if a.dest == kind)
        base = action._typehint
        out.append(
            Section(
                kind,
                f"`{kind}`",
                3,
                f"A `{base_name}` picked by `{kind}.class_path` (default: "
                f"`{action.default.class_path}`). Built-in classes and their `init_args`:",
                [k for k in fit_keys if k.name.startswith(kind)],
            )
        )
        for cls in shipped_subclasses(base):
            out.append(
                Section(
                    section_id(kind, cls),
                    f"`{public_path(cls)}`",
                    4,
                    _summary(cls),
                    class_keys(cls, f"{kind}.init_args."),
                )
            )
    out.append(
        Section(
            "components",
            "Components chosen by name",
            3,
            "`trainer.strategy`, `trainer.launcher` and `trainer.algorithm` take a registered name or a "
            "`{class_path, init_args}` value; `trainer.train_engine_options` are the keyword arguments of "
            "the train engine that `trainer.train_engine` names. Registered entries (built in, or added "
            "by an installed plugin) and the arguments of those that take any:",
        )
    )
    for kind, prefix, registry in component_classes():
        out.append(Section(f"registry-{kind}", f"`{kind}` names", 4, _registry_table(registry)))
        for name in registry:
            obj = registry.get(name)
            if not inspect.isclass(obj) or not (keys := class_keys(obj, f"{prefix}.")):
                continue
            out.append(
                Section(
                    section_id(kind, obj),
                    f"`{public_path(obj)}` (`{name}`)",
                    5,
                    _summary(obj),
                    keys,
                )
            )
    for kind, key, registry in (
        ("rollout", "task.init_args.rollout", ROLLOUT_ENGINES),
        ("advantage estimator", "trainer.algorithm.init_args.advantage_estimator", ADVANTAGE_ESTIMATORS),
        ("policy loss", "trainer.algorithm.init_args.policy_loss", POLICY_LOSSES),
        ("reward", "task.init_args.reward", REWARDS),
        ("env", "task.init_args.env", ENVS),
        ("tool", "task.init_args.tools", TOOLS),
        ("logger", "trainer.logger", LOGGERS),
    ):
        extra = "\n\nAny gymnasium id works too (built in)." if kind == "env" else ""
        out.append(
            Section(
                f"registry-{kind.replace(' ', '-')}",
                f"`{kind}` names (`{key}`)",
                4,
                _registry_table(registry) + extra,
            )
        )
    out.append(
        Section(
            "rlinf",
            "`rlinf` (every subcommand)",
            2,
            "Options of `rlinf` itself, given before the subcommand: `rlinf --quiet fit --config ...`.",
            parser_keys(parser),
        )
    )
    subcommands = (
        ("sft", "Supervised warm start"),
        ("prepare", "Build the tiny model and data"),
        ("export", "Write a checkpoint as a model directory"),
    )
    for name, what in subcommands:
        out.append(
            Section(
                name,
                f"`rlinf {name}`",
                2,
                f"{what}: keys at the top level of its config file, or `--key=value`.",
                parser_keys(subcommand_parser(parser, name)),
            )
        )
    return out


def _registry_table(registry: Any) -> str:
    rows = ["| name | from | what |", "|---|---|---|"]
    rows += [
        f"| `{n}` | {origin} | {_cell(_describe(registry.get(n), desc))} |"
        for n, origin, desc in registry.describe()
    ]
    return "\n".join(rows)


def _describe(obj: Any, desc: str) -> str:
    """The registry's one-line description, or the docstring's first paragraph when that line starts it
    (the registry keeps only a docstring's first line, often cut mid-sentence)."""
    doc = inspect.getdoc(obj) or ""
    return _summary(obj) if desc and doc.startswith(desc) else _help_text(desc)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render(sections: list[Section]) -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated from the code (`rlinf_lightning.cli.build_parser()`) each time this site is built: "
        "every key, its type, its default and its description (the docstrings, as `--help` prints "
        "them). A dotted key is YAML nesting in a `--config` file, or a flag: `task.sampling.top_p` "
        "is `--task.sampling.top_p=0.9`. `rlinf fit --print_config` prints a resolved config.",
        "",
    ]
    for s in sections:
        lines += [f"{'#' * s.level} {s.title} {{#{s.id}}}", ""]
        if s.intro:
            lines += [s.intro, ""]
        if s.keys:
            lines += ["| key | type | default | description |", "|---|---|---|---|"]
            lines += [
                f"| `{k.name}` | {_code(k.type)} | {_code(k.default)} | {_cell(k.help)} |" for k in s.keys
            ]
            lines.append("")
    return "\n".join(lines)


def _code(text: str) -> str:
    """Inline code for a table cell: HTML, since a pipe in a Markdown code span would split the cell
    (and an escaped one shows its backslash)."""
    return f"<code>{html.escape(text).replace('|', '&#124;')}</code>" if text else ""


def render_reference(parser: Any = None) -> str:
    return render(build_sections(parser))


def section_text(markdown: str, anchor: str) -> str:
    """The text under the heading with ``{#anchor}``, up to the next heading."""
    match = re.search(rf"^#+ .*\{{#{re.escape(anchor)}\}}\n(.*?)(?=^#|\Z)", markdown, re.M | re.S)
    return match.group(1) if match else ""


def missing_keys(markdown: str, expected: dict[str, set[str]]) -> dict[str, set[str]]:
    """Keys of ``expected`` (section anchor -> keys) that the section does not document."""
    out = {}
    for anchor, keys in expected.items():
        text = section_text(markdown, anchor)
        if missing := {k for k in keys if f"| `{k}` |" not in text}:
            out[anchor] = missing
    return out


# -- mkdocs hook -------------------------------------------------------------------------------------
def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    files.append(File.generated(config, PAGE, content=render_reference()))
    return files
