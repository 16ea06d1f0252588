"""One LIBERO task as a gymnasium env (numpy only: this module is what each env process imports).

:class:`LiberoGymEnv` wraps LIBERO's ``OffScreenRenderEnv`` (robosuite 1.4, MuJoCo) with the
gymnasium API. It builds its simulator lazily, at the first ``reset``, so that constructing it is
cheap (gymnasium's ``AsyncVectorEnv`` builds one copy in the parent process only to read its
spaces) and robosuite, MuJoCo and the GL back end are imported in the env's own process.

- Reset: ``reset(seed=s)`` seeds the env's generator; each episode (this one and every later
  auto-reset) draws the task (when ``task_id`` is ``None``: any task of the suite) and one of the
  task's fixed initial states from it, so the sequence of episodes is a function of ``s``. The
  state is restored with LIBERO's ``set_init_state``, then ``settle_steps`` steps of "hold still,
  gripper open" let the objects come to rest (as OpenVLA's and RLinf's LIBERO evaluations do),
  without rendering.
- Observations: ``rgb`` (uint8 ``[H, W, 3]``, the agentview camera; LIBERO renders in OpenGL's
  bottom-up order, turned here by ``image_flip``), ``state`` (float32 ``[8]``: end-effector
  position, end-effector orientation as an axis-angle vector, the two gripper finger positions;
  RLinf's LIBERO state), optionally ``wrist_rgb`` (the eye-in-hand camera), and ``task_id`` (the
  episode's task, an index into the suite).
- Actions: 7 values in ``[-1, 1]``: end-effector position and orientation deltas (robosuite's
  ``OSC_POSE`` controller) and the gripper (-1 open, +1 close).
- Episodes: ``terminated`` when LIBERO's goal check (``check_success``) holds, ``truncated`` after
  ``max_episode_steps``; ``info["is_success"]``; reward 1.0 at success (LIBERO's sparse reward).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

#: OpenVLA's LIBERO evaluation horizons (the longest demonstration of each suite plus a margin).
MAX_EPISODE_STEPS: dict[str, int] = {
    "libero_spatial": 220,
    "libero_object": 280,
    "libero_goal": 300,
    "libero_10": 520,
    "libero_90": 400,
}
DEFAULT_MAX_EPISODE_STEPS = 300
IMAGE_FLIPS = ("rotate180", "vertical", "none")
STATE_DIM = 8
#: The action that holds the arm still with the gripper open (OpenVLA's "dummy action").
SETTLE_ACTION = np.array([0, 0, 0, 0, 0, 0, -1], dtype=np.float64)


def default_max_episode_steps(suite: str) -> int:
    """The horizon of ``suite`` (LIBERO-PRO and other variants take their base suite's)."""
    for base in sorted(MAX_EPISODE_STEPS, key=len, reverse=True):
        if suite == base or suite.startswith(base + "_"):
            return MAX_EPISODE_STEPS[base]
    return DEFAULT_MAX_EPISODE_STEPS


def load_suite(suite: str) -> Any:
    """LIBERO's benchmark object for ``suite`` (task order 0), without its console chatter."""
    from libero.libero import benchmark

    suites = benchmark.get_benchmark_dict()
    if suite.lower() not in suites:
        import difflib

        close = difflib.get_close_matches(suite, list(suites), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown LIBERO suite {suite!r}{hint}")
    with contextlib.redirect_stdout(io.StringIO()):
        return suites[suite.lower()](task_order_index=0)


def quat2axisangle(quat: np.ndarray) -> np.ndarray:
    """A unit quaternion ``(x, y, z, w)`` as an axis-angle vector (robosuite's convention)."""
    w = float(np.clip(quat[3], -1.0, 1.0))
    den = np.sqrt(1.0 - w * w)
    if np.isclose(den, 0.0):
        return np.zeros(3)
    return np.asarray(quat[:3]) * 2.0 * np.arccos(w) / den


def flip_image(image: np.ndarray, how: str) -> np.ndarray:
    """LIBERO's bottom-up image: ``rotate180`` (RLinf's and OpenVLA's view), ``vertical`` (the
    camera's own view), or ``none``."""
    if how == "rotate180":
        return np.ascontiguousarray(image[::-1, ::-1])
    if how == "vertical":
        return np.ascontiguousarray(image[::-1])
    return image


class LiberoGymEnv(gym.Env):
    """One env of LIBERO suite ``suite`` (see the module docstring).

    Args:
        suite: a LIBERO suite (``libero_spatial``, ``libero_object``, ``libero_goal``,
            ``libero_10``, ``libero_90``, or a LIBERO-PRO suite such as ``libero_spatial_lan``).
        task_id: the task (index into the suite), or ``None``: each episode draws one.
        image_size: camera resolution, an int (square) or ``(height, width)``.
        max_episode_steps: time limit; ``None``: the suite's (:data:`MAX_EPISODE_STEPS`).
        wrist_image: add ``wrist_rgb`` (renders a second camera: about half as fast).
        settle_steps: steps of :data:`SETTLE_ACTION` after restoring an initial state.
        image_flip: one of :data:`IMAGE_FLIPS`.
        fast_render: turn off MuJoCo's reflections and shadows: about twice as fast on a CPU
            renderer, but the images no longer look like LIBERO's.
        terminate_on_success: end the episode at success (else only the time limit ends it).
        gl: ``MUJOCO_GL`` for this process (``egl`` or ``osmesa``); ``None``: the environment's
            ``MUJOCO_GL``, else ``egl``. Takes effect where robosuite is not imported yet.
        index: this env's index in a vector env (for :meth:`apply`).
        env_kwargs: more keyword arguments of LIBERO's ``OffScreenRenderEnv``.
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(
        self,
        suite: str = "libero_spatial",
        task_id: int | None = 0,
        image_size: int | tuple[int, int] = 128,
        max_episode_steps: int | None = None,
        wrist_image: bool = False,
        settle_steps: int = 10,
        image_flip: str = "rotate180",
        fast_render: bool = False,
        terminate_on_success: bool = True,
        gl: str | None = None,
        index: int = 0,
        num_tasks: int | None = None,
        env_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if image_flip not in IMAGE_FLIPS:
            raise ValueError(f"image_flip must be one of {IMAGE_FLIPS}, got {image_flip!r}")
        self.suite, self.task_id, self.index = suite, task_id, index
        self.height, self.width = (image_size, image_size) if isinstance(image_size, int) else image_size
        self.max_episode_steps = max_episode_steps or default_max_episode_steps(suite)
        self.wrist_image, self.settle_steps, self.image_flip = wrist_image, settle_steps, image_flip
        self.fast_render, self.terminate_on_success, self.gl = fast_render, terminate_on_success, gl
        self.env_kwargs = dict(env_kwargs or {})
        self.num_tasks = num_tasks if num_tasks is not None else load_suite(suite).get_num_tasks()
        image = spaces.Box(0, 255, (self.height, self.width, 3), np.uint8)
        obs = {
            "rgb": image,
            "state": spaces.Box(-np.inf, np.inf, (STATE_DIM,), np.float32),
            "task_id": spaces.Box(0, max(self.num_tasks - 1, 0), (), np.int64),
        }
        if wrist_image:
            obs["wrist_rgb"] = image
        self.observation_space = spaces.Dict(obs)
        self.action_space = spaces.Box(-1.0, 1.0, (7,), np.float32)
        self.env: Any = None  # LIBERO's OffScreenRenderEnv, built at the first reset
        self._suite: Any = None
        self._init_states: dict[int, np.ndarray] = {}
        self.current_task: int | None = None
        self.init_state_id: int | None = None
        self.elapsed_steps = 0

    # -- the simulator ------------------------------------------------------------------------

    def _build(self, task: int) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None
        if self.gl:
            os.environ["MUJOCO_GL"] = self.gl
        else:
            os.environ.setdefault("MUJOCO_GL", "egl")
        # robosuite warns at import that it has no private macro file: not useful here
        logging.getLogger("robosuite_logs").addFilter(lambda r: "macro" not in r.getMessage())
        from pathlib import Path

        from libero.libero import get_libero_path
        from libero.libero.envs import OffScreenRenderEnv

        if self._suite is None:
            self._suite = load_suite(self.suite)
        info = self._suite.get_task(task)
        cameras = ["agentview"] + (["robot0_eye_in_hand"] if self.wrist_image else [])
        kwargs = dict(
            bddl_file_name=str(Path(get_libero_path("bddl_files")) / info.problem_folder / info.bddl_file),
            camera_heights=self.height,
            camera_widths=self.width,
            camera_names=cameras,
            ignore_done=True,  # the time limit is counted here, without the settling steps
            hard_reset=False,  # every episode restores a full state: no need to rebuild the model
        )
        kwargs.update(self.env_kwargs)
        self.env = OffScreenRenderEnv(**kwargs)
        if self.fast_render:
            import mujoco

            scene = self.env.sim._render_context_offscreen.scn
            scene.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = 0
            scene.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = 0
        self._cameras = [f"{c}_image" for c in cameras]
        self.current_task = task

    def init_states(self, task: int) -> np.ndarray:
        """The fixed initial states of ``task`` (LIBERO's, 50 per task in the standard suites)."""
        if task not in self._init_states:
            if self._suite is None:
                self._suite = load_suite(self.suite)
            self._init_states[task] = np.asarray(self._suite.get_task_init_states(task))
        return self._init_states[task]

    def _observe(self, raw: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        state = np.concatenate(
            [raw["robot0_eef_pos"], quat2axisangle(raw["robot0_eef_quat"]), raw["robot0_gripper_qpos"]]
        )
        obs = {
            "rgb": flip_image(raw["agentview_image"], self.image_flip),
            "state": state.astype(np.float32),
            "task_id": np.asarray(self.current_task, dtype=np.int64),
        }
        if self.wrist_image:
            obs["wrist_rgb"] = flip_image(raw["robot0_eye_in_hand_image"], self.image_flip)
        return obs

    @contextlib.contextmanager
    def _cameras_off(self):
        """Steps and resets inside skip the camera renders (the bulk of a step's time)."""
        inner = self.env.env
        for name in self._cameras:
            inner.modify_observable(name, "enabled", False)
        try:
            yield
        finally:
            for name in self._cameras:
                inner.modify_observable(name, "enabled", True)

    def _restart_controllers(self) -> None:
        """robosuite's soft reset keeps two pieces of the last episode: the gripper's commanded
        opening (the Panda gripper integrates its actions) and the arm controller's goal orientation
        (a zero rotation delta keeps the old goal). Both restart from the restored state, so an
        episode depends on its seed only, not on how the env's previous episode ended."""
        for robot in self.env.env.robots:
            grippers = robot.gripper.values() if isinstance(robot.gripper, dict) else [robot.gripper]
            for gripper in grippers:
                gripper.current_action = np.zeros(gripper.dof)
            controller = robot.controller
            controllers = controller.values() if isinstance(controller, dict) else [controller]
            for controller in controllers:
                controller.update(force=True)
                controller.reset_goal()

    # -- gymnasium ----------------------------------------------------------------------------

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        options = options or {}
        task = options.get("task_id", self.task_id)
        if task is None:
            task = int(self.np_random.integers(self.num_tasks))
        states = self.init_states(task)
        state_id = options.get("init_state_id")
        if state_id is None:
            state_id = int(self.np_random.integers(len(states)))
        sim_seed = int(self.np_random.integers(2**31))
        if self.env is None or task != self.current_task:
            self._build(task)
        self.env.seed(sim_seed)  # LIBERO seeds numpy's global generator (robosuite's placements)
        with self._cameras_off():
            self.env.reset()
            self.env.set_init_state(states[state_id])
            self._restart_controllers()
            for _ in range(self.settle_steps):
                self.env.step(SETTLE_ACTION)
        raw = self.env.env._get_observations(force_update=True)
        self.init_state_id, self.elapsed_steps = state_id, 0
        return self._observe(raw), {"task_id": task, "init_state_id": state_id}

    def step(self, action: np.ndarray):
        action = np.clip(np.asarray(action, dtype=np.float64).reshape(7), -1.0, 1.0)
        raw, reward, done, _ = self.env.step(action)
        self.elapsed_steps += 1
        success = bool(done)  # LIBERO's step returns its goal check as `done`
        terminated = success and self.terminate_on_success
        truncated = not terminated and self.elapsed_steps >= self.max_episode_steps
        return self._observe(raw), float(reward), terminated, truncated, {"is_success": success}

    def apply(self, fn: Callable[..., Any], env_ids: Sequence[int] | None = None, *args: Any) -> Any:
        """``fn(libero_env, *args)`` where this env's index is in ``env_ids`` (``None``: all);
        through a vector env's ``call``, it runs in the env's own process."""
        if env_ids is not None and self.index not in env_ids:
            return None
        return fn(self.env, *args)

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None
