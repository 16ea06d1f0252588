"""The advantage stages: GAE over the steps with the critic's values, or GRPO over episodes."""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from rlinf_lightning.algorithms.advantages import groups_with_signal
from rlinf_lightning.flow.metrics import Metrics
from rlinf_lightning.flow.stage import MemoryPart, Stage, StageContext
from rlinf_lightning.workflows.finite import check_finite


class _AdvantageStage(Stage):
    """What both advantage stages share: the algorithm, the policy's replay keys carried through to
    the actor, no memory to speak of, and the iteration for the non-finite guard's message."""

    name = "advantage"
    iteration = 0  # the one running (begin_iteration), for the non-finite guard's message

    def __init__(self, algorithm: Any, replay_keys: tuple[str, ...] = ()) -> None:
        self.algorithm, self.replay_keys = algorithm, tuple(replay_keys)

    def memory(self, device: str, replicas: int, micro_batch: int) -> list[MemoryPart]:
        return []  # a few numbers per sample

    def begin_iteration(self, iteration: int) -> None:
        self.iteration = iteration

    def samples(self, traj: TensorDict, **extra: torch.Tensor) -> TensorDict:
        """The trajectory's steps as samples for the actor: what the policy acted with and on (its
        replay keys too, which its ``evaluate`` reads back), ``extra`` (``[envs, steps]`` each) and a
        global ``sample_id``; flattened over envs and steps."""
        n, steps = traj["logprob"].shape[:2]
        keys = ("obs", "action", *self.replay_keys, "logprob", "value", "policy_version")
        samples = TensorDict(
            {
                **{k: traj[k] for k in keys},
                **extra,
                "sample_id": traj["env_id"][:, None] * steps + torch.arange(steps),
            },
            batch_size=[n, steps],
        )
        return samples.reshape(-1)


class GAEStage(_AdvantageStage):
    """GAE over each shard's trajectory; emits its steps as samples (with a global sample id)."""

    in_keys = ("reward", "value", "terminated", "truncated", "final_value", "next_value", "env_id",
               "policy_version")  # fmt: skip
    out_keys = ("advantage", "return", "sample_id")

    def process(self, traj: TensorDict) -> TensorDict:
        check_finite(self.name, self.iteration, "rewards", traj["reward"])
        adv, ret = self.algorithm.compute_advantages(
            traj["reward"], traj["value"], traj["terminated"], traj["truncated"], traj["final_value"],
            traj["next_value"],
        )  # fmt: skip
        check_finite(self.name, self.iteration, "advantages", adv)
        return self.samples(traj, advantage=adv, **{"return": ret})


class EpisodeAdvantageStage(_AdvantageStage):
    """GRPO over episodes: one score per env's episode, normalised within its group (whole groups
    share a shard); every step of the episode until its first end gets that advantage. Groups
    whose scores are all equal carry no signal and are dropped (masked out)."""

    in_keys = ("score", "group_id", "mask", "env_id", "policy_version")
    out_keys = ("advantage", "mask", "sample_id")

    def setup(self, ctx: StageContext) -> None:
        self.metrics = Metrics()

    def process(self, traj: TensorDict) -> TensorDict:
        check_finite(self.name, self.iteration, "episode scores", traj["score"])
        adv = self.algorithm.compute_advantages({"rewards": traj["score"], "group_ids": traj["group_id"]})
        check_finite(self.name, self.iteration, "advantages", adv)
        signal = groups_with_signal(adv, traj["group_id"], self.metrics)
        steps = traj["mask"].shape[1]
        advantage = adv[:, None].expand(-1, steps)
        return self.samples(traj, advantage=advantage, mask=traj["mask"] & signal[:, None])

    def end_iteration(self) -> Metrics:
        return self.metrics.take()
