"""The env stage of the off-policy flow: the embodied env stage, keeping each step's next
observation as well, so that its trajectories are transitions for a replay buffer."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from rlinf_lightning.workflows.embodied.env import EnvStage, _Shard


class TransitionEnvStage(EnvStage):
    """:class:`EnvStage` whose trajectories also hold ``next_obs``: the observation each step led
    to, the episode's final observation where the step ended it (the env has already reset that
    env: its next step starts the next episode)."""

    out_keys = (*EnvStage.out_keys, "next_obs")

    def _start(self, shard: int, first_env: int, n: int) -> TensorDict:
        out = super()._start(shard, first_env, n)
        self.shards[shard].steps["next_obs"] = []
        return out

    def _step(self, s: _Shard, action: torch.Tensor) -> None:
        super()._step(s, action)
        ended = s.steps["terminated"][-1] | s.steps["truncated"][-1]
        next_obs = s.obs.clone()
        if bool(ended.any()):
            next_obs[ended] = s.final_obs[ended]
        s.steps["next_obs"].append(next_obs)
