"""RLinf's placement syntax: which stages share which slots.

    "rollout: 0-1, reward,advantage: 0-1, inference,actor: 2-3"
    "actor,rollout,reward: all"

Entries are ``names: slots``, separated by commas (or semicolons, or new lines); names are stage
names separated by commas, slots are ``all`` or numbers and ``a-b`` ranges separated by commas.
Entries with the same slots become one group (their stages share those workers), in the order the
entries first name them. A YAML mapping ``{rollout: 0-1, "inference,actor": 2-3}`` means the same.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from typing import Any

_NAMES = r"[A-Za-z_][\w\-]*(?:\s*,\s*[A-Za-z_][\w\-]*)*"
_SLOTS = r"all|\d+(?:\s*-\s*\d+)?(?:\s*,\s*\d+(?:\s*-\s*\d+)?)*"
_ENTRY = re.compile(rf"\s*(?P<names>{_NAMES})\s*:\s*(?P<slots>{_SLOTS})\s*(?:[,;\n]|$)")
EXAMPLE = "'rollout: 0-1, reward,advantage: 0-1, inference,actor: 2-3'"


def placement_text(spec: str | dict[str, Any]) -> str:
    """The string form of a placement given as a string or a YAML mapping."""
    if isinstance(spec, dict):
        return ", ".join(f"{k}: {v}" for k, v in spec.items())
    return str(spec)


def parse_placement(
    spec: str | dict[str, Any], num_slots: int, stages: Iterable[str]
) -> list[tuple[list[str], list[int]]]:
    """``[(stage names, slots), ...]``, one per group; ``ValueError`` naming the bad part."""
    text = placement_text(spec).strip()
    known = list(stages)
    entries: list[tuple[list[str], list[int]]] = []
    pos = 0
    while pos < len(text):
        m = _ENTRY.match(text, pos)
        if m is None or m.end() == pos:
            raise ValueError(
                f"placement {text!r}: cannot read {text[pos : pos + 30]!r} (at character {pos}); "
                f"write it like {EXAMPLE}"
            )
        names = [n.strip() for n in m["names"].split(",")]
        for n in names:
            if n not in known:
                close = difflib.get_close_matches(n, known, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ValueError(
                    f"placement {text!r}: unknown stage {n!r} (stages: {', '.join(known)}){hint}"
                )
        entries.append((names, _slots(m["slots"], num_slots, text)))
        pos = m.end()
    if not entries:
        raise ValueError(f"placement is empty; write it like {EXAMPLE}")
    groups: dict[tuple[int, ...], list[str]] = {}
    for names, slots in entries:
        groups.setdefault(tuple(slots), []).extend(names)
    return [(names, list(slots)) for slots, names in groups.items()]


def _slots(spec: str, num_slots: int, text: str) -> list[int]:
    if spec.strip() == "all":
        return list(range(num_slots))
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        a, b = int(lo), int(hi or lo)
        if b < a:
            raise ValueError(f"placement {text!r}: slot range {part.strip()!r} runs backwards")
        for s in range(a, b + 1):
            if s >= num_slots:
                raise ValueError(
                    f"placement {text!r}: slot {s} does not exist; there are {num_slots} slots "
                    f"(0-{num_slots - 1}, trainer.devices x trainer.num_nodes)"
                )
            out.append(s)
    return sorted(set(out))
