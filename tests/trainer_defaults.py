"""Small, fast RLTrainer settings and helpers shared by the tests (a module, not conftest, so that
test directories of plugins, each with their own conftest, can be collected in the same run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlinf_lightning import Callback
from rlinf_lightning.launchers.base import oversubscription

#: the plans on which the ``processes`` and ``ray`` launchers take code paths in-process workers do
#: not: channels between worker processes and a weight sync between groups (``disaggregated``), and
#: a data-parallel group whose replicas are processes taking turns on shared slots with other
#: groups' workers (``overlapping``: ddp ranks, context switching). Ray's object-store channels and
#: actors are the same whatever the plan, so one plan serves it (its ddp rendezvous across nodes:
#: tests/test_ray_cluster.py).
DIFFERING = {"inprocess": None, "processes": ("disaggregated", "overlapping"), "ray": ("disaggregated",)}


def launcher_matrix(plans, launchers=("inprocess", "processes", "ray"), differing=None) -> list:
    """``(plan, launcher)`` test parameters: every plan in process, and under another launcher the
    plans where its code paths differ (``differing``, by launcher; :data:`DIFFERING` by default);
    the rest of the matrix runs with ``-m slow`` (``bash scripts/test.sh --all``)."""
    differing = {**DIFFERING, **(differing or {})}
    return [
        pytest.param(
            plan,
            launcher,
            id=f"{plan}-{launcher}",
            marks=() if differing[launcher] is None or plan in differing[launcher] else pytest.mark.slow,
        )  # fmt: skip
        for launcher in launchers
        for plan in plans
    ]


def scaled(seconds: float) -> float:
    """``seconds`` times how much busier than its cores this machine is (the launchers'
    :func:`~rlinf_lightning.launchers.base.oversubscription`, as their set-up deadline): a bound
    that catches a hang or a lost wake-up on a quiet machine, and still holds on one running other
    jobs (a 2-core box at load 14 runs a test ~7x slower). For start-up timeouts and for wall-clock
    bounds asserted after the fact."""
    return seconds * oversubscription()


class MetricsRecorder(Callback):
    """Each iteration's metrics as the loggers receive them (``keys``: only those)."""

    def __init__(self, keys: tuple[str, ...] | None = None) -> None:
        self.keys = keys
        self.metrics: list[dict[str, float]] = []

    def on_iteration_end(self, trainer, iteration, metrics):
        self.metrics.append({k: metrics[k] for k in self.keys} if self.keys else dict(metrics))


def tiny_task(assets: dict, **over):
    """A MathTask on the test assets with small batches: 4 prompts x 4 samples per iteration."""
    from rlinf_lightning.tasks import MathTask

    kw = dict(group_size=4, rollout_batch_size=16, train_micro_batch_size=8, eval_size=8)
    return MathTask(str(assets["train"]), str(assets["test"]), **{**kw, **over})


def tiny_trainer_kwargs(tmp_path: Path, **over) -> dict:
    kw = dict(
        max_iterations=3,
        default_root_dir=str(tmp_path / "run"),
        enable_progress_bar=False,
        logger=False,
        seed=0,
        timeout_s=scaled(60),
    )
    kw.update(over)
    return kw


def cli_fit_args(assets: dict, tmp_path: Path, *overrides: str) -> list[str]:
    """`rlinf fit` on the recipe config, pointed at the test assets and a run dir under ``tmp_path``."""
    import sys

    config = Path(__file__).parents[1] / "configs" / "math_grpo_tiny.yaml"
    return [
        sys.executable, "-m", "rlinf_lightning.cli", "fit", f"--config={config}",
        f"--policy.model_path={assets['sft']}", f"--task.train_path={assets['train']}",
        f"--task.test_path={assets['test']}", f"--trainer.default_root_dir={tmp_path / 'run'}",
        *overrides,
    ]  # fmt: skip


def add_broken_plugin(site: Path) -> None:
    """Install into ``site`` (a directory on ``PYTHONPATH``) a plugin whose module is gone."""
    broken = site / "broken_plugin-0.0.1.dist-info"
    broken.mkdir(parents=True)
    (broken / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.0.1\n")
    (broken / "entry_points.txt").write_text("[rlinf_lightning.plugins]\nbroken = no_such_module:register\n")


def logged_metrics(run_dir: Path, version: int = 0) -> dict[int, dict[str, str]]:
    """``{step: {metric: value}}`` from the CSV logger of the run in ``run_dir`` (its
    ``default_root_dir``); a step's rows (iteration and evaluation) are merged."""
    import csv

    rows: dict[int, dict[str, str]] = {}
    with open(run_dir / "logs" / f"version_{version}" / "metrics.csv") as f:
        for row in csv.DictReader(f):
            rows.setdefault(int(row["step"]), {}).update({k: v for k, v in row.items() if v})
    return rows


def cmdline(p) -> str:
    """A ``psutil.Process``'s command line ("" once it ended)."""
    import psutil

    try:
        return " ".join(p.cmdline())
    except psutil.Error:  # ended while we looked
        return ""


def worker_processes(root=None) -> list:
    """The ``processes`` launcher's worker processes under ``root`` (a ``psutil.Process``, default
    this one), alive or not yet reaped: spawned ones (``spawn_main``), and those forked by its
    fork server (the server's own command line, under a parent with it: not the server itself)."""
    import psutil

    server = "multiprocessing.forkserver import main"
    out = []
    for p in (root or psutil.Process()).children(recursive=True):
        c = cmdline(p)
        if "spawn_main" in c or (server in c and server in cmdline(p.parent() or p)):
            out.append(p)
    return out
