"""PPO on CartPole-v1 from ``configs/embodied_ppo_cartpole.yaml``, against CleanRL's published bar.

    python benchmarks/embodied_cartpole.py [--seeds 0 1] [--steps 500000]

Each seed runs ``rlinf fit`` on the config in a fresh process (CSV logger, nothing else changed
but the seed and, with ``--steps``, the iterations and the annealing horizon), then reads the
per-iteration training metrics and the summary. Per seed:

- ``steps_to_475``: the env steps after which the mean return of the last 20 training episodes
  (the episodes that ended in the trailing iterations, each iteration's mean weighted by its
  count) first reaches 475; ``None`` if it never does;
- ``train_return_last_50k``: the mean return of the training episodes of the last 50k env steps;
- ``eval_return``: the headline, the mean return of the config's deterministic evaluation
  episodes after training (``eval_return_after`` of ``summary.json``);
- ``wall_s``: the fit's wall time (``summary.json``).

The bar (issue 24): a mean episode return >= 475 within 500k env steps, in under 10 minutes, on
seeds 0 and 1 (CleanRL's ppo.py: 490 +- 6 at 500k). Last line: JSON with each seed's figures and
``passed``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "embodied_ppo_cartpole.yaml"
SAMPLES_PER_ITERATION = 4 * 128  # the config's num_envs x steps
STEPS_PER_ITERATION = 4 * 4  # optimizer steps: update_epochs x num_minibatches


def figures(metrics_csv: Path, window: int = 20, tail_steps: int = 50_000) -> dict:
    """``steps_to_475`` and ``train_return_last_50k`` from the CSV logger's rows."""
    rows = [r for r in csv.DictReader(metrics_csv.open()) if r.get("env/env_steps_total")]
    steps = [int(float(r["env/env_steps_total"])) for r in rows]
    # per iteration: (episodes ended, their mean return); an iteration where none ended has none
    ended = [(float(r["env/episodes_total"]), float(r["env/return"] or 0.0)) for r in rows]

    def mean_return(part: list[tuple[float, float]]) -> tuple[float, float]:
        n = sum(c for c, _ in part)
        return n, sum(c * m for c, m in part) / n if n else math.nan

    first, done = None, 0
    for i, step in enumerate(steps):
        done += step
        start = i
        while start > 0 and sum(c for c, _ in ended[start : i + 1]) < window:
            start -= 1  # trailing iterations until they hold `window` episodes
        n, mean = mean_return(ended[start : i + 1])
        if first is None and n >= window and mean >= 475:
            first = done
    cut, seen = len(rows), 0
    while cut > 0 and seen < tail_steps:
        cut, seen = cut - 1, seen + steps[cut - 1]
    return {"env_steps": done, "steps_to_475": first, "train_return_last_50k": mean_return(ended[cut:])[1]}


def run_seed(seed: int, steps: int, work: Path) -> dict:
    iterations = steps // SAMPLES_PER_ITERATION
    root = work / f"seed{seed}"
    argv = [sys.executable, "-m", "rlinf_lightning.cli", "fit", f"--config={CONFIG}",
            f"--trainer.seed={seed}", f"--trainer.default_root_dir={root}", "--trainer.logger=csv",
            "--trainer.enable_progress_bar=false", f"--trainer.max_iterations={iterations}",
            f"--trainer.ckpt_every={iterations}",
            f"--policy.init_args.anneal_lr_steps={iterations * STEPS_PER_ITERATION}"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=env)
    if out.returncode:
        raise RuntimeError(f"seed {seed} failed:\n{out.stderr[-4000:]}")
    summary = json.loads((root / "summary.json").read_text())
    return {
        "seed": seed,
        **figures(root / "logs" / "version_0" / "metrics.csv"),
        "eval_return": summary["eval_return_after"],
        "wall_s": round(summary["wall_s"], 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--steps", type=int, default=500_000)
    args = ap.parse_args()
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        results = []
        for seed in args.seeds:
            r = run_seed(seed, args.steps, Path(tmp))
            print(r, flush=True)
            results.append(r)
    passed = all(
        r["steps_to_475"] is not None and r["eval_return"] >= 475 and r["wall_s"] < 600 for r in results
    )
    print(json.dumps({"seeds": results, "load_at_start": load, "load_at_end": os.getloadavg()[0],
                      "passed": passed}))  # fmt: skip


if __name__ == "__main__":
    main()
