"""Held-out accuracy gained by every LLM algorithm preset on the tiny math task, side by side.

    python benchmarks/algorithms.py [--iterations 800] [--presets grpo,dapo] [--eval-size 500]

The setup of ``configs/math_grpo_tiny.yaml`` for every preset: the same warm start (the SFT model
``rlinf prepare`` + ``rlinf sft`` make, reused from ``artifacts/`` or built as
``benchmarks/children.recipe_assets`` does), the same twin-free held-out split (no test problem
shares its operands with a training one), the same seed, the same learning rate decayed linearly
to 0 over the run (:data:`RECIPE_POLICY`), ``iterations x 128`` training samples each (DAPO's
dynamic sampling generates more to fill its batches; it trains on as many). Each preset runs
with its paper's defaults (``docs/algorithms.md``) in a fresh process; ``ppo`` also trains a
critic (``task.critic``: a ``ValueModel`` from the same warm start) with the options of
:data:`PPO_OPTIONS`. Printed per preset: held-out accuracy before and after, the gain, wall
seconds; the last line is one JSON object with ``gains`` (preset -> gain), ``min_gain`` and the
rest.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from children import parse_args, recipe_assets, run_child

from rlinf_lightning.algorithms.presets import PRESETS

ROLLOUT_BATCH_SIZE = 128  # the recipe's: 16 prompts x 8 samples
#: the recipe's ``LMPolicy`` options; its learning rate decays linearly to 0 over the run's iterations
RECIPE_POLICY = {"lr": 1e-4, "max_grad_norm": 1.0}
#: ``ppo`` on this budget: the algorithm's options and its critic's (``ValueModel``) options. One
#: optimizer step per rollout batch, as every other preset here takes (PPO's 4 epochs x 4
#: mini-batches at the recipe's lr 1e-4 took one smoke run from 0.625 to 0.125 on 8 held-out
#: problems in 3 iterations of 16 samples);
#: the critic starts from a zero head, so it learns at 10x the policy's lr and alone for the first
#: 5 iterations. Measured: 40 iterations, 200 held-out problems, 0.360 -> 0.465.
PPO_OPTIONS: dict[str, dict] = {
    "algorithm": {"update_epochs": 1, "num_minibatches": 1, "critic_warmup": 5},
    "critic": {"lr": 1e-3},
}
#: every preset the benchmark runs: the LLM presets, then PPO with its critic
PRESET_NAMES = (*PRESETS, "ppo")


def run_one(spec: dict) -> dict:
    """Child process: one fit of one preset; its summary's accuracies and wall time."""
    import csv

    from rlinf_lightning import LMPolicy, RLTrainer, SamplingParams
    from rlinf_lightning.algorithms import PPO
    from rlinf_lightning.policies import ValueModel
    from rlinf_lightning.tasks import MathTask

    ppo = spec["preset"] == "ppo"
    options = {**(PPO_OPTIONS["algorithm"] if ppo else {}), **spec.get("options", {})}
    task = MathTask(
        spec["train"],
        spec["test"],
        reward="math_verify",
        eval_size=spec["eval_size"],
        group_size=8,
        rollout_batch_size=ROLLOUT_BATCH_SIZE,
        train_micro_batch_size=64,
        sampling=SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=6),
        critic=ValueModel(**PPO_OPTIONS["critic"]) if ppo else None,
    )
    t0 = time.perf_counter()
    trainer = RLTrainer(
        algorithm=PPO(**options) if ppo else PRESETS[spec["preset"]](**options),
        strategy="collocated",
        max_staleness=spec.get("max_staleness", 0),
        launcher="inprocess",
        max_iterations=spec["iterations"],
        eval_every=spec.get("eval_every", 0),
        default_root_dir=spec["root"],
        logger="csv",
        enable_progress_bar=False,
        seed=spec["seed"],
    )
    options = {**RECIPE_POLICY, "anneal_lr_steps": spec["iterations"], **spec.get("policy", {})}
    policy = LMPolicy(spec["model"], **options)
    summary = trainer.fit(policy, task)
    wall = time.perf_counter() - t0
    resampled, capped, staleness = 0.0, [], []
    with open(Path(spec["root"]) / "logs" / "version_0" / "metrics.csv") as f:
        for row in csv.DictReader(f):
            resampled += float(row.get("rollout/resampled_groups") or 0.0)
            if row.get("async/behaviour_weight"):
                capped.append(float(row["async/behaviour_weight_clipped_frac"]))
            if row.get("async/staleness"):  # the mean (beside _std and _max)
                staleness.append(float(row["async/staleness"]))
    return {
        "before": summary["accuracy_before"],
        "after": summary["accuracy_after"],
        "curve": {int(h["iteration"]): round(h["accuracy"], 4) for h in summary["eval_history"]},
        "capped_frac_max": max(capped, default=None),
        "staleness_mean": sum(staleness) / len(staleness) if staleness else None,
        "wall_s": wall,
        "resampled_groups": resampled,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=800, help="RL iterations per preset (x 128 samples)")
    ap.add_argument("--presets", default=",".join(PRESET_NAMES), help="comma-separated preset names")
    ap.add_argument("--eval-size", type=int, default=None, help="held-out problems (default: all 500)")
    ap.add_argument("--seed", type=int, default=0)
    args = parse_args(ap, run_one)
    if args is None:
        return
    presets = [p for p in args.presets.split(",") if p]
    unknown = sorted(set(presets) - set(PRESET_NAMES))
    if unknown:
        raise SystemExit(f"unknown preset(s) {unknown}; known: {', '.join(PRESET_NAMES)}")
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        assets = recipe_assets(Path(tmp) / "assets")
        for preset in presets:
            spec = {
                **assets,
                "preset": preset,
                "iterations": args.iterations,
                "eval_size": args.eval_size,
                "seed": args.seed,
                "root": str(Path(tmp) / preset),
            }
            r = json.loads(run_child(__file__, spec, preset)[-1])
            results[preset] = r
            print(
                f"{preset:<30} held-out accuracy {r['before']:.3f} -> {r['after']:.3f} "
                f"({r['after'] - r['before']:+.3f}) in {r['wall_s']:.0f} s"
                + (f", {r['resampled_groups']:.0f} groups resampled" if r["resampled_groups"] else ""),
                flush=True,
            )
    gains = {p: round(r["after"] - r["before"], 4) for p, r in results.items()}
    print(
        json.dumps(
            {
                "gains": gains,
                "min_gain": min(gains.values()),
                "before": {p: r["before"] for p, r in results.items()},
                "after": {p: r["after"] for p, r in results.items()},
                "wall_s": {p: round(r["wall_s"], 1) for p, r in results.items()},
                "iterations": args.iterations,
                "samples": args.iterations * ROLLOUT_BATCH_SIZE,
                "seed": args.seed,
            }
        )
    )


if __name__ == "__main__":
    main()
