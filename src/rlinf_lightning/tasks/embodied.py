"""EmbodiedTask: RL of a policy in simulated environments (PPO), through the embodied workflow."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDict

from rlinf_lightning.flow.workflow import Workflow
from rlinf_lightning.strategies.base import BatchShape
from rlinf_lightning.tasks.base import Task

if TYPE_CHECKING:
    from rlinf_lightning.launchers.base import Runtime
    from rlinf_lightning.trainer import RLTrainer


class EmbodiedTask(Task):
    """Train in ``num_envs`` copies of an environment, ``steps`` actions per env per iteration.

    An iteration's samples are its env steps (``num_envs x steps``); a micro-batch is a shard of
    whole envs, so the plan's micro-batch size sets how many shards the envs are cut into (the
    env/policy pipelining of RLinf: while one shard simulates, the policy infers for another).

    Args:
        env: an ``ENVS`` name (plugins: ManiSkill3, LIBERO) or a gymnasium id (``FetchReachDense-v4``).
        env_kwargs: keyword arguments of the env factory (e.g. ``obs_mode``).
        num_envs: environments stepped in parallel.
        steps: actions per env per iteration.
        chunk: env steps per action (action chunks, executed open-loop).
        eval_episodes: deterministic episodes (one per env) per evaluation.
        group_size: for GRPO over episodes (``trainer.algorithm: grpo``): envs per group, reset
            with the same seed (at least 2; ``num_envs`` a multiple of it). Each iteration then
            runs new episodes of ``steps`` steps.
    """

    input_keys = ("shard", "first_env", "envs")
    eval_metric = "success"

    def __init__(
        self,
        env: str,
        env_kwargs: dict[str, Any] | None = None,
        num_envs: int = 16,
        steps: int = 64,
        chunk: int = 1,
        eval_episodes: int = 16,
        group_size: int = 8,
    ) -> None:
        self.env, self.env_kwargs = env, dict(env_kwargs or {})
        self.num_envs, self.steps, self.chunk = num_envs, steps, chunk
        self.eval_episodes, self.group_size = eval_episodes, group_size

    def validate_config(self) -> list[tuple[str, str]]:
        problems = []
        for key in ("num_envs", "steps", "chunk", "eval_episodes"):
            if getattr(self, key) < 1:
                problems.append((key, f"must be >= 1, got {getattr(self, key)}"))
        if self.group_size < 2:
            problems.append(
                ("group_size", f"must be >= 2 (GRPO compares a group's episodes), got {self.group_size}")
            )
        from rlinf_lightning.envs import ENVS

        if self.env not in ENVS:
            try:
                from rlinf_lightning.envs.gym import _ensure_registered

                _ensure_registered(self.env)
            except (KeyError, ImportError) as exc:
                problems.append(("env", f"{exc.args[0] if exc.args else exc}; registered: {', '.join(ENVS)}"))
        return problems

    def _episodic(self, trainer: RLTrainer) -> bool:
        """GRPO over episodes (an algorithm without a critic's GAE) groups envs."""
        from rlinf_lightning.algorithms import ALGORITHMS

        return not hasattr(ALGORITHMS.resolve(trainer.algorithm), "gae_lambda")

    def _spaces(self, seed: int) -> tuple[TensorDict, tuple[int, ...]]:
        """One env's observation and the action shape of a policy call (``chunk`` steps), from a
        probe env made once per task (the policy sizes itself from them)."""
        if not hasattr(self, "_probed"):
            from rlinf_lightning.envs import make_env

            probe = make_env(self.env, 1, **self.env_kwargs)
            try:
                self._probed = (probe.reset(seed), (self.chunk, *probe.action_shape))
            finally:
                probe.close()
        return self._probed

    def batch_shape(self, trainer: RLTrainer) -> BatchShape:
        """A micro-batch is whole envs (for GRPO: whole groups of envs)."""
        unit = self.steps * (self.group_size if self._episodic(trainer) else 1)
        return BatchShape(self.num_envs * self.steps, unit, trainer.micro_batch_size)

    def build_workflow(self, policy: Any, trainer: RLTrainer) -> Workflow:
        """The embodied workflow for ``trainer``'s algorithm (``ppo``, or ``grpo`` over episodes) and
        train engine; a policy that sizes itself from the env (``configure_spaces``) is shown one
        env's observation and the action shape."""
        from rlinf_lightning.algorithms import ALGORITHMS
        from rlinf_lightning.workflows.embodied import embodied_workflow

        if self._episodic(trainer) and self.num_envs % self.group_size:
            raise ValueError(
                f"task.group_size={self.group_size} does not cut task.num_envs={self.num_envs} "
                "into whole groups"
            )

        if hasattr(policy, "configure_spaces"):
            policy.configure_spaces(*self._spaces(trainer.seed))
        return embodied_workflow(
            policy=policy,
            algorithm=ALGORITHMS.resolve(trainer.algorithm),
            env=self.env,
            env_kwargs=self.env_kwargs,
            num_envs=self.num_envs,
            steps=self.steps,
            chunk=self.chunk,
            group_size=self.group_size if self._episodic(trainer) else 1,
            train=trainer.train_spec,
            seed=trainer.seed,
        )

    def inputs(self, iteration: int, micro_batch_size: int, trainer: RLTrainer) -> list[TensorDict]:
        """One descriptor per shard (the same shards every iteration: the env stage keeps them)."""
        per = max(1, micro_batch_size // self.steps)
        return [
            TensorDict(
                {
                    "shard": torch.tensor(k),
                    "first_env": torch.tensor(first),
                    "envs": torch.tensor(min(per, self.num_envs - first)),
                },
                batch_size=[],
            )
            for k, first in enumerate(range(0, self.num_envs, per))
        ]

    def evaluate(self, runtime: Runtime) -> dict[str, float]:
        """Success rate and return of deterministic episodes with the current weights."""
        return runtime.call(
            runtime.workflow.roles["evaluate"],
            "evaluate",
            self.env,
            self.env_kwargs,
            self.eval_episodes,
            10**6,
        )
