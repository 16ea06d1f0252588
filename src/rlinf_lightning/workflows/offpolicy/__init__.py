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
from rlinf_lightning.flow.workflow import Workflow
from rlinf_lightning.policies.module import RLModule
from rlinf_lightning.policies.sac import SoftActorCritic
from rlinf_lightning.workflows.embodied.rollout import EnvRolloutStage
from rlinf_lightning.workflows.offpolicy.env import TransitionEnvStage
from rlinf_lightning.workflows.offpolicy.learner import OffPolicyLearnerStage
from rlinf_lightning.workflows.specs import EmbodiedSpec, RunSpec


def is_off_policy(algorithm: Any) -> bool:
    """Whether ``algorithm`` learns from a replay buffer (SAC and its presets, RLPD and CrossQ)."""
    return isinstance(algorithm, SAC)


def offpolicy_workflow(
    policy: RLModule,
    run: RunSpec,
    spec: EmbodiedSpec,
    transition_bytes: int,
    demos: TensorDict | None = None,
) -> Workflow:
    """The env, rollout and learner stages for ``run.algorithm`` (a :class:`SAC`);
    ``transition_bytes`` sizes the replay buffer's memory, ``demos`` fill its second buffer."""
    learner = OffPolicyLearnerStage(
        policy, run.algorithm, run.train, transition_bytes, demos, run.seed, run.max_staleness
    )
    return (
        Workflow("offpolicy")
        .chain(TransitionEnvStage(spec.env, spec.env_kwargs, spec.steps, spec.chunk, run.seed), learner)
        .add(EnvRolloutStage(policy, run.seed, spec.chunk, spec.rollout_dtype, run.train.precision))
        .loop("env", "rollout", turns=spec.steps + 1)
        .sync("actor", "rollout", "weights", staleness=run.max_staleness)
        .role("train", "actor")
        .role("evaluate", "rollout")
    )


def build_offpolicy(
    policy: RLModule, run: RunSpec, spec: EmbodiedSpec, obs: TensorDict, shape: tuple[int, ...]
) -> Workflow:
    """The off-policy workflow of an :class:`~rlinf_lightning.tasks.EmbodiedTask` whose policy
    has been sized from the env (``obs``: one observation; ``shape``: a policy call's actions);
    what the policy and algorithm cannot do together, and a demo file that cannot serve, are one
    :class:`ConfigError` line each, before any worker starts."""
    import math

    from rlinf_lightning.errors import ConfigError
    from rlinf_lightning.workflows.offpolicy.demos import load_demo_transitions
    from rlinf_lightning.workflows.offpolicy.replay import transition_bytes

    algorithm: SAC = run.algorithm
    if not isinstance(policy, SoftActorCritic):
        names = ("features", "sample", "q", "update_targets", "num_critics", "target_critics")
        missing = ", ".join(m for m in names if not hasattr(policy, m))
        why = f"{type(policy).__name__} lacks {missing}: SAC trains a SACPolicy (a SoftActorCritic)"
        raise ConfigError([("policy", why)])
    if policy.target_critics != algorithm.target_critics:
        name = type(algorithm).__name__
        why = (f"{name} learns without target critics, from batch-normalized ones: use "
               "rlinf_lightning.policies.CrossQPolicy" if not algorithm.target_critics else
               f"{name} moves target critics, {type(policy).__name__} has none: use "
               "rlinf_lightning.policies.SACPolicy")  # fmt: skip
        raise ConfigError([("policy", why)])
    critics = policy.num_critics
    if algorithm.critic_subset is not None and algorithm.critic_subset > critics:
        why = f"{algorithm.critic_subset} critics for the target, but policy.num_critics is {critics}"
        raise ConfigError([("trainer.algorithm.critic_subset", why)])
    demos = None
    if algorithm.demo_path is not None:
        try:
            demos = load_demo_transitions(algorithm.demo_path, obs)
        except (OSError, ValueError) as exc:
            raise ConfigError([("trainer.algorithm.demo_path", str(exc))]) from exc
    return offpolicy_workflow(policy, run, spec, transition_bytes(obs, math.prod(shape)), demos)
