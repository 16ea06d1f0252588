"""The rollout stage: the policy's actions, log-probs and values for the env stage's observations."""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
from tensordict import TensorDict

from rlinf_lightning.engines.precision import AUTO_ROLLOUT_DTYPE, resolve_rollout_dtype
from rlinf_lightning.envs import make_env
from rlinf_lightning.flow.memory import weights_part
from rlinf_lightning.flow.stage import MemoryPart, Stage, StageContext
from rlinf_lightning.policies.module import RLModule
from rlinf_lightning.seeds import row_seed
from rlinf_lightning.workflows.embodied.env import EVAL_MAX_STEPS
from rlinf_lightning.workflows.training import policy_dtype


class EnvRolloutStage(Stage):
    """Answers the env: actions, their log-probs and values; the values of ended episodes' last
    observations. Takes new weights from the actor once per iteration; evaluates (role ``evaluate``).

    ``dtype`` is ``task.rollout_dtype``: the dtype the policy's forward computes in here, by
    autocast (the weights stay the policy's). ``auto`` follows the actor's ``precision`` on this
    stage's device (``engines.precision.resolve_rollout_dtype``): where the actor trains under
    bf16 autocast, the rollout runs the same bf16 forward (the behaviour log-probs are then the
    ones the actor computes, and a 21 M-parameter VLA infers 1.8x faster on an AVX512-BF16 CPU).
    Every output is float32 whatever the compute dtype.
    """

    name = "rollout"
    in_keys = ("obs", "final_obs", "bootstrap", "env_id", "step")
    out_keys = ("action", "logprob", "value", "final_value", "shard", "policy_version")

    def __init__(
        self,
        policy: RLModule,
        seed: int = 0,
        chunk: int = 1,
        dtype: str | None = AUTO_ROLLOUT_DTYPE,
        precision: str = "32-true",
    ) -> None:
        self.policy, self.seed, self.chunk = policy, seed, chunk
        self.dtype_setting, self.precision = dtype, precision

    def dtype(self, device: str) -> str:
        """The dtype the policy computes in on ``device``."""
        return resolve_rollout_dtype(self.dtype_setting, self.precision, device, policy_dtype(self.policy))

    def _compute(self) -> contextlib.AbstractContextManager:
        """Autocast to the rollout dtype where it is not the weights' own."""
        if self.compute_dtype == policy_dtype(self.policy):
            return contextlib.nullcontext()
        return torch.autocast(torch.device(self.device).type, dtype=getattr(torch, self.compute_dtype))

    def memory(self, device: str, replicas: int, micro_batch: int) -> list[MemoryPart] | None:
        """The policy's weights (parameter count x dtype bytes); not its forward's activations."""
        n = self.policy.parameter_count()
        return None if n is None else [weights_part(n, policy_dtype(self.policy))]

    def setup(self, ctx: StageContext) -> None:
        self.device, self.compute_dtype = ctx.device, self.dtype(ctx.device)
        self.net = copy.deepcopy(self.policy)
        self.net.configure_model()
        self.net.to(ctx.device).eval().requires_grad_(False)

    def _generators(self, env_ids: torch.Tensor, step: int) -> list[torch.Generator]:
        return [torch.Generator().manual_seed(row_seed(self.seed, int(e), step)) for e in env_ids]

    @torch.no_grad()
    def process(self, batch: TensorDict) -> TensorDict:
        batch = batch.to(self.device)
        gens = self._generators(batch["env_id"], int(batch["step"][0]))
        # GAE bootstraps only where the last step truncated an episode: value just those rows
        # (most steps none; a forward pass over every final observation would double the cost)
        rows = batch["bootstrap"].nonzero().squeeze(-1)
        with self._compute():
            out = _float32(self.net.act(batch["obs"], generators=gens))
            final_value = torch.zeros_like(out["value"])
            if len(rows):
                final_value[rows] = self.net.value(batch["final_obs"][rows]).float()
        out["final_value"] = final_value
        out["shard"] = batch["shard"]  # which of the env stage's shards asked
        out["policy_version"] = torch.full_like(batch["shard"], self.policy_version)
        return out.to("cpu")

    def apply_sync(self, source: str, state: TensorDict) -> None:
        params = dict(self.net.model.named_parameters())
        with torch.no_grad():
            for name, tensor in state.items():
                params[name].copy_(tensor.to(params[name].device, params[name].dtype))

    @torch.no_grad()
    def evaluate(self, env: str, env_kwargs: dict[str, Any], episodes: int, seed: int) -> dict[str, float]:
        """Success rate and return of one deterministic episode in each of ``episodes`` envs."""
        batch = make_env(env, episodes, **env_kwargs)
        try:
            obs = batch.reset(seed)
            returns, success = torch.zeros(episodes), torch.full((episodes,), float("nan"))
            done = torch.zeros(episodes, dtype=torch.bool)
            limit = batch.max_episode_steps or EVAL_MAX_STEPS
            for _ in range(0, limit, self.chunk):
                with self._compute():
                    action = self.net.act(obs.to(self.device), deterministic=True)["action"].float().cpu()
                for a in action.reshape(episodes, self.chunk, *batch.action_shape).unbind(1):  # open-loop
                    step = batch.step(torch.maximum(torch.minimum(a, batch.action_high), batch.action_low))
                    returns += torch.where(done, torch.zeros(episodes), step.reward)
                    ended = ~done & (step.terminated | step.truncated)
                    success[ended] = step.success[ended]
                    done |= ended
                    obs = step.obs
                if bool(done.all()):
                    break
        finally:
            batch.close()
        reported = success[~torch.isnan(success)]  # NaN: the env has no notion of success
        return {
            "success": float(reported.mean()) if len(reported) else float("nan"),
            "return": float(returns.mean()),
            "episodes": float(episodes),
        }


def _float32(out: TensorDict) -> TensorDict:
    """``out`` with its floating entries in float32 (a bf16 forward's actions, log-probs, values)."""
    return out.apply(lambda t: t.float() if t.is_floating_point() else t)
