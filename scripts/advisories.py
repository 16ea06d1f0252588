"""Fail on a dependency version with a known security advisory (a CI step of scripts/test.sh).

No advisory database can be read on these machines (pip-audit and safety fetch theirs at run
time), so the advisories that touch this project's dependencies are listed here, each with the
versions it affects, as read from the advisory (add one here when a new one is published). Two checks:

* the installed version of each package is not affected;
* no requirement in pyproject.toml admits an affected version (its floor is above the last
  affected one, or the affected ones are excluded), so ``pip install`` cannot resolve one.

    python scripts/advisories.py          # exit 1 and one line per finding, 0 when clean
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.version import Version


@dataclass(frozen=True)
class Advisory:
    package: str
    id: str
    affected: tuple[str, ...]  # affected versions: exact ones, or "<X" for every version below X
    what: str

    def affects(self, version: str) -> bool:
        v = Version(version)
        return any(v < Version(a[1:]) if a.startswith("<") else v == Version(a) for a in self.affected)

    def admitted_by(self, req: Requirement) -> str | None:
        """The affected versions ``req`` admits (``"2.6.2"``, ``"<2.6.6"``), or ``None``: each exact
        one is tried, and for a bound the highest version below it (``<2.6.6`` -> ``2.6.5``,
        ``<5.3.0`` -> ``5.2.999``)."""
        for a in self.affected:
            if a.startswith("<"):
                *head, last = Version(a[1:]).release
                sample = [*head, last - 1] if last else [*head[:-1], head[-1] - 1, 999]
                if req.specifier.contains(".".join(map(str, sample)), prereleases=True):
                    return a
            elif req.specifier.contains(a, prereleases=True):
                return a
        return None


ADVISORIES = (
    Advisory("lightning", "GHSA-w37p-236h-pfx3", ("2.6.2", "2.6.3"), "compromised release, steals keys"),
    Advisory("lightning", "GHSA-qqmf-gpg7-g8gw", ("<2.6.6",), "code execution from checkpoint hparams"),
    Advisory("transformers", "CVE-2026-4372", ("<5.3.0",), "code execution from a model's config.json"),
    Advisory("transformers", "CVE-2026-5241", ("<5.5.0",), "trust_remote_code override via a config"),
    Advisory("torch", "CVE-2026-24747", ("<2.10.0",), "weights_only unpickler memory corruption"),
    Advisory("ray", "CVE-2025-62593", ("<2.52.0",), "dashboard code execution via DNS rebinding"),
    Advisory("ray", "CVE-2026-27482", ("<2.54.0",), "dashboard DELETE endpoints reachable from a browser"),
)


def installed_findings(versions: dict[str, str]) -> list[str]:
    """One line per installed ``{package: version}`` an advisory affects."""
    return [
        f"{a.package} {versions[a.package]} is installed: {a.id} ({a.what}); upgrade it"
        for a in ADVISORIES
        if a.package in versions and a.affects(versions[a.package])
    ]


def requirement_findings(requirements: list[str], where: str) -> list[str]:
    """One line per requirement string that admits a version an advisory affects."""
    out = []
    for text in requirements:
        req = Requirement(text)
        for a in ADVISORIES:
            if a.package == req.name.lower() and (bad := a.admitted_by(req)):
                out.append(f"{where}: {text!r} admits {a.package} {bad} ({a.id}: {a.what})")
    return out


def pyproject_requirements(path: Path) -> list[str]:
    project = tomllib.loads(path.read_text(encoding="utf-8"))["project"]
    extras = project.get("optional-dependencies", {}).values()
    return [*project.get("dependencies", []), *(r for reqs in extras for r in reqs)]


def main() -> int:
    root = Path(__file__).resolve().parents[1]
    findings = []
    for pyproject in [root / "pyproject.toml", *sorted((root / "plugins").glob("*/pyproject.toml"))]:
        findings += requirement_findings(pyproject_requirements(pyproject), str(pyproject.relative_to(root)))
    versions = {}
    for name in {a.package for a in ADVISORIES}:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    findings += installed_findings(versions)
    for line in findings:
        print(f"advisories: {line}", file=sys.stderr)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
