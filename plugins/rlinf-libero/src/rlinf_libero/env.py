"""LIBERO suites as an :class:`~rlinf_lightning.envs.base.EnvBatch`: one process per env.

LIBERO (robosuite 1.4 on MuJoCo, rendered off-screen) steps at a few steps per second per env on
a CPU, most of it in the camera render, so each env runs in its own process as in RLinf:
gymnasium's ``AsyncVectorEnv`` over :class:`~rlinf_libero.gym_env.LiberoGymEnv`, with same-step
auto-reset (the ended episode's last observation comes back in ``info["final_obs"]``). The env
processes import numpy, gymnasium, LIBERO and robosuite, not torch; they are started with the
``forkserver`` method by default (safe from a multi-threaded parent; a script that builds envs at
the top level needs an ``if __name__ == "__main__":`` guard, as with ``spawn``).
``vectorization="sync"`` steps every env in this process instead.

Observations (``TensorDict`` of batch ``[num_envs]``): ``rgb`` uint8 ``[H, W, 3]`` (agentview,
turned the way RLinf and OpenVLA feed it to a policy; ``image_flip="vertical"`` gives the camera's
own unmirrored view), ``state`` float32 ``[8]`` (end-effector position, axis-angle orientation,
gripper fingers), ``instruction`` (the episode's task's language instruction, one string per env),
and with ``wrist_image=True`` ``wrist_rgb``. Actions: 7 values in ``[-1, 1]`` (end-effector
position and orientation deltas, gripper: -1 open, +1 close).

Episodes: ``terminated`` at success (LIBERO's goal check), ``truncated`` at ``max_episode_steps``
(default: the suite's OpenVLA evaluation horizon, 220 for ``libero_spatial``); ``success`` is 1.0
at a step where the goal check holds, else 0.0; reward 1.0 at success (LIBERO's sparse reward).
``reset(seed)`` seeds env ``i`` with ``seed + i`` (or ``seed[i]``); each episode of an env, the
first and every auto-reset, draws one of the task's fixed initial states (and, with
``task_id=None``, the task) from that env's seeded generator, so envs given equal seeds run equal
episodes (a GRPO group) and the sequence of episodes follows from the seeds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np
import torch
from tensordict import NonTensorStack, TensorDict

from rlinf_libero.gym_env import LiberoGymEnv, default_max_episode_steps, load_suite
from rlinf_lightning.envs.base import EnvBatch, Step

VECTORIZATION = ("async", "sync")


class LiberoEnvBatch(EnvBatch):
    """``num_envs`` envs of a LIBERO suite's task (see the module docstring).

    Args:
        num_envs: how many envs (one process each with ``vectorization="async"``).
        suite: ``libero_spatial`` (default), ``libero_object``, ``libero_goal``, ``libero_10``,
            ``libero_90``, or a LIBERO-PRO suite (``libero_spatial_lan``, ...).
        task_id: the task, an index into the suite (0-9; 0-89 for ``libero_90``); ``None``: each
            episode draws its task from the env's seeded generator (the simulator is rebuilt when
            the task changes, about a second).
        image_size: camera resolution, an int (square) or ``(height, width)``.
        max_episode_steps: the time limit; ``None``: the suite's (220 for ``libero_spatial``).
        wrist_image: add the eye-in-hand camera as ``wrist_rgb`` (about half as fast).
        settle_steps: steps with the arm held still after restoring an initial state (10, as in
            OpenVLA's and RLinf's LIBERO evaluations; not rendered, not counted).
        image_flip: ``"rotate180"`` (RLinf's and OpenVLA's view of LIBERO's bottom-up render),
            ``"vertical"`` (the camera's own view) or ``"none"``.
        fast_render: no reflections or shadows: about twice as fast on a CPU renderer, but the
            images no longer look like LIBERO's.
        terminate_on_success: end an episode at success (``False``: only the time limit does).
        vectorization: ``"async"`` (a process per env) or ``"sync"`` (all in this process).
        context: the ``multiprocessing`` start method of the env processes.
        gl: ``MUJOCO_GL`` of the env processes (``"egl"`` or ``"osmesa"``); default: the
            environment's ``MUJOCO_GL``, else ``"egl"``.
        env_kwargs: more keyword arguments of LIBERO's ``OffScreenRenderEnv``.
    """

    def __init__(
        self,
        num_envs: int,
        suite: str = "libero_spatial",
        task_id: int | None = 0,
        image_size: int | tuple[int, int] = 128,
        max_episode_steps: int | None = None,
        wrist_image: bool = False,
        settle_steps: int = 10,
        image_flip: str = "rotate180",
        fast_render: bool = False,
        terminate_on_success: bool = True,
        vectorization: str = "async",
        context: str | None = "forkserver",
        gl: str | None = None,
        env_kwargs: dict[str, Any] | None = None,
    ) -> None:
        import gymnasium as gym

        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        if vectorization not in VECTORIZATION:
            raise ValueError(f"vectorization must be one of {VECTORIZATION}, got {vectorization!r}")
        tasks = load_suite(suite)
        num_tasks = tasks.get_num_tasks()
        if task_id is not None and not 0 <= task_id < num_tasks:
            raise ValueError(f"task_id must be in 0..{num_tasks - 1} for {suite}, got {task_id}")
        self.suite, self.task_id = suite, task_id
        self.instructions = [tasks.get_task(t).language for t in range(num_tasks)]
        self.num_envs = num_envs
        self.max_episode_steps = max_episode_steps or default_max_episode_steps(suite)
        self.action_shape = (7,)
        self.action_low = torch.full((7,), -1.0)
        self.action_high = torch.full((7,), 1.0)
        make = partial(
            LiberoGymEnv,
            suite=suite,
            task_id=task_id,
            image_size=image_size,
            max_episode_steps=self.max_episode_steps,
            wrist_image=wrist_image,
            settle_steps=settle_steps,
            image_flip=image_flip,
            fast_render=fast_render,
            terminate_on_success=terminate_on_success,
            gl=gl,
            num_tasks=num_tasks,
            env_kwargs=env_kwargs,
        )
        fns = [partial(make, index=i) for i in range(num_envs)]
        same_step = gym.vector.AutoresetMode.SAME_STEP
        if vectorization == "async":
            self.env = gym.vector.AsyncVectorEnv(fns, context=context, autoreset_mode=same_step)
        else:
            self.env = gym.vector.SyncVectorEnv(fns, autoreset_mode=same_step)

    # -- observations -------------------------------------------------------------------------

    def _obs(self, raw: dict[str, np.ndarray]) -> TensorDict:
        values: dict[str, Any] = {
            k: torch.as_tensor(np.asarray(v)) if k != "state" else torch.as_tensor(v, dtype=torch.float32)
            for k, v in raw.items()
            if k != "task_id"
        }
        values["instruction"] = NonTensorStack(*[self.instructions[int(t)] for t in raw["task_id"]])
        return TensorDict(values, batch_size=[self.num_envs])

    # -- EnvBatch -----------------------------------------------------------------------------

    def reset(self, seed: int | list[int]) -> TensorDict:
        seeds = [seed + i for i in range(self.num_envs)] if isinstance(seed, int) else [int(x) for x in seed]
        if len(seeds) != self.num_envs:
            raise ValueError(f"reset: {len(seeds)} seeds for {self.num_envs} envs")
        obs, _ = self.env.reset(seed=seeds)
        return self._obs(obs)

    def step(self, actions: torch.Tensor) -> Step:
        actions = actions.detach().to(torch.float32).cpu().reshape(self.num_envs, 7).numpy()
        obs, reward, terminated, truncated, info = self.env.step(actions)
        n = self.num_envs
        done = np.logical_or(terminated, truncated)
        success = np.zeros(n, dtype=np.float32)
        if "is_success" in info:
            rows = info["_is_success"]
            success[rows] = info["is_success"][rows]
        final_obs = None
        if done.any():
            final_info = info["final_info"]
            rows = final_info["_is_success"]
            success[rows] = final_info["is_success"][rows]
            final = {k: np.array(v, copy=True) for k, v in obs.items()}
            for i in np.flatnonzero(done):  # info["final_obs"]: one dict per env, set where it ended
                for key, value in info["final_obs"][i].items():
                    final[key][i] = value
            final_obs = self._obs(final)
        return Step(
            obs=self._obs(obs),
            reward=torch.as_tensor(reward, dtype=torch.float32),
            terminated=torch.as_tensor(terminated, dtype=torch.bool),
            truncated=torch.as_tensor(truncated, dtype=torch.bool),
            success=torch.as_tensor(success),
            final_obs=final_obs,
        )

    def apply(self, fn: Callable[..., Any], env_ids: Sequence[int] | None = None, *args: Any) -> list[Any]:
        """Run ``fn(libero_env, *args)`` on the LIBERO ``OffScreenRenderEnv`` of each env in
        ``env_ids`` (``None``: all), in the env's process (``fn`` must pickle: a module-level
        function); the results, ``None`` for envs not in ``env_ids``. The next ``step`` sees
        what ``fn`` changed (e.g. objects moved through ``libero_env.sim``)."""
        ids = None if env_ids is None else [int(i) for i in env_ids]
        return list(self.env.call("apply", fn, ids, *args))

    def close(self) -> None:
        if getattr(self, "env", None) is not None:
            self.env.close()
            self.env = None
