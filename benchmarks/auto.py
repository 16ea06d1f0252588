"""The auto strategy against every fixed plan, on a math and an embodied workload, in one run.

    python benchmarks/auto.py [--iterations 30] [--rounds 2] [--workloads math,embodied]

Workloads (2 slots; on CPU a slot is a core, one torch thread per slot unless said otherwise):

- ``math``: the tiny math GRPO recipe (warm-started 0.4 M-parameter Qwen2, 128 samples per
  iteration, groups of 8). Fixed plans: the one-worker baseline (both cores' threads, in-process),
  collocated with 2 replicas, disaggregated, and two hybrid placements.
- ``embodied``: PPO with the MLP actor-critic on FetchReachDense-v4, 16 envs x 32 steps. Fixed
  plans: one worker (in-process, 1 and 2 threads), collocated with 2 replicas, and env | policy
  pipelined with 1 and 2 shards per slot (``micro_batches`` 2 and 4).

Every candidate is a fresh process running ``--iterations`` iterations; rounds alternate the
candidates and the median round counts. Throughput is samples (env steps) per second over the
iterations after the first five, for every candidate alike; ``auto`` runs with the processes
launcher and measures its own first two iterations.

- ``auto_over_best_fixed``: auto's throughput over the best fixed plan's, per workload;
- ``prediction_error``: |measured - predicted| / measured of the plan auto ran, median over its
  iterations after the switch (the largest over workloads is reported at top level);
- ``profiling_fraction``: what profiling cost auto: its profiling iterations' seconds minus the
  same iterations' seconds under the fixed plan with the placement auto chose, plus the time to
  start new workers if it changed placement, over the whole auto run's iteration seconds.
  ``profiling_iterations_share`` is the cruder share of the profiling iterations in the run.

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from children import parse_args, recipe_assets, run_child

WARMUP = 5
PROFILING_ITERATIONS = 2
COLLOCATED = "rlinf_lightning.strategies.CollocatedStrategy"
HYBRID = "rlinf_lightning.strategies.HybridStrategy"
ONE_WORKER = {"class_path": COLLOCATED, "init_args": {"replicas": 1}}
ENV_SPLIT = "env: 0, rollout,advantage,actor: 1"


def _hybrid(placement: str, micro_batches: int = 4) -> dict:
    return {"class_path": HYBRID, "init_args": {"placement": placement, "micro_batches": micro_batches}}


# name -> (strategy, launcher, devices, the placement auto's search calls it by)
PLANS = {
    "math": {
        "collocated_1worker": (ONE_WORKER, "inprocess", 2, None),
        "collocated": ("collocated", "processes", 2, "collocated"),
        "disaggregated": ("disaggregated", "processes", 2, "rollout: 0, reward,advantage,inference,actor: 1"),
        "hybrid[rollout,reward: 0, ...]": (
            _hybrid("rollout,reward: 0, advantage,inference,actor: 1"), "processes", 2,
            "rollout,reward: 0, advantage,inference,actor: 1",
        ),
        "hybrid[rollout,reward,advantage: 0, ...]": (
            _hybrid("rollout,reward,advantage: 0, inference,actor: 1"), "processes", 2,
            "rollout,reward,advantage: 0, inference,actor: 1",
        ),
        "auto": ("auto", "processes", 2, None),
    },
    "embodied": {
        "collocated_1worker[t1]": (ONE_WORKER, "inprocess", 1, None),
        "collocated_1worker[t2]": (ONE_WORKER, "inprocess", 2, None),
        "collocated": ("collocated", "processes", 2, "collocated"),
        "pipelined[2]": (_hybrid(ENV_SPLIT, 2), "processes", 2, ENV_SPLIT),
        "pipelined[4]": (_hybrid(ENV_SPLIT, 4), "processes", 2, ENV_SPLIT),
        "auto": ("auto", "processes", 2, None),
    },
}  # fmt: skip


def run_one(spec: dict) -> dict:
    """Child process: one fit; per-iteration seconds, and auto's predictions."""
    from rlinf_lightning import Callback, LMPolicy, RLTrainer, SamplingParams
    from rlinf_lightning.algorithms import PPO
    from rlinf_lightning.policies import MLPActorCritic
    from rlinf_lightning.tasks import EmbodiedTask, MathTask

    class Clock(Callback):
        def __init__(self) -> None:
            self.rows: list[dict[str, float]] = []

        def on_iteration_end(self, trainer, iteration, metrics):
            self.rows.append({k: v for k, v in metrics.items() if k.startswith(("auto/", "time/iteration"))})

    clock = Clock()
    common = dict(
        strategy=spec["strategy"], launcher=spec["launcher"], devices=spec["devices"],
        max_iterations=spec["iterations"], default_root_dir=spec["run_dir"], logger=False,
        enable_progress_bar=False, callbacks=[clock], seed=0, timeout_s=600, precision="32-true",
    )  # fmt: skip
    if spec["workload"] == "math":
        trainer = RLTrainer(**common)
        policy = LMPolicy(spec["model"], lr=1e-4)
        task = MathTask(
            spec["train"], spec["test"], eval_size=8, group_size=8, rollout_batch_size=128,
            sampling=SamplingParams(temperature=1.0, max_new_tokens=6),
        )  # fmt: skip
        samples = 128
    else:
        trainer = RLTrainer(**common, algorithm=PPO(update_epochs=1, num_minibatches=1), num_threads=1)
        policy = MLPActorCritic()
        task = EmbodiedTask(env="FetchReachDense-v4", num_envs=16, steps=32, chunk=1, eval_episodes=1)
        samples = 16 * 32
    trainer.fit(policy, task)
    times = [r["time/iteration"] for r in clock.rows]
    return {
        "samples_per_s": samples * len(times[WARMUP:]) / sum(times[WARMUP:]),
        "times": times,
        "predicted": [r.get("auto/predicted_s") for r in clock.rows],
        "replan_s": trainer.replan_s,
        "plan": trainer.plan.describe(),
        "placement": placement_of(trainer.plan),
    }


def placement_of(plan) -> str:
    """``collocated``, or the groups in the hybrid placement syntax."""
    from rlinf_lightning.flow.plan import format_slots

    if len(plan.groups) == 1:
        return "collocated"
    return ", ".join(f"{','.join(g.stages)}: {format_slots(g.slots)}" for g in plan.groups)


def child(spec: dict) -> dict:
    lines = run_child(__file__, spec, f"{spec['workload']} {spec['name']}")
    return {**json.loads(lines[-1]), "log": [ln for ln in lines if ln.startswith(("auto:", "  "))]}


def _reference(plans: dict, placement: str) -> str | None:
    """The fixed plan with the placement auto ran."""
    return next((name for name, p in plans.items() if p[3] == placement and name != "auto"), None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workloads", default="math,embodied")
    args = parse_args(ap, run_one)
    if args is None:
        return
    work = Path(tempfile.mkdtemp(prefix="rlinf-auto-"))
    assets = recipe_assets(work)
    print(f"cores: {os.cpu_count()}; 2 slots; {args.iterations} iterations per run; {args.rounds} rounds")
    result: dict = {}
    for workload in args.workloads.split(","):
        plans = PLANS[workload]
        runs: dict[str, list[dict]] = {n: [] for n in plans}
        for r in range(args.rounds):
            for name, (strategy, launcher, devices, _) in plans.items():
                spec = {"workload": workload, "name": name, "strategy": strategy, "launcher": launcher,
                        "devices": devices, "iterations": args.iterations, **assets,
                        "run_dir": str(work / f"{workload}-{name}-{r}")}  # fmt: skip
                res = child(spec)
                runs[name].append(res)
                if r == 0 and name == "auto":
                    print("\n".join(res["log"]))
                print(f"round {r}: {workload} {name:<42} {res['samples_per_s']:8.1f} samples/s", flush=True)
        rate = {k: statistics.median(x["samples_per_s"] for x in v) for k, v in runs.items()}
        fixed = {k: v for k, v in rate.items() if k != "auto"}
        best = max(fixed, key=fixed.get)
        auto = sorted(runs["auto"], key=lambda x: x["samples_per_s"])[len(runs["auto"]) // 2]  # median run
        after = [(t, p) for t, p in zip(auto["times"], auto["predicted"]) if p is not None]
        errors = [abs(t - p) / t for t, p in after]
        ref = _reference(plans, auto["placement"])
        k = PROFILING_ITERATIONS
        ref_times = [statistics.median(x["times"][i] for x in runs[ref]) for i in range(k)] if ref else None
        total = sum(auto["times"]) + auto["replan_s"]
        excess = sum(auto["times"][:k]) - (sum(ref_times) if ref_times else 0.0) + auto["replan_s"]
        result[workload] = {
            **{k_: round(v, 1) for k_, v in rate.items()},
            "best_fixed": best,
            "auto_over_best_fixed": round(rate["auto"] / rate[best], 3),
            "auto_plan": auto["placement"],
            "auto_reference_plan": ref,
            "prediction_error": round(statistics.median(errors), 3),
            "profiling_fraction": round(max(0.0, excess) / total, 3),
            "profiling_iterations_share": round((sum(auto["times"][:k]) + auto["replan_s"]) / total, 3),
        }
    per = list(result.values())
    result["auto_over_best_fixed"] = min(v["auto_over_best_fixed"] for v in per)
    result["prediction_error"] = max(v["prediction_error"] for v in per)
    result["profiling_fraction"] = max(v["profiling_fraction"] for v in per)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
