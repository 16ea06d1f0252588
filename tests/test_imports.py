"""The package's import direction: every run-time import (module level or inside a function; not
under ``TYPE_CHECKING``) goes from a higher layer to a strictly lower one, so no part reaches back
into what builds on it (a task never imports the trainer, a strategy never imports a task)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).parents[1] / "src"
PACKAGE = "rlinf_lightning"

#: lowest first; a top-level module or subpackage may import only from earlier layers (and itself)
LAYERS = [
    {"errors", "registry", "judge", "prompts", "assets", "seeds", "console", "malloc", "overrides"},
    {"flow", "kernels"},
    {"algorithms", "checkpoint", "envs", "loggers", "rewards", "policies", "pretrained"},
    {"engines"},
    {"evaluation", "tools"},
    {"workflows"},
    {"tasks", "launchers", "strategies"},
    {"callbacks"},
    {"trainer"},
    {"sft", "export"},
    {"testing", "cli", ""},  # "": the package's __init__
]
RANK = {part: i for i, layer in enumerate(LAYERS) for part in layer}


def _part(module: str) -> str:
    """The top-level part of ``rlinf_lightning.<part>.<...>`` ("" for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _runtime_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    type_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    out = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PACKAGE):
            if node.module == PACKAGE:  # from rlinf_lightning import tasks
                out |= {f"{PACKAGE}.{a.name}" for a in node.names}
            else:
                out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith(PACKAGE)}
    return out


def imports_by_part() -> dict[tuple[str, str], list[str]]:
    """``{(importer part, imported part): [importing file, ...]}`` across parts."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        rel = path.relative_to(SRC).with_suffix("")
        module = ".".join(p for p in rel.parts if p != "__init__")
        for target in _runtime_imports(path):
            a, b = _part(module), _part(target)
            if a != b:
                edges.setdefault((a, b), []).append(str(path.relative_to(SRC)))
    return edges


def test_every_part_has_a_layer():
    parts = {_part(f"{PACKAGE}.{p.stem if p.is_file() else p.name}") for p in (SRC / PACKAGE).iterdir()}
    parts = {p for p in parts if not p.startswith("__") and p != "py"} | {""}
    assert parts - RANK.keys() == set(), "add new top-level modules to LAYERS"


def test_no_upward_runtime_import():
    upward = [
        f"{', '.join(files)} imports {PACKAGE}.{b} ({b!r} is layer {RANK[b]}, {a!r} only {RANK[a]})"
        for (a, b), files in imports_by_part().items()
        if RANK[b] >= RANK[a]
    ]
    assert not upward, "\n".join(upward)


def test_the_trainer_its_connectors_and_the_fit_loop_import_in_one_direction():
    """Type-only imports aside, no module of ``trainer/`` imports one that imports it back (directly
    or through others): the trainer builds the connectors and the fit loop and hands them what they
    need (the fit loop gets the workflow and the plan), so none reaches back into it."""
    inside = f"{PACKAGE}.trainer."
    graph = {
        path.stem: {t.removeprefix(inside) for t in _runtime_imports(path) if t.startswith(inside)}
        for path in (SRC / PACKAGE / "trainer").glob("*.py")
        if path.stem != "__init__"
    }

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        after = graph.get(start, ())
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in after)

    assert graph["trainer"] >= {"fit_loop", "plan_connector"}  # the graph is read
    assert not [m for m in graph if reaches(m, m, {m})], graph
