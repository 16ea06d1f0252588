"""What ``rlinf`` shows at each verbosity, through real subprocesses as a user runs it: ``--quiet``
keeps warnings and errors and drops INFO messages and the progress line; ``--verbose`` adds DEBUG
messages. A broken plugin on the path is the warning: real, and cheap to cause."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from trainer_defaults import add_broken_plugin, cli_fit_args

PROGRESS = re.compile(r"^it +1/1 ", re.M)  # ProgressBar's line for the only iteration
EVAL = re.compile(r"^eval @ it \d+: held-out ", re.M)
INFO = ("execution plan: ", "held-out accuracy: ")  # the trainer's records: the plan, the result
DEBUG = re.compile(r"^worker \S+: pid \d+, device cpu, ", re.M)  # launchers/base.py, after setup
WARNING = re.compile(r"^WARNING: plugin broken failed to load \(ModuleNotFoundError: ", re.M)


def _rlinf(args: list[str], flag: str | None, site: Path) -> subprocess.CompletedProcess:
    """``args`` (``python -m rlinf_lightning.cli <subcommand> ...``) with ``flag`` before the subcommand."""
    args = args[:3] + ([flag] if flag else []) + args[3:]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("site")
    add_broken_plugin(site)
    return site


@pytest.fixture(scope="module")
def fits(assets, site, tmp_path_factory) -> dict[str | None, subprocess.CompletedProcess]:
    """One-iteration ``rlinf fit`` at each verbosity, the three side by side."""
    flags = (None, "--quiet", "--verbose")
    with ThreadPoolExecutor(len(flags)) as pool:
        runs = {
            flag: pool.submit(
                _rlinf,
                cli_fit_args(
                    assets, tmp_path_factory.mktemp("run"), "--trainer.max_iterations=1", "--task.eval_size=8"
                ),
                flag,
                site,
            )
            for flag in flags
        }
        out = {flag: run.result() for flag, run in runs.items()}
    for res in out.values():
        assert res.returncode == 0, res.stderr
    return out


def test_by_default_progress_and_warnings_show_and_debug_does_not(fits):
    res = fits[None]
    assert PROGRESS.search(res.stdout) and EVAL.search(res.stdout), res.stdout
    assert all(line in res.stdout for line in INFO), res.stdout
    assert WARNING.search(res.stderr), res.stderr
    assert not DEBUG.search(res.stdout + res.stderr), res.stdout


def test_quiet_drops_info_and_the_progress_line_and_keeps_warnings(fits):
    res = fits["--quiet"]
    assert res.stdout == "", res.stdout  # no progress line, no plan, no result
    assert WARNING.search(res.stderr), res.stderr


def test_verbose_shows_debug_messages(fits):
    res = fits["--verbose"]
    assert DEBUG.search(res.stdout), res.stdout
    assert PROGRESS.search(res.stdout) and WARNING.search(res.stderr)


@pytest.mark.slow  # 40 s in CI (prepare builds the data and models); --quiet stays in the fits above
def test_quiet_drops_the_info_messages_of_prepare(assets, site, tmp_path):
    prepare = [sys.executable, "-m", "rlinf_lightning.cli", "prepare", f"--model_dir={assets['sft']}"]
    prepare += [f"--data_dir={assets['train'].parent}"]
    res = _rlinf(prepare, None, site)
    assert res.returncode == 0 and f"prepare: model exists at {assets['sft']}" in res.stdout, res.stderr
    quiet = _rlinf(prepare, "--quiet", site)
    assert quiet.returncode == 0 and quiet.stdout == "", quiet.stdout


def test_quiet_keeps_errors(assets, site, tmp_path):
    res = _rlinf(cli_fit_args(assets, tmp_path, "--trainer.timeout_s=0"), "--quiet", site)
    assert res.returncode == 2
    assert "  trainer.timeout_s: must be > 0, got 0.0" in res.stderr.splitlines(), res.stderr
    assert WARNING.search(res.stderr), res.stderr  # and the warning before it


def test_a_flag_of_rlinf_given_after_the_subcommand_says_where_it_goes(assets, site, tmp_path):
    res = _rlinf(cli_fit_args(assets, tmp_path, "--quiet"), None, site)
    assert res.returncode == 2
    *before, last = res.stderr.strip().splitlines()
    assert last == (
        "rlinf: unrecognized arguments: --quiet; --quiet is an option of rlinf itself: give it first, "
        "e.g. rlinf --quiet fit ..."
    )
    # plugins load first (a registered algorithm name resolves to its class before parsing), so
    # the site's broken plugin is reported, at the default level, and nothing else is
    assert all(WARNING.match(line) for line in before), before
