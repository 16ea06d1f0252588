"""Env/policy pipelining: env steps/s of the rollout, sequential against pipelined, on the same 2 slots.

    python benchmarks/embodied_pipeline.py [--iterations 6] [--rounds 2] [--workloads vla,mlp]

Workloads:

- ``vla``: a small VLA (``TinyVLA``, OFT decoding, 21 M parameters) on ManiSkill3 PickCube-v1
  with 64x64 RGB observations (the ``rlinf-maniskill`` plugin);
- ``mlp``: the MLP actor-critic on gymnasium-robotics FetchReachDense-v4 (state observations).

Candidates, on at most two slots (on CPU a slot is a core, one torch thread each):

- ``sequential``: one worker, the envs as one shard, in the driver's process (no inter-process
  messages): the env steps, then the policy infers, then the env steps again; nothing overlaps.
  Two variants, and the better one counts: ``t2`` on both slots (2 torch threads) and ``t1`` on one
  slot (1 thread: tiny networks run faster on one);
- ``pipelined[S]``: the env on slot 0, the policy (and the update) on slot 1, the envs cut into
  ``S`` shards: while one shard simulates, the policy infers for another (RLinf's pipeline stages).

Each candidate runs in a fresh process; rounds alternate the candidates. The rollout window of an
iteration is measured from its trace (the policy's first inference to the env's end of the
iteration), so the PPO update, the same work under every plan, does not dilute the comparison;
whole-iteration rates are printed too.
Last line: JSON with each workload's env steps/s per candidate and ``pipelined_over_sequential``
(best S).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from children import parse_args, run_child

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


def candidates() -> dict[str, dict]:
    one_worker = {"class_path": "rlinf_lightning.strategies.CollocatedStrategy", "init_args": {"replicas": 1}}
    out = {  # torch threads are per slot: one worker on 2 slots has 2 threads, on 1 slot 1
        f"sequential[t{t}]": {"strategy": one_worker, "launcher": "inprocess", "devices": t} for t in (1, 2)
    }
    for s in STAGES:
        out[f"pipelined[{s}]"] = {
            "strategy": {
                "class_path": HYBRID,
                "init_args": {"placement": "env: 0, rollout,advantage,actor: 1", "micro_batches": s},
            },
            "launcher": "processes",
            "devices": 2,
        }
    return out


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

        def on_iteration_end(self, trainer, iteration, metrics):
            self.times.append(metrics["time/iteration"])

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
    )
    task = EmbodiedTask(**work["task"], eval_episodes=1)
    t0 = time.perf_counter()
    trainer.fit(instantiate(work["policy"]), task)
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    steps = task.num_envs * task.steps * task.chunk
    windows = _rollout_windows(events, spec["iterations"])
    warm = slice(1, None)  # the first iteration starts the simulators
    return {
        "env_steps_per_s": steps / statistics.median(windows[warm]),
        "iteration_steps_per_s": steps / statistics.median(clock.times[warm]),
        "wall_s": time.perf_counter() - t0,
        "plan": trainer.plan.describe(),
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
    return json.loads(run_child(__file__, spec, f"{spec['workload']} {spec['name']}")[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workloads", default="vla,mlp")
    args = parse_args(ap, run_one)
    if args is None:
        return
    work = Path(tempfile.mkdtemp(prefix="rlinf-pipeline-"))
    result: dict = {}
    for workload in args.workloads.split(","):
        runs: dict[str, list[float]] = {n: [] for n in candidates()}
        whole: dict[str, list[float]] = {n: [] for n in candidates()}
        for r in range(args.rounds):
            for name, candidate in candidates().items():
                run_dir = str(work / f"{workload}-{name}-{r}")
                spec = {"workload": workload, "name": name, **candidate, "run_dir": run_dir,
                        "iterations": args.iterations}  # fmt: skip
                res = child(spec)
                runs[name].append(res["env_steps_per_s"])
                whole[name].append(res["iteration_steps_per_s"])
                if r == 0:
                    print(f"\n[{workload} {name}]\n{res['plan']}")
                print(
                    f"round {r}: {workload} {name:<15} rollout {res['env_steps_per_s']:8.1f} env steps/s"
                    f"  (whole iteration {res['iteration_steps_per_s']:8.1f})",
                    flush=True,
                )
        rates = {k: statistics.median(v) for k, v in runs.items()}
        sequential = max((k for k in rates if k.startswith("sequential")), key=lambda k: rates[k])
        best = max((k for k in rates if k.startswith("pipelined")), key=lambda k: rates[k])
        result[workload] = {
            **{k: round(v, 1) for k, v in rates.items()},
            "whole_iteration": {k: round(statistics.median(v), 1) for k, v in whole.items()},
            "sequential": round(rates[sequential], 1),
            "best_sequential": sequential,
            "best_pipelined": best,
            "pipelined_over_sequential": round(rates[best] / rates[sequential], 3),
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
