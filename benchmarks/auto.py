"""The auto strategy against every fixed plan, on a math and an embodied workload, in one run:
its whole fit, and its simulator scored on plans it did not run.

    python benchmarks/auto.py [--iterations 30] [--rounds 5] [--workloads math,embodied]

Workloads (2 slots; on CPU a slot is a core, one torch thread per slot unless said otherwise):

- ``math``: the tiny math GRPO recipe (warm-started 0.4 M-parameter Qwen2, 128 samples per
  iteration, groups of 8). Fixed plans: the one-worker baseline (both cores' threads, in-process),
  collocated with 2 replicas, disaggregated, and two hybrid placements.
- ``embodied``: PPO with the MLP actor-critic on FetchReachDense-v4, 16 envs x 32 steps. Fixed
  plans: one worker (in-process, 1 and 2 threads), collocated with 2 replicas, and env | policy
  pipelined with 1 and 2 shards per slot (``micro_batches`` 2 and 4).

Auto is given the launcher the multi-worker fixed plans use (``processes``); a one-worker plan
it runs in its own process, as the one-worker fixed plans do. Every candidate is a fresh process
running ``--iterations`` iterations. A round runs auto first,
then every fixed plan; rounds repeat that order, so machine noise hits every candidate in every
round. Each figure is computed per round (auto against the fixed plans of its round) and reported
as the median over rounds with its spread (``*_spread``: [min, max] over rounds).

- ``samples_per_s``: samples (env steps) per second over the iterations after the first five
  (``WARMUP``), for every candidate alike; ``wall_s``: the whole ``trainer.fit`` from launching
  the workers to the end (for auto: profiling, search, worker restarts included), with the start
  and end evaluations every candidate runs; ``outside_iterations_s``: the part of it outside the
  iterations (launching workers, evaluations, and for auto its search and restarts).
- ``auto_over_best_fixed``: auto's samples/s over the fixed plan with the best median samples/s
  (steady state only).
- ``auto_wall_over_best_fixed``: the wall time of the fixed plan with the best median wall time
  over auto's (a speed ratio: 0.9 means auto's whole fit took 1/0.9 as long).
- ``prediction_error_unprofiled``: auto's simulator out of sample. From the profile auto saved in
  its run (``profile.json``, written after its two profiling iterations), before any fixed plan
  of the round runs, each fixed plan is built as its own run would build it (same strategy,
  resources, batch shape) and simulated; error = |measured - predicted| / measured, measured being
  the plan's median seconds per iteration after the warm-up. The figure is the median over the
  fixed plans; ``predictions`` gives each plan's. A plan the simulator does not model (a worker
  spanning a number of slots auto never measured) is listed there with the reason and left out
  of the median. The one-worker plans are the placements auto
  profiled in (``profiled: true``; ``PROFILED``): its run is separate, but auto measured one worker
  on one slot (math: iterations 1-2, the overhead calibrated on the second) and on every slot
  (math: iteration 3, its speed-up, timed again at 4 before narrowing to one slot; embodied, one
  granularity: iteration 1 on one slot, iteration 2 on both, the overhead calibrated on it).
  ``prediction_error_never_run`` is the median over the other plans only: those whose placement
  auto never ran.
- ``prediction_error_in_sample``: auto's own ``auto/predicted_s`` against its measured iterations
  after profiling, median: in sample (the overhead is calibrated on, and re-tuning re-fits from,
  the very iterations it is scored on); a check of the re-tuning loop, not of the simulator.
- ``profiling_fraction``: what auto cost once, over its wall time: its wall time minus that of the
  fixed plan with the placement auto ran (``auto_reference_plan``), less the steady-state
  difference (iterations after the warm-up x the difference of their median seconds). It counts
  everything auto does once: the profiling iterations, the search and simulations, a restart of
  the workers and the warm-up after it. Reported raw: negative when the noise between two runs
  exceeds the cost. ``profiling_iterations_share`` is the cruder share of the profiling iterations
  and restarts in auto's iteration seconds (its profiling iterations: those without
  ``auto/predicted_s``).
- ``bars``: per figure with a bar (``BARS``), ``met`` (every round meets it), ``missed`` (no
  round does) or ``straddles`` (the spread crosses the bar: the median alone says which side).

The last line is one JSON object; its top level holds each figure's worst workload.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from children import parse_args, placement_of, recipe_assets, run_child

WARMUP = 5
PROFILING_ITERATIONS = 4  # at most, auto on 2 slots: one slot at two sizes, both (twice to narrow)
BARS = {"prediction_error_unprofiled": (max, 0.20), "auto_wall_over_best_fixed": (min, 0.90)}
COLLOCATED = "rlinf_lightning.strategies.CollocatedStrategy"
HYBRID = "rlinf_lightning.strategies.HybridStrategy"
ONE_WORKER = {"class_path": COLLOCATED, "init_args": {"replicas": 1}}
ENV_SPLIT = "env: 0, rollout,advantage,actor: 1"
AUTO = ("auto", "processes", 2, None)


def _hybrid(placement: str, micro_batches: int = 4) -> dict:
    return {"class_path": HYBRID, "init_args": {"placement": placement, "micro_batches": micro_batches}}


# fixed plans: name -> (strategy, launcher, devices, the placement auto's search calls it by)
PLANS = {
    "math": {
        "collocated_1worker": (ONE_WORKER, "inprocess", 2, "one worker[2 slots]"),
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
    },
    "embodied": {
        "collocated_1worker[t1]": (ONE_WORKER, "inprocess", 1, "one worker[1 slots]"),
        "collocated_1worker[t2]": (ONE_WORKER, "inprocess", 2, "one worker[2 slots]"),
        "collocated": ("collocated", "processes", 2, "collocated"),
        "pipelined[2]": (_hybrid(ENV_SPLIT, 2), "processes", 2, ENV_SPLIT),
        "pipelined[4]": (_hybrid(ENV_SPLIT, 4), "processes", 2, ENV_SPLIT),
    },
}  # fmt: skip
# the fixed plans with a placement auto's profiling ran (one worker, on one slot or every slot)
PROFILED = ("collocated_1worker", "collocated_1worker[t1]", "collocated_1worker[t2]")


def _build(spec: dict):
    """The trainer, policy and task of one candidate, and its samples per iteration."""
    from rlinf_lightning import LMPolicy, RLTrainer, SamplingParams
    from rlinf_lightning.algorithms import PPO
    from rlinf_lightning.policies import MLPActorCritic
    from rlinf_lightning.tasks import EmbodiedTask, MathTask

    common = dict(
        strategy=spec["strategy"], launcher=spec["launcher"], devices=spec["devices"],
        max_iterations=spec["iterations"], default_root_dir=spec["run_dir"], logger=False,
        enable_progress_bar=False, callbacks=spec.get("callbacks", []), seed=0, timeout_s=600,
        precision="32-true",
    )  # fmt: skip
    if spec["workload"] == "math":
        task = MathTask(
            spec["train"], spec["test"], eval_size=8, group_size=8, rollout_batch_size=128,
            sampling=SamplingParams(temperature=1.0, max_new_tokens=6),
        )  # fmt: skip
        return RLTrainer(**common), LMPolicy(spec["model"], lr=1e-4), task, 128
    trainer = RLTrainer(**common, algorithm=PPO(update_epochs=1, num_minibatches=1), num_threads=1)
    task = EmbodiedTask(env="FetchReachDense-v4", num_envs=16, steps=32, chunk=1, eval_episodes=1)
    return trainer, MLPActorCritic(), task, 16 * 32


def predict(profile_path: Path, fixed: dict[str, dict]) -> dict[str, float | str]:
    """Each fixed plan's seconds per iteration, simulated from a saved profile on the plan its
    own run would build (nothing is launched), or why it is not predicted."""
    from rlinf_lightning.strategies.auto.profile import Profile
    from rlinf_lightning.strategies.auto.simulate import simulate

    profile, out = Profile.load(profile_path), {}
    for name, spec in fixed.items():
        trainer, policy, task, _ = _build(spec)
        workflow, plan = trainer.build_plan(policy, task)
        batch = task.batch_shape(trainer.run_spec).rollout_batch_size
        try:
            out[name] = simulate(workflow, plan, profile, batch)
        except ValueError as exc:
            out[name] = str(exc)
    return out


def run_one(spec: dict) -> dict:
    """Child process: one fit; per-iteration seconds, its wall time, and for auto its in-run
    predictions and (``spec["predict"]``) the fixed plans' predictions from its profile."""
    from rlinf_lightning import Callback

    class Clock(Callback):
        def __init__(self) -> None:
            self.rows: list[dict[str, float]] = []

        def on_iteration_end(self, trainer, iteration, metrics):
            self.rows.append({k: v for k, v in metrics.items() if k.startswith(("auto/", "time/iteration"))})

    clock = Clock()
    trainer, policy, task, samples = _build({**spec, "callbacks": [clock]})
    summary = trainer.fit(policy, task)
    times = [r["time/iteration"] for r in clock.rows]
    out = {
        "samples_per_s": samples * len(times[WARMUP:]) / sum(times[WARMUP:]),
        "times": times,
        "wall_s": summary["wall_s"],
        "iterations_s": summary["train_wall_s"],
        "predicted": [r.get("auto/predicted_s") for r in clock.rows],
        "replan_s": summary["replan_s"],
        "plan": trainer.plan.describe(),
        "placement": placement_of(trainer.plan),
    }
    if spec.get("predict"):
        out["fixed_predicted_s"] = predict(Path(spec["run_dir"]) / "profile.json", spec["predict"])
    return out


def child(spec: dict) -> dict:
    lines = run_child(__file__, spec, f"{spec['workload']} {spec['name']}")
    return {**json.loads(lines[-1]), "log": [ln for ln in lines if ln.startswith(("auto:", "  "))]}


def steady_s(run: dict) -> float:
    """Median seconds per iteration after the warm-up."""
    return statistics.median(run["times"][WARMUP:])


def spread(values: list[float], digits: int = 3) -> tuple[float, list[float]]:
    """(median, [min, max]), rounded."""
    return round(statistics.median(values), digits), [round(min(values), digits), round(max(values), digits)]


def verdict(values: list[float], worst, bar: float) -> str:
    """``met`` / ``missed`` in every round, or ``straddles``; ``worst`` is ``max`` for an upper
    bar, ``min`` for a lower one."""
    ok = [(v <= bar) if worst is max else (v >= bar) for v in values]
    return "met" if all(ok) else "missed" if not any(ok) else "straddles"


def per_round(plans: dict, runs: dict[str, list[dict]], iterations: int) -> dict:
    """Every figure of one workload, per round, and the plans they compare against."""
    fixed = [n for n in plans if n != "auto"]
    rate = {n: statistics.median(x["samples_per_s"] for x in runs[n]) for n in runs}
    wall = {n: statistics.median(x["wall_s"] for x in runs[n]) for n in runs}
    outside = {n: statistics.median(x["wall_s"] - x["iterations_s"] for x in runs[n]) for n in runs}
    best, best_wall = max(fixed, key=rate.get), min(fixed, key=wall.get)
    figures: dict[str, list[float]] = {}
    errors: dict[str, list[float]] = {n: [] for n in fixed}
    predictions: dict[str, list] = {n: [] for n in fixed}
    refs = []
    for r, auto in enumerate(runs["auto"]):
        row = {
            "auto_over_best_fixed": auto["samples_per_s"] / runs[best][r]["samples_per_s"],
            "auto_wall_over_best_fixed": runs[best_wall][r]["wall_s"] / auto["wall_s"],
        }
        for n, p in auto["fixed_predicted_s"].items():
            predictions[n].append(p)
            if not isinstance(p, str):
                errors[n].append(abs(steady_s(runs[n][r]) - p) / steady_s(runs[n][r]))
        row["prediction_error_unprofiled"] = statistics.median(e[r] for e in errors.values() if e)
        never = [e[r] for n, e in errors.items() if e and n not in PROFILED]
        if never:
            row["prediction_error_never_run"] = statistics.median(never)
        after = [(t, p) for t, p in zip(auto["times"], auto["predicted"]) if p is not None]
        row["prediction_error_in_sample"] = statistics.median(abs(t - p) / t for t, p in after)
        ref = next((n for n in fixed if plans[n][3] == auto["placement"]), None)
        refs.append(ref)
        if ref is not None:
            steady_gap = (iterations - WARMUP) * (steady_s(auto) - steady_s(runs[ref][r]))
            once = auto["wall_s"] - runs[ref][r]["wall_s"] - steady_gap
            row["profiling_fraction"] = once / auto["wall_s"]
        k = next(i for i, p in enumerate(auto["predicted"]) if p is not None)  # profiling iterations
        row["profiling_iterations_share"] = (sum(auto["times"][:k]) + auto["replan_s"]) / (
            sum(auto["times"]) + auto["replan_s"]
        )
        for key, v in row.items():
            figures.setdefault(key, []).append(v)
    return {
        "rate": rate, "wall": wall, "outside": outside, "best": best, "best_wall": best_wall,
        "figures": figures, "errors": errors, "predictions": predictions, "refs": refs,
    }  # fmt: skip


def summarise(plans: dict, runs: dict[str, list[dict]], iterations: int) -> dict:
    """One workload's JSON: medians over rounds with their spread, per-plan predictions, bars."""
    p = per_round(plans, runs, iterations)
    out: dict = {
        "samples_per_s": {n: round(v, 1) for n, v in p["rate"].items()},
        "wall_s": {n: round(v, 2) for n, v in p["wall"].items()},
        "outside_iterations_s": {n: round(v, 2) for n, v in p["outside"].items()},
        "best_fixed": p["best"],
        "best_fixed_wall": p["best_wall"],
        "auto_plans": [x["placement"] for x in runs["auto"]],
        "auto_reference_plans": p["refs"],
    }
    for key, values in p["figures"].items():
        out[key], out[f"{key}_spread"] = spread(values)
    out["predictions"] = {}
    for n, preds in p["predictions"].items():
        measured = [steady_s(x) for x in runs[n]]
        if p["errors"][n]:
            predicted = [v for v in preds if not isinstance(v, str)]
            out["predictions"][n] = {
                "predicted_s": spread(predicted, 4)[0], "measured_s": spread(measured, 4)[0],
                "error": spread(p["errors"][n])[0], "error_spread": spread(p["errors"][n])[1],
                "profiled": n in PROFILED,
            }  # fmt: skip
        else:
            out["predictions"][n] = {"measured_s": spread(measured, 4)[0], "not_predicted": preds[0]}
    out["bars"] = {key: verdict(p["figures"][key], worst, bar) for key, (worst, bar) in BARS.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workloads", default="math,embodied")
    args = parse_args(ap, run_one)
    if args is None:
        return
    if args.iterations <= WARMUP + PROFILING_ITERATIONS:
        raise SystemExit(f"--iterations must be > {WARMUP + PROFILING_ITERATIONS}, got {args.iterations}")
    work = Path(tempfile.mkdtemp(prefix="rlinf-auto-"))
    assets = recipe_assets(work)
    print(f"cores: {os.cpu_count()}; 2 slots; {args.iterations} iterations per run; {args.rounds} rounds")
    result: dict = {}
    for workload in args.workloads.split(","):
        plans = {"auto": AUTO, **PLANS[workload]}
        runs: dict[str, list[dict]] = {n: [] for n in plans}
        for r in range(args.rounds):
            specs = {
                name: {"workload": workload, "name": name, "strategy": strategy, "launcher": launcher,
                       "devices": devices, "iterations": args.iterations, **assets,
                       "run_dir": str(work / f"{workload}-{name}-{r}")}
                for name, (strategy, launcher, devices, _) in plans.items()
            }  # fmt: skip
            specs["auto"]["predict"] = {n: s for n, s in specs.items() if n != "auto"}
            for name, spec in specs.items():  # auto first: it predicts the others before they run
                res = child(spec)
                runs[name].append(res)
                if r == 0 and name == "auto":
                    print("\n".join(res["log"]))
                print(
                    f"round {r}: {workload} {name:<42} {res['samples_per_s']:8.1f} samples/s"
                    f" {res['wall_s']:7.2f} s wall",
                    flush=True,
                )
        result[workload] = summarise(plans, runs, args.iterations)
        for n, v in result[workload]["predictions"].items():
            what = (
                f"not predicted: {v['not_predicted']}"
                if "not_predicted" in v
                else f"predicted {v['predicted_s']:.4f} s, error {v['error']:.3f}"
            )
            print(f"{workload} {n:<42} measured {v['measured_s']:.4f} s per iteration; {what}")
    per = list(result.values())
    for key, worst in (
        ("auto_over_best_fixed", min),
        ("auto_wall_over_best_fixed", min),
        ("prediction_error_unprofiled", max),
        ("profiling_fraction", max),
    ):
        values = [v[key] for v in per if key in v]
        if values:
            result[key] = worst(values)
    order = ("met", "straddles", "missed")
    result["bars"] = {k: max((v["bars"][k] for v in per), key=order.index) for k in BARS}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
