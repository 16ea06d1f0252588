"""The off-policy embodied flow (SAC, RLPD, CrossQ) as stages:

    env shards -> env <-> rollout (a loop: steps + 1 turns) -> actor (learner, replay buffer)
    actor ==weights==> rollout                                                  (sync)

The env and rollout stages are the embodied flow's (``workflows/embodied``), the env keeping each
step's next observation; the learner writes the transitions into its replay buffer and takes
``updates_per_step`` updates per new transition at the iteration's end. Collocated plans alternate
``task.steps`` env steps per env with the updates they earned; with ``trainer.max_staleness`` k > 0
the env workers collect the next iterations with weights up to k versions old while the learner
updates (actor-learner), weights synced once per iteration.
"""

from __future__ import annotations

from typing import Any

from tensordict import TensorDict

from rlinf_lightning.algorithms.sac import SAC
from rlinf_lightning.engines.precision import AUTO_ROLLOUT_DTYPE
from rlinf_lightning.engines.train import TrainSpec
from rlinf_lightning.policies.module import RLModule
from rlinf_lightning.workflows.embodied.rollout import EnvRolloutStage
from rlinf_lightning.workflows.offpolicy.env import TransitionEnvStage
from rlinf_lightning.workflows.offpolicy.learner import OffPolicyLearnerStage


def is_off_policy(algorithm: Any) -> bool:
    """Whether ``algorithm`` learns from a replay buffer (SAC and its presets, RLPD and CrossQ)."""
    return isinstance(algorithm, SAC)


def offpolicy_workflow(
    *,
    policy: RLModule,
    algorithm: SAC,
    env: str,
    env_kwargs: dict[str, Any] | None,
    steps: int,
    chunk: int,
    train: TrainSpec,
    seed: int,
    transition_bytes: int,
    demos: TensorDict | None = None,
    max_staleness: int = 0,
    rollout_dtype: str | None = AUTO_ROLLOUT_DTYPE,
) -> Any:
    from rlinf_lightning.flow.workflow import Workflow

    learner = OffPolicyLearnerStage(policy, algorithm, train, transition_bytes, demos, seed, max_staleness)
    return (
        Workflow("offpolicy")
        .chain(TransitionEnvStage(env, env_kwargs, steps, chunk, seed), learner)
        .add(EnvRolloutStage(policy, seed, chunk, rollout_dtype, train.precision))
        .loop("env", "rollout", turns=steps + 1)
        .sync("actor", "rollout", "weights", staleness=max_staleness)
        .role("train", "actor")
        .role("evaluate", "rollout")
    )


def build_offpolicy(task: Any, policy: RLModule, run: Any, obs: TensorDict, shape: tuple[int, ...]) -> Any:
    """The off-policy workflow of an :class:`~rlinf_lightning.tasks.EmbodiedTask` whose policy
    has been sized from the env (``obs``: one observation; ``shape``: a policy call's actions);
    what the policy and algorithm cannot do together, and a demo file that cannot serve, are one
    :class:`ConfigError` line each, before any worker starts."""
    import math

    from rlinf_lightning.errors import ConfigError
    from rlinf_lightning.workflows.offpolicy.demos import load_demo_transitions
    from rlinf_lightning.workflows.offpolicy.replay import transition_bytes

    algorithm: SAC = run.algorithm
    problems = []
    for method in ("sample", "q", "update_targets")[: 3 if algorithm.target_critics else 2]:
        if not callable(getattr(policy, method, None)):
            problems.append(("policy", f"{type(policy).__name__} has no {method}(): SAC trains a SACPolicy"))
    if not problems and getattr(policy, "target_critics", True) != algorithm.target_critics:
        name = type(algorithm).__name__
        why = (f"{name} learns without target critics, from batch-normalized ones: use "
               "rlinf_lightning.policies.CrossQPolicy" if not algorithm.target_critics else
               f"{name} moves target critics, {type(policy).__name__} has none: use "
               "rlinf_lightning.policies.SACPolicy")  # fmt: skip
        problems.append(("policy", why))
    critics = getattr(policy, "num_critics", 0)
    if algorithm.critic_subset is not None and algorithm.critic_subset > critics:
        why = f"{algorithm.critic_subset} critics for the target, but policy.num_critics is {critics}"
        problems.append(("trainer.algorithm.critic_subset", why))
    if problems:
        raise ConfigError(problems)
    demos = None
    if algorithm.demo_path is not None:
        try:
            demos = load_demo_transitions(algorithm.demo_path, obs)
        except (OSError, ValueError) as exc:
            raise ConfigError([("trainer.algorithm.demo_path", str(exc))]) from exc
    return offpolicy_workflow(
        policy=policy,
        algorithm=algorithm,
        env=task.env,
        env_kwargs=task._env_kwargs,
        steps=task.steps,
        chunk=task.chunk,
        train=run.train,
        seed=run.seed,
        transition_bytes=transition_bytes(obs, math.prod(shape)),
        demos=demos,
        max_staleness=run.max_staleness,
        rollout_dtype=task.rollout_dtype,
    )
