"""The advisory check of scripts/advisories.py (a CI step of scripts/test.sh): it finds an affected
installed version and a requirement that admits one, and passes this project as it is."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
_spec = importlib.util.spec_from_file_location("advisories", ROOT / "scripts" / "advisories.py")
advisories = sys.modules["advisories"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(advisories)


def test_an_affected_installed_version_is_found():
    (line,) = advisories.installed_findings({"lightning": "2.6.6", "ray": "2.53.0"})
    assert line.startswith("ray 2.53.0 is installed: CVE-2026-27482"), line
    found = advisories.installed_findings({"lightning": "2.6.3"})
    assert [f.split(": ")[1].split(" ")[0] for f in found] == ["GHSA-w37p-236h-pfx3", "GHSA-qqmf-gpg7-g8gw"]


def test_a_requirement_that_admits_an_affected_version_is_found():
    found = advisories.requirement_findings(["lightning>=2.6"], "pyproject.toml")
    assert found == [
        "pyproject.toml: 'lightning>=2.6' admits lightning 2.6.2 (GHSA-w37p-236h-pfx3: compromised release, "
        "steals keys)",
        "pyproject.toml: 'lightning>=2.6' admits lightning <2.6.6 (GHSA-qqmf-gpg7-g8gw: code execution from "
        "checkpoint hparams)",
    ]
    assert advisories.requirement_findings(["lightning>=2.6,!=2.6.2,!=2.6.3,<2.6.6"], "x")
    assert advisories.requirement_findings(["lightning>=2.6.6", "ray[default]>=2.54"], "x") == []
    assert advisories.requirement_findings(["transformers>=5.4,<5.20"], "x")


def test_this_project_resolves_no_affected_version():
    reqs = advisories.pyproject_requirements(ROOT / "pyproject.toml")
    assert any(r.startswith("lightning>=2.6.6") for r in reqs)
    assert advisories.requirement_findings(reqs, "pyproject.toml") == []
