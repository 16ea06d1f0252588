"""The env stage: owns its shards' simulators, steps them with the rollout's actions, keeps episodes
running across iterations and evaluates on held-out seeds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict

from rlinf_lightning.envs import EnvBatch, import_env, make_env
from rlinf_lightning.flow.metrics import Metrics
from rlinf_lightning.flow.stage import Stage, StageContext
from rlinf_lightning.seeds import SEED_STRIDE

#: training resets draw their seeds below this and evaluation episodes from it up (episode ``k``
#: resets with ``EVAL_SEED + k``), so no evaluation episode replays a training episode; both stay
#: below 2**32, which simulators that seed numpy's ``RandomState`` require
EVAL_SEED = 2**31
#: evaluation's cap on an episode when the env declares no time limit: a policy that never ends an
#: episode costs bounded time instead of hanging the run
EVAL_MAX_STEPS = 10_000


@dataclass
class _Shard:
    """One shard's envs and the trajectory being collected this iteration."""

    env: EnvBatch
    shard: int
    first_env: int
    obs: TensorDict
    final_obs: TensorDict | None = None
    t: int = 0
    steps: dict[str, list[torch.Tensor | TensorDict]] = field(default_factory=dict)
    episode_return: torch.Tensor | None = None
    episode_length: torch.Tensor | None = None
    succeeded: torch.Tensor | None = None  # per env: success at some step of this iteration
    running: torch.Tensor | None = None  # per env: still in the iteration's first episode


class _Episodes:
    """The episodes that ended this iteration (mean success, return and length; how many; how many
    reported no success, NaN: an env without a notion of success) and the env steps taken; counts
    are per second as ``perf/*_per_s`` where named ``*_total``."""

    def __init__(self) -> None:
        self.metrics = Metrics()
        self.metrics.sum("episodes_total", 0)
        self.metrics.sum("env_steps_total", 0)
        self.metrics.sum("episodes_without_success", 0)

    def steps(self, n: int) -> None:
        self.metrics.sum("env_steps_total", n)

    def ended(self, success: torch.Tensor, returns: torch.Tensor, lengths: torch.Tensor) -> None:
        reported = ~torch.isnan(success)
        self.metrics.sum("episodes_total", len(success))
        self.metrics.sum("episodes_without_success", (~reported).sum())
        self.metrics.mean("return", float(returns.mean()), len(returns))
        self.metrics.mean("length", float(lengths.float().mean()), len(lengths))
        if reported.any():
            self.metrics.mean("success", float(success[reported].mean()), int(reported.sum()))


class EnvStage(Stage):
    """Steps its shards' envs with the rollout's actions; emits each shard's trajectory.

    Args:
        env: an ``ENVS`` name or a gymnasium id.
        env_kwargs: keyword arguments of the env factory.
        steps: env steps per iteration (actions per env; a chunk of ``chunk`` steps counts once).
        chunk: actions per policy call, executed open-loop (rewards summed over the chunk).
        seed: env ``i`` is reset with ``seed + i`` (with ``group_size`` > 1: its group's seed).
        group_size: envs that share reset seeds (a GRPO group).
        episodic: start new episodes every iteration (GRPO), instead of running episodes on.
        replay_keys: entries of the rollout's answer kept per step with the action (the policy's
            ``replay_keys``).
    """

    name = "env"
    sticky = True
    in_keys = ("shard", "first_env", "envs")
    # round the loop: observations; downstream: each shard's trajectory
    out_keys = ("obs", "final_obs", "bootstrap", "env_id", "step", "action", "logprob", "value", "reward",
                "terminated", "truncated", "final_value", "next_value", "mask", "score",
                "group_id", "policy_version")  # fmt: skip

    def __init__(
        self,
        env: str,
        env_kwargs: dict[str, Any] | None,
        steps: int,
        chunk: int = 1,
        seed: int = 0,
        group_size: int = 1,
        episodic: bool = False,
        replay_keys: tuple[str, ...] = (),
    ) -> None:
        self.env_name, self.env_kwargs = env, dict(env_kwargs or {})
        self.replay_keys = tuple(replay_keys)
        self.steps, self.chunk, self.seed = steps, chunk, seed
        self.group_size, self.episodic = group_size, episodic

    def setup(self, ctx: StageContext) -> None:
        self.shards: dict[int, _Shard] = {}
        import_env(self.env_name, **self.env_kwargs)  # the envs are made with their shards, in iteration 1

    def begin_iteration(self, iteration: int) -> None:
        self.iteration = iteration
        self.episodes = _Episodes()

    def process(self, batch: TensorDict) -> TensorDict:
        if "action" not in batch.keys():
            return self._start(int(batch["shard"]), int(batch["first_env"]), int(batch["envs"]))
        return self._answer(self.shards[int(batch["shard"][0])], batch)

    def _seeds(self, first_env: int, n: int) -> list[int]:
        """Reset seeds of envs ``first_env .. first_env + n``: their group's, below ``EVAL_SEED``."""
        groups = [(first_env + i) // self.group_size for i in range(n)]
        # GRPO: new episodes, and new group seeds, every iteration (SEED_STRIDE > groups per iteration)
        base = self.seed + (SEED_STRIDE * self.iteration if self.episodic else 0)
        return [(base + g) % EVAL_SEED for g in groups]

    def _start(self, shard: int, first_env: int, n: int) -> TensorDict:
        s = self.shards.get(shard)
        if s is None or self.episodic:
            env = s.env if s is not None else make_env(self.env_name, n, **self.env_kwargs)
            s = self.shards[shard] = _Shard(env, shard, first_env, env.reset(self._seeds(first_env, n)))
            s.episode_return, s.episode_length = torch.zeros(n), torch.zeros(n, dtype=torch.long)
        s.t, s.steps = 0, {k: [] for k in ("obs", "action", "logprob", "value", "policy_version", "reward",
                                          "terminated", "truncated", "final_value", "mask",
                                          *self.replay_keys)}  # fmt: skip
        s.succeeded, s.running = torch.zeros(n, dtype=torch.bool), torch.ones(n, dtype=torch.bool)
        return self._observation(s)

    def _observation(self, s: _Shard) -> TensorDict:
        n = s.env.num_envs
        step = (self.iteration - 1) * self.steps + s.t  # the same whatever the plan: seeds the actions
        return TensorDict(
            {
                "obs": s.obs,
                "final_obs": s.final_obs if s.final_obs is not None else s.obs,
                "bootstrap": s.steps["truncated"][-1] if s.t > 0 else torch.zeros(n, dtype=torch.bool),
                "env_id": torch.arange(s.first_env, s.first_env + n),
                "shard": torch.full((n,), s.shard),
                "step": torch.full((n,), step),
            },
            batch_size=[n],
        )

    def _answer(self, s: _Shard, answer: TensorDict) -> TensorDict:
        if s.t > 0:  # the value of the last step's final observations (bootstrap where truncated)
            s.steps["final_value"].append(answer["final_value"])
        if s.t == self.steps:  # the extra turn: the value of the last observation, then the trajectory
            return self._trajectory(s, answer["value"])
        for key in ("action", "logprob", "value", "policy_version", *self.replay_keys):
            s.steps[key].append(answer[key])
        s.steps["obs"].append(s.obs)
        self._step(s, answer["action"])
        s.t += 1
        return self._observation(s)

    def _step(self, s: _Shard, action: torch.Tensor) -> None:
        env = s.env
        n = env.num_envs
        actions = action.reshape(n, self.chunk, *env.action_shape)
        low, high = env.action_low, env.action_high
        reward = torch.zeros(n)
        terminated = torch.zeros(n, dtype=torch.bool)
        truncated = torch.zeros(n, dtype=torch.bool)
        final_obs = None
        s.steps["mask"].append(s.running.clone())  # a step of the iteration's first episode
        for i in range(self.chunk):
            step = env.step(torch.maximum(torch.minimum(actions[:, i], high), low))
            self.episodes.steps(n)
            live = ~(terminated | truncated)  # an env that ended inside the chunk adds nothing more
            reward += torch.where(live, step.reward, torch.zeros(n))
            s.episode_return += torch.where(live, step.reward, torch.zeros(n))
            s.episode_length += live.long()
            s.succeeded |= live & s.running & (step.success == 1.0)
            ended = live & (step.terminated | step.truncated)
            if ended.any():
                final_obs = step.obs.clone() if final_obs is None else final_obs
                final_obs[ended] = step.final_obs[ended]
                self.episodes.ended(step.success[ended], s.episode_return[ended], s.episode_length[ended])
                s.episode_return[ended], s.episode_length[ended] = 0.0, 0
            terminated |= live & step.terminated
            truncated |= live & step.truncated
            s.obs = step.obs
        s.final_obs = final_obs
        s.running &= ~(terminated | truncated)
        s.steps["reward"].append(reward)
        s.steps["terminated"].append(terminated)
        s.steps["truncated"].append(truncated & ~terminated)

    def _trajectory(self, s: _Shard, next_value: torch.Tensor) -> TensorDict:
        n = s.env.num_envs
        per_step = {k: torch.stack(v, dim=1) for k, v in s.steps.items()}
        env_id = torch.arange(s.first_env, s.first_env + n)
        return TensorDict(
            {**per_step, "next_value": next_value, "env_id": env_id, "score": s.succeeded.float(),
             "group_id": env_id // self.group_size},
            batch_size=[n],
        )  # fmt: skip

    def end_iteration(self) -> Metrics:
        return self.episodes.metrics

    def teardown(self) -> None:
        for s in self.shards.values():
            s.env.close()
