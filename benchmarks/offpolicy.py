"""Off-policy embodied RL (issue 60): SAC and CrossQ on FetchReachDense-v4 against today's PPO recipe, the
per-step costs of ManiSkill PickCube-v1 and the bound they put on a 300k-step run, and the
throughput of the collocated and actor-learner plans.

    python benchmarks/offpolicy.py [--parts sac crossq ppo plans] [--seeds 0 1] [--quick]
    python benchmarks/offpolicy.py --parts pickcube_sac [pickcube_rlpd] [--seeds 0]
    python benchmarks/offpolicy.py --parts pickcube_rlpd --sac-result sac.log   # judged against it
    OMP_NUM_THREADS=1 python benchmarks/offpolicy.py --bound pickcube [--seconds 30] [--utd 1]

- ``sac``: ``rlinf fit`` on ``configs/embodied_sac_fetchreach.yaml`` per seed (the seeds side by
  side, one process each, one thread each): the held-out success curve (32 deterministic episodes
  every 2,000 env steps), the env steps at which it first reaches 0.95, the final success within
  20,000 env steps, wall time. The bar: >= 0.95 within 20,000 env steps on every seed.
- ``crossq``: the same for ``configs/embodied_crossq_fetchreach.yaml`` (the same envs, steps
  and budget), against the same bar.
- ``ppo``: the same for ``configs/embodied_ppo_fetchreach.yaml`` (seed 0, evaluated every 5
  iterations of 1,024 env steps): the env steps today's PPO recipe needs for 0.95.
- ``plans``: the same short SAC run on FetchReach (6 iterations of 8 envs x 50 steps, one update
  per env step from the first) under the collocated plan (one worker: env steps, then updates)
  and two actor-learner plans (``disaggregated``; ``hybrid`` with env and rollout on one slot, the
  learner on the other), each ``trainer.max_staleness=1``: env steps/s, updates/s and wall time
  of each, side by side. ``--quick``: this part only, 2 iterations of 10 steps (a smoke check).
- ``pickcube_sac`` (asked for by name; plugin rlinf-maniskill): ``rlinf fit`` on
  ``configs/embodied_sac_maniskill_pickcube.yaml`` per seed, side by side, one thread each: the
  held-out success curve (32 episodes every 20,000 env steps) and the env steps at which it first
  reaches 0.8. The bar: >= 0.8 within 300,000 env steps on every seed. About an hour a seed.
- ``pickcube_rlpd`` (by name): ``rlinf demos`` writes 50 scripted-expert episodes, then ``rlinf
  fit`` on ``configs/embodied_rlpd_maniskill_pickcube.yaml`` (150,000 env steps) per seed. The bar:
  the success SAC ends with (run ``pickcube_sac`` in the same call, or give an earlier call's
  output as ``--sac-result FILE``), reached within 150,000 env steps; beside it RLPD's env steps
  to 0.8 and to that success over SAC's. About 35 minutes for two seeds side by side.
- ``--bound pickcube`` (alone): ManiSkill PickCube-v1 (state, ``pd_ee_delta_pos``, CPU
  simulation) on one thread: seconds per simulated step (random actions), per env of a policy
  call of 16 envs, per SAC update and per RLPD update (batch 256, 256x256 MLPs; RLPD with the
  paper's ten LayerNorm critics, ``rlpd``, and with the shipped config's two, ``rlpd_2``), each
  measured for ``--seconds``; then the env steps reachable in 30, 60 and
  120 minutes on two cores at ``--utd`` updates per env step under each plan (collocated: steps
  and updates alternate; actor-learner: they overlap on a core each) and the minutes 300,000 env
  steps need. Run it on a quiet machine: on a loaded one its figures are the load's.

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
CROSSQ_CONFIG = ROOT / "configs" / "embodied_crossq_fetchreach.yaml"  # the same envs and steps
PPO_CONFIG = ROOT / "configs" / "embodied_ppo_fetchreach.yaml"
SAC_ENVS, SAC_STEPS = 8, 50  # the SAC config's envs and steps per env per iteration
PPO_STEPS_PER_ITERATION = 16 * 64
BAR = 0.95
PICKCUBE_SAC = ROOT / "configs" / "embodied_sac_maniskill_pickcube.yaml"
PICKCUBE_RLPD = ROOT / "configs" / "embodied_rlpd_maniskill_pickcube.yaml"
PICKCUBE_BAR = 0.8
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


def _first(curve: list, bar: float) -> int | None:
    """The env steps of the first evaluation of ``curve`` (``(steps, success)`` pairs) at ``bar``."""
    return next((steps for steps, success in curve if success >= bar), None)


def _curve(root: Path, per_iteration: int, bar: float = BAR) -> dict:
    summary = json.loads((root / "summary.json").read_text())
    curve = [(h["iteration"] * per_iteration, round(h["success"], 3)) for h in summary["eval_history"]]
    reached = _first(curve, bar)
    return {"curve": curve, f"steps_to_{bar:g}": reached, "final_success": curve[-1][1],
            "wall_s": round(summary["wall_s"], 1)}  # fmt: skip


def _per_iteration(config: Path) -> int:
    """Env steps per iteration of an embodied config: its envs times their steps."""
    import yaml

    task = yaml.safe_load(config.read_text())["task"]["init_args"]
    return task["num_envs"] * task["steps"]


def sac(seeds: list[int], work: Path, config: Path = SAC_CONFIG, bar: float = BAR, *overrides: str) -> dict:
    """The held-out success curve of ``config`` per seed, the seeds side by side (one process and
    one thread each), and the env steps at which it first reaches ``bar``."""
    procs = {s: _fit(config, work / f"{config.stem}{s}", f"--trainer.seed={s}", *overrides) for s in seeds}
    for s, p in procs.items():
        _wait(p, f"{config.stem} seed {s}")
    return {str(s): _curve(work / f"{config.stem}{s}", _per_iteration(config), bar) for s in seeds}


def pickcube_rlpd(seeds: list[int], work: Path, episodes: int = 50) -> dict:
    """RLPD on PickCube-v1 (``configs/embodied_rlpd_maniskill_pickcube.yaml``, half of SAC's env
    steps) from ``episodes`` demonstrations of the scripted expert (``rlinf demos``, written
    once), the seeds side by side: the curve of :func:`sac`."""
    demos = work / "pickcube_demos.safetensors"
    argv = [sys.executable, "-m", "rlinf_lightning.cli", "demos", "--env=PickCube-v1",
            f"--episodes={episodes}", "--chunk=1", f"--out={demos}",
            '--env_kwargs={"obs_mode": "state", "control_mode": "pd_ee_delta_pos"}']  # fmt: skip
    subprocess.run(argv, cwd=ROOT, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return sac(seeds, work, PICKCUBE_RLPD, PICKCUBE_BAR, f"--trainer.algorithm.init_args.demo_path={demos}")


def ppo(work: Path) -> dict:
    proc = _fit(PPO_CONFIG, work / "ppo0", "--trainer.eval_every=5", "--trainer.num_threads=1")
    _wait(proc, "PPO seed 0")
    return _curve(work / "ppo0", PPO_STEPS_PER_ITERATION)


#: the plans side by side: the collocated one (one worker: env steps, then updates) and two
#: actor-learner ones (env and rollout on one slot, the learner on the other, one version behind)
PLANS = {
    "collocated": (),
    "disaggregated": ("--trainer.strategy=disaggregated", "--trainer.devices=2", "--trainer.max_staleness=1"),
    "actor_learner": (f"--trainer.strategy={HYBRID}", "--trainer.devices=2", "--trainer.max_staleness=1"),
}  # fmt: skip


def plans(work: Path, iterations: int = 6, steps: int = SAC_STEPS) -> dict:
    """Env steps/s and updates/s of a short SAC run on FetchReach under each of :data:`PLANS`
    (``steps`` per env per iteration, the config's 8 envs, one update per env step from the first)."""
    out = {}
    common = (f"--trainer.max_iterations={iterations}", "--trainer.eval_every=0",
              "--trainer.ckpt_every=0", f"--task.init_args.steps={steps}",
              "--trainer.algorithm.init_args.learning_starts=0")  # fmt: skip
    for name, extra in PLANS.items():
        _wait(_fit(SAC_CONFIG, work / name, *common, *extra), name)
        summary = json.loads((work / name / "summary.json").read_text())
        rows = list(csv.DictReader((work / name / "logs" / "version_0" / "metrics.csv").open()))
        updates, sim_s, act_s, learner_s = (
            sum(float(r[k]) for r in rows if r.get(k))
            for k in ("actor/updates", "time/env", "time/rollout", "time/actor")
        )
        env_s = sim_s + act_s  # the env worker's side: simulation and policy calls
        wall, env_steps = summary["train_wall_s"], iterations * SAC_ENVS * steps
        # busy seconds of each side: their sum over the wall time is how much they overlapped
        out[name] = {"env_steps_per_s": round(env_steps / wall, 1), "updates_per_s": round(updates / wall, 1),
                     "updates": int(updates), "wall_s": round(wall, 1), "env_busy_s": round(env_s, 1),
                     "learner_busy_s": round(learner_s, 1),
                     "busy_over_wall": round((env_s + learner_s) / wall, 2)}  # fmt: skip
    return out


def _seconds_per_call(fn, seconds: float) -> float:
    """Seconds per call of ``fn``, called for about ``seconds`` (after one warm-up call)."""
    fn()
    calls, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        fn()
        calls += 1
    return elapsed / calls


#: the updates ``--bound`` times: (critics, LayerNorm, RLPD); RLPD draws a pair for the target
UPDATES = {"sac": (2, False, False), "rlpd": (10, True, True), "rlpd_2": (2, True, True)}


def _update_cost(algorithm: str, obs, action_dim: int, seconds: float) -> float:
    """Seconds per update of ``algorithm`` (a key of :data:`UPDATES`; batch 256, 256x256 MLPs)
    on a batch of PickCube observations."""
    import torch
    from tensordict import TensorDict

    from rlinf_lightning.algorithms import RLPD, SAC
    from rlinf_lightning.policies import SACPolicy
    from rlinf_lightning.workflows.offpolicy.learner import SACLoss

    num_critics, layer_norm, rlpd = UPDATES[algorithm]
    policy = SACPolicy(hidden_sizes=(256, 256), num_critics=num_critics, layer_norm=layer_norm)
    policy.configure_spaces(obs, (1, action_dim))
    policy.configure_model()
    config = RLPD(demo_ratio=0.0) if rlpd else SAC()
    optimizer, loss = policy.configure_optimizers(), SACLoss(config, -float(action_dim))
    n, g = config.batch_size, torch.Generator().manual_seed(0)
    batch = TensorDict(
        {
            "obs": obs.expand(n).clone(),
            "next_obs": obs.expand(n).clone(),
            "action": torch.rand(n, action_dim, generator=g) * 2 - 1,
            "reward": torch.zeros(n),
            "terminated": torch.zeros(n, dtype=torch.bool),
            "noise": torch.randn(n, 2, action_dim, generator=g),
            "critic_subset": torch.arange(config.critic_subset or 2).expand(n, -1),
            "update_actor": torch.ones(n, dtype=torch.bool),
        },
        batch_size=[n],
    )

    def update() -> None:
        total, _, _ = loss(policy, batch)
        total.backward()
        optimizer.step()
        optimizer.zero_grad()
        policy.update_targets(config.tau)

    return _seconds_per_call(update, seconds)


def bound_pickcube(seconds: float = 30.0, utd: float = 1.0, num_envs: int = 16) -> dict:
    """PickCube-v1's per-step costs on one thread (state, ``pd_ee_delta_pos``, CPU simulation,
    random actions; a policy call of the configs' ``num_envs`` envs, per env; each update of
    :data:`UPDATES`), each measured for about ``seconds``, and the env steps they allow on two cores
    at ``utd`` updates per env step: collocated, one worker alternates steps and updates
    (``env + utd x update`` per step, the other core free); actor-learner, the env worker and the
    learner overlap on a core each (``max(env, utd x update)`` per step)."""
    import torch

    from rlinf_lightning.envs import make_env
    from rlinf_lightning.policies import SACPolicy

    torch.set_num_threads(1)
    env = make_env("PickCube-v1", 1, obs_mode="state", control_mode="pd_ee_delta_pos")
    obs, g = env.reset(0), torch.Generator().manual_seed(0)
    shape = env.action_shape
    sim_s = _seconds_per_call(lambda: env.step(torch.rand(1, *shape, generator=g) * 2 - 1), seconds)
    env.close()
    policy = SACPolicy(hidden_sizes=(256, 256))
    policy.configure_spaces(obs, (1, *shape))
    policy.configure_model()
    many = obs.expand(num_envs).clone()
    with torch.no_grad():
        act_s = _seconds_per_call(lambda: policy.act(many), seconds) / num_envs
    env_s = sim_s + act_s
    out: dict = {"sim_step_s": round(sim_s, 6), "policy_call_per_env_s": round(act_s, 6), "utd": utd}
    for algorithm in UPDATES:
        update_s = _update_cost(algorithm, obs, policy.action_dim, seconds)
        per_step = {"collocated": env_s + utd * update_s, "actor_learner": max(env_s, utd * update_s)}
        out[algorithm] = {"update_s": round(update_s, 6)}
        for plan, s in per_step.items():
            reach = {f"env_steps_in_{m}_min": int(m * 60 / s) for m in (30, 60, 120)}
            out[algorithm][plan] = reach | {"minutes_for_300k": round(300_000 * s / 60, 1)}
    return out


def judge_rlpd(sac: dict, rlpd: dict) -> dict:
    """RLPD against SAC on PickCube, per seed, three readings of "the success SAC ends with (the
    lower seed's), reached in at most half of SAC's env steps": within half of SAC's 300,000-step
    budget (``passed``, the bar), and RLPD's env steps to 0.8 and to that success over SAC's."""
    target = min(r["final_success"] for r in sac.values())
    out: dict = {"sac_final_success": target}
    out["passed"] = all((f := _first(r["curve"], target)) is not None and f <= 150_000 for r in rlpd.values())
    for bar, key in ((0.8, "steps_to_0.8_over_sac"), (target, "steps_to_sac_final_over_sac")):
        ratios = {}
        for seed, run in rlpd.items():
            ours, theirs = _first(run["curve"], bar), _first(sac.get(seed, {"curve": []})["curve"], bar)
            ratios[seed] = round(ours / theirs, 3) if ours and theirs else None
        out[key] = ratios
    return out


def _earlier_sac(path: Path) -> dict:
    """The ``pickcube_sac`` curves of the JSON last line in ``path``; one line naming the file
    and the fix where it has none (checked before any run starts)."""
    try:
        return json.loads(path.read_text().strip().splitlines()[-1])["pickcube_sac"]
    except (OSError, IndexError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"--sac-result {path}: no pickcube_sac in its last line ({e!r}); "
                         "give the output of a call with --parts pickcube_sac") from None  # fmt: skip


PARTS = ["sac", "crossq", "ppo", "plans"]
#: the ManiSkill runs (plugin rlinf-maniskill), about an hour each on one core: asked for by name
PICKCUBE_PARTS = ["pickcube_sac", "pickcube_rlpd"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", choices=PARTS + PICKCUBE_PARTS, default=PARTS)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run (under 2 minutes): the plans part only, 2 iterations of 10 steps "
                    "per env; with --bound, 3 s per cost. Its figures are no measurement")  # fmt: skip
    ap.add_argument("--bound", choices=["pickcube"], help="only the per-step costs and the bound they give")
    ap.add_argument("--seconds", type=float, default=30.0, help="--bound: seconds each cost is measured")
    ap.add_argument("--utd", type=float, default=1.0, help="--bound: updates per env step")
    ap.add_argument("--sac-result", type=Path, metavar="FILE",
                    help="pickcube_rlpd without pickcube_sac: a file whose last line is an earlier "
                    "call's, its pickcube_sac curves the ones RLPD is judged against")  # fmt: skip
    args = ap.parse_args()
    earlier_sac = _earlier_sac(args.sac_result) if args.sac_result else None
    result: dict = {"load_at_start": os.getloadavg()[0]}
    if args.bound:
        os.environ["OMP_NUM_THREADS"] = "1"  # before torch and the simulator load: one thread each
        result["pickcube_bound"] = bound_pickcube(3.0 if args.quick else args.seconds, args.utd)
        _print_bound(result["pickcube_bound"])
    else:
        parts = ["plans"] if args.quick else args.parts
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            for part in parts:
                t0 = time.perf_counter()
                if part == "sac":
                    result["sac_fetchreach"] = sac(args.seeds, work)
                elif part == "crossq":
                    result["crossq_fetchreach"] = sac(args.seeds, work, CROSSQ_CONFIG)
                elif part == "ppo":
                    result["ppo_fetchreach"] = ppo(work)
                elif part == "plans":
                    result["plans"] = plans(work, 2, 10) if args.quick else plans(work)
                elif part == "pickcube_sac":
                    result["pickcube_sac"] = sac(args.seeds, work, PICKCUBE_SAC, PICKCUBE_BAR)
                elif part == "pickcube_rlpd":
                    result["pickcube_rlpd"] = pickcube_rlpd(args.seeds, work)
                print(part, round(time.perf_counter() - t0, 1), "s:", result, flush=True)
    for name in ("sac", "crossq"):
        if f"{name}_fetchreach" in result:
            runs = result[f"{name}_fetchreach"].values()
            result[f"{name}_passed"] = all(
                r["steps_to_0.95"] is not None and r["steps_to_0.95"] <= 20_000 for r in runs
            )
    if "pickcube_sac" in result:
        runs = result["pickcube_sac"].values()
        result["pickcube_sac_passed"] = all(
            r["steps_to_0.8"] is not None and r["steps_to_0.8"] <= 300_000 for r in runs
        )
    sac_runs = result.get("pickcube_sac", earlier_sac)
    if "pickcube_rlpd" in result and sac_runs is not None:
        result["pickcube_rlpd_vs_sac"] = judge_rlpd(sac_runs, result["pickcube_rlpd"])
        result["pickcube_rlpd_passed"] = result["pickcube_rlpd_vs_sac"]["passed"]
    result["quick"] = args.quick
    result["load_at_end"] = os.getloadavg()[0]
    print(json.dumps(result))


def _print_bound(bound: dict) -> None:
    print(f"PickCube-v1 on one thread: {bound['sim_step_s'] * 1e3:.2f} ms per simulated step, "
          f"{bound['policy_call_per_env_s'] * 1e3:.2f} ms per env of a policy call; "
          f"two cores, {bound['utd']:g} update(s) per env step:")  # fmt: skip
    for algorithm in UPDATES:
        b = bound[algorithm]
        print(f"  {algorithm}: {b['update_s'] * 1e3:.1f} ms per update")
        for plan in ("collocated", "actor_learner"):
            p = b[plan]
            reach = " / ".join(f"{p[f'env_steps_in_{m}_min']:,}" for m in (30, 60, 120))
            minutes = p["minutes_for_300k"]
            print(f"    {plan:>13}: {reach} env steps in 30 / 60 / 120 min; 300k in {minutes} min")


if __name__ == "__main__":
    main()
