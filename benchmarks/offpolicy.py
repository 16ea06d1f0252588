"""Off-policy embodied RL (issue 60): SAC on FetchReachDense-v4 against today's PPO recipe, the
per-step costs of ManiSkill PickCube-v1 and the bound they put on a 300k-step run, and the
throughput of the collocated and actor-learner plans.

    python benchmarks/offpolicy.py [--parts sac ppo plans pickcube] [--seeds 0 1]

- ``sac``: ``rlinf fit`` on ``configs/embodied_sac_fetchreach.yaml`` per seed (the seeds side by
  side, one process each, one thread each): the held-out success curve (32 deterministic episodes
  every 2,000 env steps), the env steps at which it first reaches 0.95, the final success within
  20,000 env steps, wall time. The bar: >= 0.95 within 20,000 env steps on every seed.
- ``ppo``: the same for ``configs/embodied_ppo_fetchreach.yaml`` (seed 0, evaluated every 5
  iterations of 1,024 env steps): the env steps today's PPO recipe needs for 0.95.
- ``plans``: a short SAC run on FetchReach under the collocated plan (one worker: env steps,
  then updates) and the actor-learner plan (env and rollout on one slot, the learner on the
  other, ``trainer.max_staleness=1``): env steps/s, updates/s and wall time of each.
- ``pickcube``: ManiSkill PickCube-v1 (state, ``pd_ee_delta_pos``, CPU simulation): seconds per
  simulated step (random actions), per policy call of one env, and per SAC update (batch 256,
  256x256 MLPs, the RLinf config's), and the one-core wall time of 300,000 env steps at one
  update per step that they add up to.

The last line is one JSON object with every part's figures.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAC_CONFIG = ROOT / "configs" / "embodied_sac_fetchreach.yaml"
PPO_CONFIG = ROOT / "configs" / "embodied_ppo_fetchreach.yaml"
SAC_STEPS_PER_ITERATION = 8 * 50  # the SAC config's num_envs x steps
PPO_STEPS_PER_ITERATION = 16 * 64
BAR = 0.95
#: the actor-learner plan: the env workers on one slot, the learner on the other
HYBRID = (
    "{class_path: rlinf_lightning.strategies.HybridStrategy, "
    'init_args: {placement: "env,rollout: 0, actor: 1"}}'
)


def _fit(config: Path, root: Path, *overrides: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "rlinf_lightning.cli", "fit", f"--config={config}",
            f"--trainer.default_root_dir={root}", "--trainer.logger=csv",
            "--trainer.enable_progress_bar=false", *overrides]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def _wait(proc: subprocess.Popen, what: str) -> None:
    _, err = proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"{what} failed:\n{err[-4000:]}")


def _curve(root: Path, per_iteration: int) -> dict:
    summary = json.loads((root / "summary.json").read_text())
    curve = [(h["iteration"] * per_iteration, round(h["success"], 3)) for h in summary["eval_history"]]
    reached = next((steps for steps, success in curve if success >= BAR), None)
    return {"curve": curve, "steps_to_0.95": reached, "final_success": curve[-1][1],
            "wall_s": round(summary["wall_s"], 1)}  # fmt: skip


def sac(seeds: list[int], work: Path) -> dict:
    procs = {s: _fit(SAC_CONFIG, work / f"sac{s}", f"--trainer.seed={s}") for s in seeds}
    for s, p in procs.items():
        _wait(p, f"SAC seed {s}")
    return {str(s): _curve(work / f"sac{s}", SAC_STEPS_PER_ITERATION) for s in seeds}


def ppo(work: Path) -> dict:
    proc = _fit(PPO_CONFIG, work / "ppo0", "--trainer.eval_every=5", "--trainer.num_threads=1")
    _wait(proc, "PPO seed 0")
    return _curve(work / "ppo0", PPO_STEPS_PER_ITERATION)


def plans(work: Path, iterations: int = 6) -> dict:
    out = {}
    common = (f"--trainer.max_iterations={iterations}", "--trainer.eval_every=0",
              "--trainer.algorithm.init_args.learning_starts=0")  # fmt: skip
    runs = {
        "collocated": (),
        "actor_learner": (f"--trainer.strategy={HYBRID}", "--trainer.devices=2", "--trainer.max_staleness=1"),
    }  # fmt: skip
    for name, extra in runs.items():
        _wait(_fit(SAC_CONFIG, work / name, *common, *extra), name)
        summary = json.loads((work / name / "summary.json").read_text())
        rows = list(csv.DictReader((work / name / "logs" / "version_0" / "metrics.csv").open()))
        updates = sum(float(r["actor/updates"]) for r in rows if r.get("actor/updates"))
        wall = summary["train_wall_s"]
        out[name] = {"env_steps_per_s": round(iterations * SAC_STEPS_PER_ITERATION / wall, 1),
                     "updates_per_s": round(updates / wall, 1), "wall_s": round(wall, 1)}  # fmt: skip
    return out


def pickcube(steps: int = 300, updates: int = 50) -> dict:
    import torch
    from tensordict import TensorDict

    from rlinf_lightning.algorithms import SAC
    from rlinf_lightning.envs import make_env
    from rlinf_lightning.policies import SACPolicy
    from rlinf_lightning.workflows.offpolicy.learner import SACLoss

    torch.set_num_threads(1)
    env = make_env("PickCube-v1", 1, obs_mode="state", control_mode="pd_ee_delta_pos")
    obs = env.reset(0)
    g = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    for _ in range(steps):
        obs = env.step(torch.rand(1, *env.action_shape, generator=g) * 2 - 1).obs
    sim_s = (time.perf_counter() - t0) / steps
    policy = SACPolicy(hidden_sizes=(256, 256))
    policy.configure_spaces(obs, (1, *env.action_shape))
    policy.configure_model()
    env.close()
    t0 = time.perf_counter()
    with torch.no_grad():
        for _ in range(steps):
            policy.act(obs)
    act_s = (time.perf_counter() - t0) / steps
    optimizer, loss = policy.configure_optimizers(), SACLoss(SAC(), -float(policy.action_dim))
    n = 256
    batch = TensorDict(
        {
            "obs": obs.expand(n).clone(),
            "next_obs": obs.expand(n).clone(),
            "action": torch.zeros(n, policy.action_dim),
            "reward": torch.zeros(n),
            "terminated": torch.zeros(n, dtype=torch.bool),
            "noise": torch.randn(n, 2, policy.action_dim),
            "critic_subset": torch.arange(2).expand(n, 2),
            "update_actor": torch.ones(n, dtype=torch.bool),
        },
        batch_size=[n],
    )
    t0 = time.perf_counter()
    for _ in range(updates):
        total, _, _ = loss(policy, batch)
        total.backward()
        optimizer.step()
        optimizer.zero_grad()
        policy.update_targets(0.005)
    update_s = (time.perf_counter() - t0) / updates
    bound = 300_000 * (sim_s + act_s + update_s)
    return {"sim_step_s": round(sim_s, 5), "policy_call_s": round(act_s, 5), "update_s": round(update_s, 5),
            "one_core_300k_steps_utd1_h": round(bound / 3600, 2)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", default=["sac", "ppo", "plans", "pickcube"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    args = ap.parse_args()
    result: dict = {"load_at_start": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for part in args.parts:
            t0 = time.perf_counter()
            if part == "sac":
                result["sac_fetchreach"] = sac(args.seeds, work)
            elif part == "ppo":
                result["ppo_fetchreach"] = ppo(work)
            elif part == "plans":
                result["plans"] = plans(work)
            elif part == "pickcube":
                result["pickcube_costs"] = pickcube()
            print(part, round(time.perf_counter() - t0, 1), "s:", result, flush=True)
    if "sac_fetchreach" in result:
        runs = result["sac_fetchreach"].values()
        result["sac_passed"] = all(
            r["steps_to_0.95"] is not None and r["steps_to_0.95"] <= 20_000 for r in runs
        )
    result["load_at_end"] = os.getloadavg()[0]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
