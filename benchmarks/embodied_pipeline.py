"""Whole iterations (rollout and update) of embodied PPO: env steps/s of the sequential, pipelined,
overlapping and asynchronous plans on the same 2 slots.

    python benchmarks/embodied_pipeline.py [--iterations 6] [--rounds 2] [--workloads vla,mlp]

Workloads:

- ``vla``: a small VLA (``TinyVLA``, OFT decoding, 21 M parameters) on ManiSkill3 PickCube-v1
  with 64x64 RGB observations (the ``rlinf-maniskill`` plugin);
- ``mlp``: the MLP actor-critic on gymnasium-robotics FetchReachDense-v4 (state observations).

Candidates, on at most two slots (on CPU a slot is a core, one torch thread each):

- ``sequential``: one worker, the envs as one shard, in the driver's process (no inter-process
  messages): the env steps, then the policy infers, then the env steps again, then the update;
  nothing overlaps. Two variants, and the better one counts: ``t2`` on both slots (2 torch threads)
  and ``t1`` on one slot (1 thread: tiny networks run faster on one);
- ``pipelined[S]``: the env on slot 0, the policy (and the update) on slot 1, the envs cut into
  ``S`` shards: while one shard simulates, the policy infers for another (RLinf's pipeline stages);
  the update runs on slot 1 alone while slot 0 idles;
- ``overlapping[S]``: RLinf's default ManiSkill placement on two slots, ``actor,advantage: 0-1,
  env: 0, rollout: 1``: env and policy pipeline as above, then the actor trains data-parallel on
  both slots (two ddp ranks), each replica taking its turn on its slot after the env's or the
  rollout's (``flow.sharing``);
- ``collocated``: every stage on both slots, two data-parallel replicas (4 envs each), the update
  synchronous with ddp;
- ``asynchronous``: the update of iteration ``i`` overlapping the rollout of ``i + 1`` with weights
  at most one version old (the trainer option ``max_staleness``); skipped, with the reason printed,
  where the trainer has no such option;
- ``auto[k=1]``: ``trainer.strategy: auto`` with the same ``max_staleness`` 1, choosing among every
  placement itself (it profiles its first iterations in the driver's process, so its whole-iteration
  figure counts them). Reported: the placement it ended on (``auto_placement``), the fixed candidate
  with that placement (``auto_picked``) and whether that is the fastest fixed candidate
  (``auto_picked_fastest``).

Each candidate runs in a fresh process; rounds alternate the candidates. The figure that counts is
the whole iteration (``time/iteration``: rollout and update, the first iteration left out: it starts
the simulators). The rollout window (from the trace: the policy's first inference to the env's end
of the iteration) is printed beside it.

The bound: each stage's cheapest core-seconds per iteration measured in any candidate (busy
seconds per replica x replicas x torch threads per replica; env, policy inference, and the update:
advantage and actor), packed perfectly onto the 2 cores, against the best sequential iteration:
``whole_iteration_bound = sequential s / (core-s / 2)``; no plan on 2 cores can beat it unless a
stage runs cheaper than any candidate measured it. (The one-thread sequential run alone is no
bound: its update measured 9.4 core-s against 6.3 on the asynchronous plan's own core.) Last line:
JSON with, per workload, env steps/s per candidate (whole iteration and rollout), the stage costs,
``whole_iteration_best_over_sequential`` and ``whole_iteration_bound``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
from pathlib import Path

from children import parse_args, placement_of, run_child

HYBRID = "rlinf_lightning.strategies.HybridStrategy"
# The VLA is sized so that its inference costs about what ManiSkill's CPU simulation and rendering
# of the same envs do (~250 ms for 8 envs here; 5 layers of width 512, 21 M parameters), the regime
# of RLinf's measurement (OpenVLA-OFT on GPUs). With the 0.2 M-parameter default the policy is ~3%
# of a step, and no plan can overlap what is not there.
WORKLOADS = {
    "vla": {
        "policy": {"class_path": "rlinf_lightning.policies.TinyVLA",
                   "init_args": {"decode": "oft", "hidden_size": 512, "num_layers": 5, "num_heads": 8}},
        "task": {"env": "PickCube-v1", "env_kwargs": {"obs_mode": "rgb", "image_size": 64}, "num_envs": 8,
                 "steps": 16, "chunk": 1},
    },
    "mlp": {
        "policy": {"class_path": "rlinf_lightning.policies.MLPActorCritic", "init_args": {}},
        "task": {"env": "FetchReachDense-v4", "num_envs": 16, "steps": 32, "chunk": 1},
    },
}  # fmt: skip
STAGES = (2, 4)
#: the plan of the ``asynchronous`` candidate, and the trainer options that make it asynchronous
ASYNC = {"placement": "env,rollout: 0, advantage,actor: 1", "trainer": {"max_staleness": 1}}


def candidates() -> dict[str, dict]:
    one_worker = {"class_path": "rlinf_lightning.strategies.CollocatedStrategy", "init_args": {"replicas": 1}}
    out = {  # torch threads are per slot: one worker on 2 slots has 2 threads, on 1 slot 1
        f"sequential[t{t}]": {"strategy": one_worker, "launcher": "inprocess", "devices": t} for t in (1, 2)
    }
    placements = {"pipelined": "env: 0, rollout,advantage,actor: 1",
                  "overlapping": "actor,advantage: 0-1, env: 0, rollout: 1"}  # fmt: skip
    for kind, placement in placements.items():
        for s in STAGES:
            out[f"{kind}[{s}]"] = {
                "strategy": {"class_path": HYBRID, "init_args": {"placement": placement, "micro_batches": s}},
                "launcher": "processes",
                "devices": 2,
            }
    out["collocated"] = {"strategy": "collocated", "launcher": "processes", "devices": 2}
    out["asynchronous"] = {
        "strategy": {
            "class_path": HYBRID,
            "init_args": {"placement": ASYNC["placement"], "micro_batches": 2},
        },
        "launcher": "processes",
        "devices": 2,
        "trainer": ASYNC["trainer"],
    }
    out["auto[k=1]"] = {
        "strategy": "auto",
        "launcher": "processes",
        "devices": 2,
        "trainer": ASYNC["trainer"],
    }
    return out


def unsupported(candidate: dict) -> str | None:
    """Why this trainer cannot run ``candidate`` (a trainer option it does not have), or ``None``."""
    import inspect

    from rlinf_lightning import RLTrainer

    accepted = inspect.signature(RLTrainer.__init__).parameters
    missing = sorted(set(candidate.get("trainer", {})) - set(accepted))
    return f"RLTrainer has no option {', '.join(missing)} yet" if missing else None


def run_one(spec: dict) -> dict:
    """Child process: one fit; per-iteration rollout windows from the trace."""
    import time

    from rlinf_lightning import Callback, RLTrainer
    from rlinf_lightning.algorithms import PPO
    from rlinf_lightning.registry import instantiate
    from rlinf_lightning.tasks import EmbodiedTask

    class Clock(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.busy: list[dict[str, float]] = []  # per iteration: busy seconds per stage and replica

        def on_iteration_end(self, trainer, iteration, metrics):
            self.times.append(metrics["time/iteration"])
            self.busy.append(
                {k[5:]: v for k, v in metrics.items() if k.startswith("time/") and k != "time/iteration"}
            )

    work = WORKLOADS[spec["workload"]]
    trace = Path(spec["run_dir"]) / "trace.json"
    clock = Clock()
    trainer = RLTrainer(
        algorithm=PPO(update_epochs=1, num_minibatches=1),
        strategy=spec["strategy"],
        launcher=spec["launcher"],
        devices=spec["devices"],
        num_threads=1,
        max_iterations=spec["iterations"],
        default_root_dir=spec["run_dir"],
        logger=False,
        enable_progress_bar=False,
        callbacks=[clock],
        timeout_s=600,
        trace=str(trace),
        **spec.get("trainer", {}),
    )
    task = EmbodiedTask(**work["task"], eval_episodes=1)
    t0 = time.perf_counter()
    trainer.fit(instantiate(work["policy"]), task)
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    steps = task.num_envs * task.steps * task.chunk
    windows = _rollout_windows(events, spec["iterations"])
    warm = slice(1, None)  # the first iteration starts the simulators
    stages = {k for b in clock.busy for k in b}
    plan = trainer.plan
    cores = {st: plan.group_of(st).replicas * max(1, plan.group_of(st).num_threads) for st in stages}
    return {
        "env_steps_per_s": steps / statistics.median(windows[warm]),
        "iteration_steps_per_s": steps / statistics.median(clock.times[warm]),
        "stage_s": {k: statistics.median(b.get(k, 0.0) for b in clock.busy[warm]) for k in sorted(stages)},
        "cores": cores,  # per stage: replicas x torch threads each (its busy seconds' core count)
        "wall_s": time.perf_counter() - t0,
        "plan": trainer.plan.describe(trainer.workflow),
        "placement": placement_of(trainer.plan),
    }


def _rollout_windows(events: list[dict], iterations: int) -> list[float]:
    """Per iteration, seconds from the policy's first inference (after the new weights arrived) to
    the env stage's end of the iteration (the env emits the trajectories last). Not from the env's
    first span: plans that queue the next iteration start the env's shards (which only hand back
    their current observations) while the actor still trains."""
    marks = [e for e in events if e["name"] in ("rollout", "env.end_iteration")]
    marks.sort(key=lambda e: e["ts"])
    windows, start = [], None
    for e in marks:
        if e["name"] == "rollout" and start is None:
            start = e["ts"]
        elif e["name"] == "env.end_iteration" and start is not None:
            windows.append((e["ts"] - start) / 1e6)
            start = None
    return windows[:iterations]


def child(spec: dict) -> dict:
    """One candidate's result; auto's log lines (its ranking and choices) under ``"log"``."""
    lines = run_child(__file__, spec, f"{spec['workload']} {spec['name']}")
    ranked = re.compile(r"auto:|\s+\d+\.\s")  # auto's lines and its ranked plans
    return {**json.loads(lines[-1]), "log": [ln for ln in lines[:-1] if ranked.match(ln)]}


def bound(core_s: list[dict[str, float]], sequential_s: float, slots: int = 2) -> dict[str, float]:
    """Core-seconds per iteration of the env, the policy's inference and the update (advantage and
    actor), each the cheapest of the candidates' (``core_s``: per candidate, per stage), and the
    speed-up over ``sequential_s`` if all of it were packed perfectly onto ``slots`` cores."""
    parts = {"env": ("env",), "policy": ("rollout",), "update": ("advantage", "actor")}
    cost = {
        part: min(sum(c.get(st, 0.0) for st in stages) for c in core_s if stages[-1] in c)
        for part, stages in parts.items()
    }
    return {**{k: round(v, 2) for k, v in cost.items()},
            "whole_iteration_bound": round(sequential_s / (sum(cost.values()) / slots), 3)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workloads", default="vla,mlp")
    ap.add_argument("--only", default="", help="comma-separated candidate name prefixes (default: all)")
    args = parse_args(ap, run_one)
    if args is None:
        return
    work = Path(tempfile.mkdtemp(prefix="rlinf-pipeline-"))
    chosen = {
        n: c for n, c in candidates().items() if not args.only or n.startswith(tuple(args.only.split(",")))
    }
    for name, candidate in list(chosen.items()):
        if why := unsupported(candidate):
            print(f"skipping {name}: {why}")
            del chosen[name]
    result: dict = {}
    for workload in args.workloads.split(","):
        runs: dict[str, list[float]] = {n: [] for n in chosen}
        whole: dict[str, list[float]] = {n: [] for n in chosen}
        busy: dict[str, list[dict[str, float]]] = {n: [] for n in chosen}  # core-s per stage
        placement: dict[str, str] = {}  # the plan each candidate ended on
        for r in range(args.rounds):
            for name, candidate in chosen.items():
                run_dir = str(work / f"{workload}-{name}-{r}")
                spec = {"workload": workload, "name": name, **candidate, "run_dir": run_dir,
                        "iterations": args.iterations}  # fmt: skip
                res = child(spec)
                runs[name].append(res["env_steps_per_s"])
                whole[name].append(res["iteration_steps_per_s"])
                busy[name].append({k: v * res["cores"][k] for k, v in res["stage_s"].items()})
                placement[name] = res["placement"]
                if r == 0:
                    print(f"\n[{workload} {name}]\n{res['plan']}")
                if name == "auto[k=1]":
                    print("\n".join(res["log"]))
                stage_s = ", ".join(f"{k} {v:.2f}" for k, v in res["stage_s"].items())
                print(
                    f"round {r}: {workload} {name:<15} whole iteration {res['iteration_steps_per_s']:7.1f} "
                    f"env steps/s  (rollout {res['env_steps_per_s']:7.1f}; busy s per replica: {stage_s})",
                    flush=True,
                )
        rollout = {k: statistics.median(v) for k, v in runs.items()}
        rates = {k: statistics.median(v) for k, v in whole.items()}
        entry: dict = {"whole_iteration": {k: round(v, 2) for k, v in rates.items()},
                       "rollout": {k: round(v, 1) for k, v in rollout.items()}}  # fmt: skip
        if "auto[k=1]" in rates:  # what auto chose, against the fixed candidates (same staleness)
            auto = placement.pop("auto[k=1]")
            fixed = {k: v for k, v in rates.items() if k != "auto[k=1]"}
            same = [k for k in fixed if placement[k] == auto and chosen[k].get("trainer") == ASYNC["trainer"]]
            entry["auto_placement"] = auto
            entry["auto_picked"] = same[0] if same else None
            entry["auto_picked_fastest"] = bool(fixed) and entry["auto_picked"] == max(fixed, key=fixed.get)
        sequential = [k for k in rates if k.startswith("sequential")]
        others = [k for k in rates if not k.startswith(("sequential", "auto"))]
        if sequential:
            seq = max(sequential, key=lambda k: rates[k])
            entry["best_sequential"] = seq
            pipelined = [k for k in rollout if k.startswith("pipelined")]
            if pipelined:  # the rollout alone, as before: env/policy overlap
                best = max(pipelined, key=lambda k: rollout[k])
                entry["pipelined_over_sequential"] = round(rollout[best] / rollout[seq], 3)
            if others:
                best = max(others, key=lambda k: rates[k])
                entry["best"] = best
                entry["whole_iteration_best_over_sequential"] = round(rates[best] / rates[seq], 3)
            per_candidate = [  # auto's iterations ran under several plans: no one stage cost
                {k: statistics.median(b[k] for b in bs) for k in bs[0]}
                for n, bs in busy.items()
                if n != "auto[k=1]"
            ]
            entry["core_s_per_iteration"] = bound(per_candidate, _steps(workload) / rates[seq])
            entry["whole_iteration_bound"] = entry["core_s_per_iteration"].pop("whole_iteration_bound")
        result[workload] = entry
    print(json.dumps(result))


def _steps(workload: str) -> int:
    task = WORKLOADS[workload]["task"]
    return task["num_envs"] * task["steps"] * task["chunk"]


if __name__ == "__main__":
    main()
