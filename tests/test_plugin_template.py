"""The plugin template as a third party would ship it: built and installed with pip (into a
directory of its own, found through ``PYTHONPATH``, so this environment is left as it was), listed by
`rlinf plugins` with its version, and its reward, environment and strategy used by name from the
command line. A broken plugin installed beside it is listed with its error and breaks nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer_defaults import add_broken_plugin, cli_fit_args, logged_metrics

ROOT = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    import shutil

    source, target = tmp_path_factory.mktemp("template") / "src", tmp_path_factory.mktemp("site")
    shutil.copytree(ROOT / "examples" / "plugin_template", source)  # the build writes next to it
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(source)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    add_broken_plugin(target)
    return target


def _run(site: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(list(args), capture_output=True, text=True, timeout=600, env=env)


def test_rlinf_plugins_lists_the_template_with_its_version_and_the_broken_one_with_its_error(site):
    res = _run(site, sys.executable, "-m", "rlinf_lightning.cli", "plugins")
    assert res.returncode == 0, res.stderr
    assert "template (rlinf-plugin-template 0.1.0)" in res.stdout
    assert "plugin broken failed to load: ModuleNotFoundError: No module named 'no_such_module'" in res.stdout
    for name in ("concise_math", "PointReach-v0", "single_worker"):
        assert f"  {name}" in res.stdout and "rlinf-plugin-template" in res.stdout


def test_a_math_fit_uses_the_plugin_reward_and_strategy_by_name(site, assets, tmp_path):
    args = cli_fit_args(
        assets, tmp_path, "--trainer.max_iterations=2", "--task.rollout_batch_size=16",
        "--task.group_size=4", "--task.eval_size=8", "--task.reward=concise_math",
        "--trainer.strategy=single_worker", "--trainer.devices=2",
    )  # fmt: skip
    res = _run(site, *args)
    assert res.returncode == 0, res.stderr
    assert "one worker" in res.stdout  # the plugin strategy's plan: one worker over both slots
    assert "held-out accuracy" in res.stdout
    # the plugin's reward scored the samples: math_verify gives 0 or 1 each, so a mean over 16
    # samples in sixteenths; concise_math's 0.1 for a wrong bare number shows in the mean
    rewards = [
        float(m["reward/reward"]) for m in logged_metrics(tmp_path / "run").values() if "reward/reward" in m
    ]
    assert len(rewards) == 2 and any(not (16 * r).is_integer() for r in rewards), rewards


def test_an_embodied_fit_uses_the_plugin_env_and_strategy_by_name(site, tmp_path):
    config = ROOT / "configs" / "embodied_ppo_fetchreach.yaml"
    res = _run(
        site, sys.executable, "-m", "rlinf_lightning.cli", "fit", f"--config={config}",
        "--task.init_args.env=PointReach-v0", "--task.init_args.num_envs=4", "--task.init_args.steps=8",
        "--task.init_args.eval_episodes=4", "--trainer.strategy=single_worker", "--trainer.max_iterations=2",
        "--trainer.eval_every=0", "--trainer.ckpt_every=0", f"--trainer.default_root_dir={tmp_path / 'run'}",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "one worker" in res.stdout and "held-out success" in res.stdout
