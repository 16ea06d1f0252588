"""The plugin installers name the plugin and the step that failed, and wait for apt's locks
(another set-up holding them) instead of failing at once. Run with stand-ins for apt-get and
python on PATH: nothing is installed."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

PLUGINS = Path(__file__).parents[1] / "plugins"


def _stub(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/usr/bin/env bash\n{body}\n")
    path.chmod(0o755)


def test_a_failing_step_is_named_with_its_plugin(tmp_path):
    _stub(tmp_path, "python", "exit 1")  # every python call fails: pip first
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin"}
    res = subprocess.run(
        ["bash", str(PLUGINS / "rlinf-vllm" / "install.sh")], capture_output=True, text=True, env=env
    )
    assert res.returncode != 0
    assert "rlinf-vllm/install.sh: failed while installing vLLM with pip (exit 1)" in res.stderr


@pytest.mark.parametrize("plugin", ["rlinf-libero", "rlinf-maniskill"])
def test_apt_get_waits_for_a_lock_another_set_up_holds(tmp_path, plugin):
    script = (PLUGINS / plugin / "install.sh").read_text()
    helper = re.search(r"^apt_get\(\) \{.*?^\}$", script, re.S | re.M).group(0)
    assert "sleep 5" in helper
    helper = helper.replace("sleep 5", "sleep 0.1")  # the same retry, without the real pause
    count = tmp_path / "calls"
    _stub(  # the first call finds the lists lock taken, as when another set-up runs apt-get update
        tmp_path, "apt-get",
        f'echo "$@" >> {count}\n'
        f'if [ "$(wc -l < {count})" = 1 ]; then\n'
        '  echo "E: Could not get lock /var/lib/apt/lists/lock. It is held by process 7 (apt-get)" >&2\n'
        "  exit 100\nfi",
    )  # fmt: skip
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin"}
    res = subprocess.run(
        ["bash", "-c", f"{helper}\napt_get update -qq"], capture_output=True, text=True, env=env, timeout=60
    )
    assert res.returncode == 0, res.stderr
    calls = count.read_text().splitlines()
    assert calls == ["-o DPkg::Lock::Timeout=300 update -qq"] * 2
    _stub(tmp_path, "apt-get", 'echo "E: Unable to locate package nosuch" >&2; exit 100')
    res = subprocess.run(
        ["bash", "-c", f"{helper}\napt_get install nosuch"], capture_output=True, text=True, env=env
    )
    assert res.returncode == 1 and "Unable to locate package nosuch" in res.stderr  # no retry
