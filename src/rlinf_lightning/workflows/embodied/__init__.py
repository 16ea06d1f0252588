"""The embodied-RL macro flow (PPO over simulated environments) as stages:

    env shards -> env <-> rollout (a loop: steps + 1 turns) -> advantage -> actor   (stream)
    actor ==weights==> rollout                                                     (sync)

Each input micro-batch names a shard of the envs. The env stage owns its shards' simulators (it is
``sticky``: shard ``k`` always lands on the same replica) and sends their observations round the
loop; the rollout stage answers with actions, log-probs and values; the env steps. After ``steps``
steps, one more turn values the last observation (GAE's bootstrap), and the shard's trajectory goes
downstream. Episodes run on across iterations. The rollout draws each env's action noise from a
generator seeded by ``(seed, env id, global step)``, so the trajectories do not depend on how the
plan cut the envs into shards or placed them.

Two ways to advantages, chosen by what the algorithm ``reads`` (:func:`advantage_mode`): GAE
over the steps with the critic's values (PPO), or GRPO over episodes as RLinf offers it (no critic):
every iteration starts new episodes, the envs of a group reset with the same seed, each episode gets
one score (success at any step), scores are normalised within the group, every step of an episode
until its first end carries its score's advantage, and groups whose episodes all succeeded or all
failed are dropped (they carry no signal). An algorithm reading anything else is refused before
anything loads.
"""

from __future__ import annotations

from typing import Any

from rlinf_lightning.algorithms.contract import interface_problems
from rlinf_lightning.errors import ConfigError
from rlinf_lightning.flow.batch import LOSS_MASK
from rlinf_lightning.flow.workflow import Workflow
from rlinf_lightning.policies.module import RLModule
from rlinf_lightning.workflows.embodied.actor import EpisodeGRPOLoss, PPOActorStage, PPOLoss
from rlinf_lightning.workflows.embodied.advantage import EpisodeAdvantageStage, GAEStage
from rlinf_lightning.workflows.embodied.env import EnvStage
from rlinf_lightning.workflows.embodied.rollout import EnvRolloutStage
from rlinf_lightning.workflows.specs import EmbodiedSpec, RunSpec

#: what the workflow gives an algorithm, by the way it computes advantages: GAE over each step's
#: reward with the critic's values, or one score per episode compared within a group of envs
PROVIDES = {
    "gae": frozenset({"rewards", "values", "dones", "old_logprobs", "proximal_logprobs"}),
    "episodes": frozenset({"rewards", "group_ids", LOSS_MASK, "old_logprobs", "proximal_logprobs"}),
}


def advantage_mode(algorithm: Any) -> str:
    """The ``PROVIDES`` entry that serves ``algorithm`` (``gae`` when it reads values, else
    ``episodes``); a :class:`ConfigError` naming what it reads that neither provides, or the
    declared attributes it lacks (``algorithms.contract.Algorithm``)."""
    if problems := interface_problems(algorithm):
        raise ConfigError(problems)
    reads, name = frozenset(algorithm.reads), type(algorithm).__name__
    if not reads:
        raise ConfigError([("trainer.algorithm", f"{name} declares no `reads` (the inputs it needs)")])
    mode = "gae" if "values" in reads else "episodes"
    if missing := sorted(reads - PROVIDES[mode]):
        why = (f"{name} reads {', '.join(missing)}, which the embodied workflow does not provide "
               f"(it gives {', '.join(sorted(PROVIDES[mode]))})")  # fmt: skip
        raise ConfigError([("trainer.algorithm", why)])
    return mode


def embodied_workflow(policy: RLModule, run: RunSpec, spec: EmbodiedSpec) -> Workflow:
    """PPO (an algorithm reading values: GAE) or GRPO over episodes, by :func:`advantage_mode`."""
    algorithm, seed, steps, chunk = run.algorithm, run.seed, spec.steps, spec.chunk
    ppo = advantage_mode(algorithm) == "gae"
    replay = tuple(policy.replay_keys)
    advantage = GAEStage(algorithm, replay) if ppo else EpisodeAdvantageStage(algorithm, replay)
    loss = PPOLoss(algorithm) if ppo else EpisodeGRPOLoss(algorithm)
    actor = PPOActorStage(policy, run, spec, loss)
    env = EnvStage(
        spec.env, spec.env_kwargs, steps, chunk, seed, spec.group_size, episodic=not ppo, replay_keys=replay
    )
    return (
        Workflow("embodied")
        .chain(env, advantage, actor)
        .add(EnvRolloutStage(policy, seed, chunk, spec.rollout_dtype, run.train.precision))
        .loop("env", "rollout", turns=steps + 1)
        .sync("actor", "rollout", "weights", staleness=run.max_staleness)
        .role("train", "actor")
        .role("evaluate", "rollout")
    )
