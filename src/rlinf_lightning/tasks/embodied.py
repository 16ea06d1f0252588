"""EmbodiedTask: RL of a policy in simulated environments (PPO), through the embodied workflow."""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDict

from rlinf_lightning.engines.precision import AUTO_ROLLOUT_DTYPE, rollout_dtype_problem
from rlinf_lightning.envs import ENVS, check_env
from rlinf_lightning.errors import ConfigError
from rlinf_lightning.flow.batch import BatchShape
from rlinf_lightning.flow.workflow import Workflow
from rlinf_lightning.tasks.base import RunSpec, Task
from rlinf_lightning.workflows.embodied import advantage_mode, embodied_workflow
from rlinf_lightning.workflows.embodied.env import EVAL_SEED
from rlinf_lightning.workflows.mini_batches import split_problem
from rlinf_lightning.workflows.offpolicy import is_off_policy
from rlinf_lightning.workflows.specs import EmbodiedSpec

if TYPE_CHECKING:
    from rlinf_lightning.launchers.base import Runtime

log = logging.getLogger(__name__)


class EmbodiedTask(Task):
    """Train in ``num_envs`` copies of an environment, ``steps`` actions per env per iteration.

    An iteration's samples are its env steps (``num_envs x steps``); a micro-batch is a shard of
    whole envs, so the plan's micro-batch size sets how many shards the envs are cut into (the
    env/policy pipelining of RLinf: while one shard simulates, the policy infers for another).

    Args:
        env: an ``ENVS`` name (plugins: ManiSkill3, LIBERO) or a gymnasium id (``FetchReachDense-v4``,
            ``CartPole-v1``; continuous or discrete actions, as the policy serves them).
        env_kwargs: keyword arguments of the env factory (e.g. ``obs_mode``).
        num_envs: environments stepped in parallel.
        steps: actions per env per iteration.
        chunk: env steps per action (action chunks, executed open-loop).
        eval_episodes: deterministic episodes (one per env) per evaluation.
        eval_metric: the evaluation's headline, reported before and after training: ``success``
            (the rate of episodes the env calls a success) or ``return`` (for an env without a
            notion of success, e.g. CartPole). ``success`` on an env that reports none in the
            first evaluation falls back to ``return``, with one warning.
        group_size: for GRPO over episodes (``trainer.algorithm: grpo``): envs per group, reset
            with the same seed (at least 2; ``num_envs`` a multiple of it). Each iteration then
            runs new episodes of ``steps`` steps.
        rollout_dtype: the dtype the rollout's policy computes in (autocast; its weights stay the
            policy's). ``auto`` (default): follow the actor, ``bfloat16`` where
            ``trainer.precision`` resolves to a bf16 one (``auto`` on a GPU or a CPU with bf16
            hardware), so the behaviour log-probs come from the forward the actor runs; else the
            policy's dtype. ``float32``, ``bfloat16``, ``float16``: that dtype; ``None``: the
            policy's. Exact float32 on both sides: ``trainer.precision=32-true``.
        train_micro_batch_size: samples per forward/backward in the actor (gradient
            accumulation; ``None``: a whole minibatch at once). The update is the same; smaller
            pieces keep the activations in cache (the 21 M-parameter VLA's update of 128 samples
            runs about 10% faster in pieces of 32 on a CPU) and bound the actor's memory.
        time_aware: add the elapsed fraction of the episode to the observation (``obs["time"]``)
            and make the env's time limit a terminal (``envs.time_aware``): a critic that reads
            it (``Pi0Policy(value_keys=["time"])``) predicts the return left before the limit,
            which one that cannot see the time has to learn by bootstrapping.
    """

    input_keys = ("shard", "first_env", "envs")
    headline = {"env/return": "return", "env/success": "success"}

    def __init__(
        self,
        env: str,
        env_kwargs: dict[str, Any] | None = None,
        num_envs: int = 16,
        steps: int = 64,
        chunk: int = 1,
        eval_episodes: int = 16,
        group_size: int = 8,
        eval_metric: str = "success",
        rollout_dtype: str | None = AUTO_ROLLOUT_DTYPE,
        train_micro_batch_size: int | None = None,
        time_aware: bool = False,
    ) -> None:
        self.env, self.env_kwargs = env, dict(env_kwargs or {})
        self.num_envs, self.steps, self.chunk = num_envs, steps, chunk
        self.eval_episodes, self.group_size, self.eval_metric = eval_episodes, group_size, eval_metric
        self.rollout_dtype, self.train_micro_batch_size = rollout_dtype, train_micro_batch_size
        self.time_aware = time_aware

    @property
    def _env_kwargs(self) -> dict[str, Any]:
        """What every env of the run is made with: ``env_kwargs``, and the time wrapper's switch."""
        return {**self.env_kwargs, "time_aware": True} if self.time_aware else self.env_kwargs

    def validate_config(self) -> list[tuple[str, str]]:
        problems = []
        for key in ("num_envs", "steps", "chunk", "eval_episodes"):
            if getattr(self, key) < 1:
                problems.append((key, f"must be >= 1, got {getattr(self, key)}"))
        if self.group_size < 2:
            problems.append(
                ("group_size", f"must be >= 2 (GRPO compares a group's episodes), got {self.group_size}")
            )
        if self.train_micro_batch_size is not None and self.train_micro_batch_size < 1:
            why = f"must be >= 1 or null, got {self.train_micro_batch_size}"
            problems.append(("train_micro_batch_size", why))
        if why := rollout_dtype_problem(self.rollout_dtype):
            problems.append(("rollout_dtype", why))
        if self.eval_metric not in ("success", "return"):
            problems.append(("eval_metric", f"must be success or return, got {self.eval_metric!r}"))
        if why := check_env(self.env):
            problems.append(("env", f"{why}; registered: {', '.join(ENVS)}"))
        return problems

    @staticmethod
    def _episodic(run: RunSpec) -> bool:
        """GRPO over episodes (an algorithm reading no values) groups envs; an algorithm the
        workflow cannot serve is a ``ConfigError``; an off-policy one runs on."""
        return not is_off_policy(run.algorithm) and advantage_mode(run.algorithm) == "episodes"

    def _spaces(self, seed: int) -> tuple[TensorDict, tuple[int, ...], tuple[int, ...] | None]:
        """One env's observation, the action shape of a policy call (``chunk`` steps) and, for
        discrete actions, the choices of each of its entries: from a probe env made once per task
        (the policy sizes itself and picks its head from them)."""
        if not hasattr(self, "_probed"):
            from rlinf_lightning.envs import make_env

            probe = make_env(self.env, 1, **self._env_kwargs)
            try:
                choices = probe.action_choices
                self._horizon = probe.max_episode_steps
                self._probed = (
                    probe.reset(seed),
                    (self.chunk, *probe.action_shape),
                    None if choices is None else tuple(choices) * self.chunk,
                )
            finally:
                probe.close()
        return self._probed

    def batch_shape(self, run: RunSpec) -> BatchShape:
        """A micro-batch is whole envs (for GRPO: whole groups of envs)."""
        unit = self.steps * (self.group_size if self._episodic(run) else 1)
        return BatchShape(self.num_envs * self.steps, unit, run.micro_batch_size)

    def build_workflow(self, policy: Any, run: RunSpec) -> Workflow:
        """The embodied workflow for the run's algorithm (``ppo``, or ``grpo`` over episodes) and
        train engine; a policy that sizes itself from the env (``configure_spaces``) is shown one
        env's observation and the action shape."""
        if self._episodic(run) and self.num_envs % self.group_size:
            why = f"{self.group_size} does not cut task.num_envs={self.num_envs} into whole groups"
            raise ConfigError([("task.group_size", why)])
        samples = f"task.num_envs={self.num_envs} x task.steps={self.steps}"
        count = run.algorithm.num_minibatches
        if split := split_problem(
            "trainer.algorithm.num_minibatches", count, self.num_envs * self.steps, samples
        ):
            raise ConfigError([split])

        try:  # one env made here, before any worker: a bad keyword is one line, not a worker's traceback
            obs, shape, choices = self._spaces(run.seed)
        except TypeError as exc:
            raise ConfigError([("task.env_kwargs", f"{self.env}: {exc}")]) from exc
        except ConfigError:  # the env named its key (task.time_aware without a time limit)
            raise
        except ValueError as exc:  # an action space no policy here serves
            raise ConfigError([("task.env", str(exc))]) from exc
        if self._horizon is not None and self.chunk > self._horizon:
            why = f"{self.chunk} steps per chunk, longer than {self.env}'s episodes ({self._horizon} steps)"
            raise ConfigError([("task.chunk", why)])
        try:
            policy.configure_spaces(obs, shape, action_choices=choices)
        except ConfigError as exc:  # the policy named the key at fault
            raise ConfigError([(key, f"{why} (env {self.env})") for key, why in exc.problems]) from exc
        except ValueError as exc:
            space = f"continuous {shape[1:]}" if choices is None else f"discrete, choices {choices}"
            why = f"{self.env} (actions: {space}) does not suit {type(policy).__name__}: {exc}"
            raise ConfigError([("task.env", why)]) from exc
        if is_off_policy(run.algorithm):
            from rlinf_lightning.workflows.offpolicy import build_offpolicy

            return build_offpolicy(policy, run, self.workflow_spec(run), obs, shape)
        return embodied_workflow(policy, run, self.workflow_spec(run))

    def workflow_spec(self, run: RunSpec) -> EmbodiedSpec:
        """This task's keys as the embodied workflows read them (envs grouped only for GRPO over
        episodes)."""
        return EmbodiedSpec(
            env=self.env,
            env_kwargs=self._env_kwargs,
            num_envs=self.num_envs,
            steps=self.steps,
            chunk=self.chunk,
            group_size=self.group_size if self._episodic(run) else 1,
            rollout_dtype=self.rollout_dtype,
            train_micro_batch_size=self.train_micro_batch_size,
        )

    def inputs(self, iteration: int, micro_batch_size: int, run: RunSpec) -> list[TensorDict]:
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
        """Success rate and return of deterministic episodes with the current weights (``eval_metric``
        names the headline; ``success`` becomes ``return`` when the env reports no success)."""
        metrics = runtime.call(
            runtime.workflow.roles["evaluate"],
            "evaluate",
            self.env,
            self._env_kwargs,
            self.eval_episodes,
            EVAL_SEED,
        )
        if self.eval_metric == "success" and math.isnan(metrics["success"]):
            log.warning(
                "task.eval_metric is success, but %s reported no success in its %d evaluation episodes "
                "(an env without a notion of success): the headline is the return instead "
                "(set task.eval_metric=return to say so)",
                self.env, self.eval_episodes,
            )  # fmt: skip
            self.eval_metric = "return"
        return metrics
