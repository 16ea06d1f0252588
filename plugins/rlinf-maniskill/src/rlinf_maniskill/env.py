"""ManiSkill3 tasks as an :class:`~rlinf_lightning.envs.base.EnvBatch`.

Each simulator is ``gym.make(env_id, ...)`` wrapped in ManiSkill's own ``ManiSkillVectorEnv``
(torch tensors in and out, same-step auto-reset with the ended episode's last observation in
``info["final_observation"]`` and its info in ``info["final_info"]``). Where it runs:

- CPU simulation (``sim_backend="cpu"``, the default without CUDA): ManiSkill's CPU backend holds
  one env per simulator, so ``num_envs`` simulators of batch 1 are stepped one after the other in
  this process (as gymnasium's sync vector env would; parallelism comes from the library's env
  replicas, each its own process or thread).
- GPU simulation (``sim_backend="gpu"``, the default when ``torch.cuda.is_available()``): one
  simulator holds all ``num_envs`` envs (PhysX GPU, rendering on the GPU), partial resets by index.

Observations are a ``TensorDict`` of batch ``[num_envs]``, on the CPU whatever the backend:

- ``obs_mode="state"``: ``state``, ManiSkill's flat float32 state vector (robot, objects, goal).
- ``obs_mode="rgb"``: ``rgb``, uint8 ``[H, W, 3]`` from the task's default camera (or ``camera``),
  ``image_size`` square (or ``(height, width)``); ``state``, float32 proprioception plus the
  task's extras as ManiSkill gives them with images (joint positions and velocities, TCP pose, goal
  position, ...: e.g. PickCube's goal is hidden from the camera and only here); ``instruction``, one
  string per env describing the task.

Episodes end by ``terminated`` (ManiSkill ends an episode at success, or failure where a task
defines one) or ``truncated`` (ManiSkill's time limit, ``max_episode_steps``), kept apart.
``success`` is ManiSkill's ``info["success"]`` as 0.0 / 1.0 (for an ended episode: at its last
step). Actions are continuous in ``[-1, 1]`` in the task's default controller (Panda:
``pd_joint_delta_pos``, 8 dimensions: 7 joint deltas and the gripper) unless ``control_mode`` names
another (e.g. ``"pd_ee_delta_pose"``: 6 end-effector deltas and the gripper, 7 dimensions).

Reset by seed: ``reset(seed)`` seeds env ``i`` with ``seed + i`` (``reset([s_0, s_1, ...])``: env
``i`` with ``s_i``; envs given equal seeds start from the same state, as a GRPO group needs), and
the simulators are built with ``enhanced_determinism=True``, so every later auto-reset draws its
episode from the env's own seeded generator, not from the process's global torch RNG: the whole
sequence of episodes is a function of the seeds. (With GPU simulation ManiSkill draws the batch's
initial states from one torch generator seeded by the first seed, so there the batch as a whole is
a function of the seeds, and envs with equal seeds get the first one's state copied in.)
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import NonTensorStack, TensorDict

from rlinf_lightning.envs.base import EnvBatch, Step

#: Registered ManiSkill3 ids and a short description of each task (the ``instruction`` entry).
TASKS: dict[str, str] = {
    "PickCube-v1": "pick up the red cube and move it to the goal position",
    "PushCube-v1": "push the blue cube to the red and white target",
    "PullCube-v1": "pull the blue cube back onto the red and white target",
    "StackCube-v1": "pick up the red cube and stack it on top of the green cube",
    "LiftPegUpright-v1": "lift the peg lying on the table to an upright position",
    "PokeCube-v1": "use the blue peg to push the red cube to the goal",
    "PlaceSphere-v1": "place the sphere into the shallow bin",
}

OBS_MODES = ("state", "rgb")


def _flat(tree: dict[str, Any], n: int) -> torch.Tensor:
    """The leaves of a nested dict of batched tensors, flattened and concatenated (float32)."""
    parts: list[torch.Tensor] = []
    for value in tree.values():
        if isinstance(value, dict):
            if value:
                parts.append(_flat(value, n))
        else:
            parts.append(torch.as_tensor(value).reshape(n, -1).to(torch.float32))
    return torch.cat(parts, dim=1) if parts else torch.zeros(n, 0)


class ManiSkillEnvBatch(EnvBatch):
    """``num_envs`` envs of the ManiSkill3 task ``env_id`` (see the module docstring).

    Args:
        env_id: a ManiSkill3 id, e.g. ``"PickCube-v1"``.
        num_envs: how many envs.
        obs_mode: ``"state"`` or ``"rgb"``.
        image_size: the camera's resolution in ``"rgb"`` mode: an int (square) or ``(height,
            width)``; ``None`` keeps the task's (128 x 128 for the tabletop tasks).
        camera: the sensor whose image is ``rgb`` (default: the task's first camera).
        control_mode: ManiSkill controller (default: the task's, ``pd_joint_delta_pos`` for Panda).
        reward_mode: ManiSkill reward (default: the task's first, ``normalized_dense``).
        sim_backend: ``"cpu"``, ``"gpu"`` (or another ManiSkill backend, e.g. ``"cuda:1"``) or
            ``"auto"`` (gpu when CUDA is available).
        render_backend: SAPIEN renderer; default ``"none"`` for state observations without a
            ``render_mode``, else ``"cpu"`` (llvmpipe) with CPU simulation and ``"gpu"`` with GPU.
        max_episode_steps: override the task's time limit (PickCube-v1: 50).
        instruction: the ``instruction`` entry: ``None`` adds the task's description in ``"rgb"``
            mode only, ``True`` in both modes, ``False`` never; a string replaces the description.
        kwargs: more keyword arguments of ``gym.make`` (e.g. ``robot_uids``, ``sim_config``,
            ``render_mode``).
    """

    def __init__(
        self,
        env_id: str,
        num_envs: int,
        obs_mode: str = "state",
        image_size: int | tuple[int, int] | None = None,
        camera: str | None = None,
        control_mode: str | None = None,
        reward_mode: str | None = None,
        sim_backend: str = "auto",
        render_backend: str | None = None,
        max_episode_steps: int | None = None,
        instruction: str | bool | None = None,
        **kwargs: Any,
    ) -> None:
        import gymnasium as gym
        import mani_skill.envs  # noqa: F401  (registers the ManiSkill ids with gymnasium)
        from mani_skill.vector.wrappers.gymnasium import ManiSkillVectorEnv

        if obs_mode not in OBS_MODES:
            raise ValueError(f"obs_mode must be one of {OBS_MODES}, got {obs_mode!r}")
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        if sim_backend == "auto":
            sim_backend = "gpu" if torch.cuda.is_available() else "cpu"
        gpu = sim_backend not in ("cpu", "physx_cpu")  # ManiSkill also takes "physx_cuda", "cuda:1"
        if render_backend is None:
            if obs_mode == "state" and kwargs.get("render_mode") is None:
                render_backend = "none"
            else:
                render_backend = "gpu" if gpu else "cpu"
        make_kwargs: dict[str, Any] = dict(
            obs_mode=obs_mode,
            sim_backend=sim_backend,
            render_backend=render_backend,
            enhanced_determinism=True,
            **kwargs,
        )
        if control_mode is not None:
            make_kwargs["control_mode"] = control_mode
        if reward_mode is not None:
            make_kwargs["reward_mode"] = reward_mode
        if max_episode_steps is not None:
            make_kwargs["max_episode_steps"] = max_episode_steps
        if image_size is not None and obs_mode == "rgb":
            h, w = (image_size, image_size) if isinstance(image_size, int) else image_size
            make_kwargs["sensor_configs"] = {**make_kwargs.get("sensor_configs", {}), "height": h, "width": w}

        self.env_id, self.obs_mode, self.camera = env_id, obs_mode, camera
        self.num_envs = num_envs
        self.gpu = gpu
        # CPU: one simulator per env; GPU: one simulator with every env
        sizes = [num_envs] if gpu else [1] * num_envs
        self.shards: list[Any] = []
        try:
            for size in sizes:
                env = gym.make(env_id, num_envs=size, **make_kwargs)
                self.shards.append(ManiSkillVectorEnv(env, auto_reset=True, ignore_terminations=False))
        except Exception:
            self.close()
            raise
        self._bounds = [(sum(sizes[:k]), sum(sizes[: k + 1])) for k in range(len(sizes))]
        first = self.shards[0]
        self.device = first.device
        space = first.single_action_space
        if not isinstance(space, gym.spaces.Box):
            raise ValueError(
                f"env {env_id!r}: only continuous (Box) action spaces are supported, got {space}"
            )
        self.action_shape = tuple(space.shape)
        self.action_low = torch.as_tensor(space.low, dtype=torch.float32)
        self.action_high = torch.as_tensor(space.high, dtype=torch.float32)
        self.control_mode = first.base_env.control_mode
        self.max_episode_steps = self._time_limit(first)
        if instruction is False or (instruction is None and obs_mode == "state"):
            self.instruction: str | None = None
        elif isinstance(instruction, str):
            self.instruction = instruction
        else:
            self.instruction = TASKS.get(env_id, env_id)

    @staticmethod
    def _time_limit(venv: Any) -> int | None:
        env = venv._env
        while env is not None:
            limit = getattr(env, "_max_episode_steps", None)
            if limit is not None:
                return int(limit)
            env = getattr(env, "env", None)
        spec = venv.spec
        return spec.max_episode_steps if spec is not None else None

    # -- observations ---------------------------------------------------------------------------

    def _entries(self, raw: Any, n: int) -> dict[str, torch.Tensor]:
        if self.obs_mode == "state":
            return {"state": torch.as_tensor(raw).reshape(n, -1).to(torch.float32).cpu()}
        sensors = raw["sensor_data"]
        camera = self.camera or next(iter(sensors))
        return {
            "rgb": sensors[camera]["rgb"].to(torch.uint8).cpu(),
            "state": _flat({"agent": raw["agent"], "extra": raw["extra"]}, n).cpu(),
        }

    def _obs(self, parts: list[dict[str, torch.Tensor]]) -> TensorDict:
        keys = parts[0].keys()
        values: dict[str, Any] = {
            k: torch.cat([p[k] for p in parts]) if len(parts) > 1 else parts[0][k] for k in keys
        }
        if self.instruction is not None:
            values["instruction"] = NonTensorStack(*([self.instruction] * self.num_envs))
        return TensorDict(values, batch_size=[self.num_envs])

    # -- EnvBatch -------------------------------------------------------------------------------

    def reset(self, seed: int | list[int]) -> TensorDict:
        seeds = [seed + i for i in range(self.num_envs)] if isinstance(seed, int) else [int(x) for x in seed]
        if len(seeds) != self.num_envs:
            raise ValueError(f"reset: {len(seeds)} seeds for {self.num_envs} envs")
        parts = []
        for venv, (lo, hi) in zip(self.shards, self._bounds):
            mine = seeds[lo:hi]
            if self.gpu:
                obs, _ = venv.reset(seed=mine)
                # ManiSkill draws a GPU batch's initial states from one torch generator (seeded by
                # the first seed), so envs given equal seeds (a GRPO group) get the state of the
                # first env with that seed copied in
                src = [mine.index(x) for x in mine]
                if src != list(range(len(mine))):
                    obs = copy_states(venv, src)
            else:
                obs, _ = venv.reset(seed=mine[0])
            parts.append(self._entries(obs, hi - lo))
        return self._obs(parts)

    def step(self, actions: torch.Tensor) -> Step:
        actions = actions.detach().to(torch.float32).reshape(self.num_envs, *self.action_shape)
        parts, final_parts = [], []
        rewards, terminated, truncated, success = [], [], [], []
        for venv, (lo, hi) in zip(self.shards, self._bounds):
            n = hi - lo
            obs, reward, term, trunc, info = venv.step(actions[lo:hi].to(self.device))
            term = torch.as_tensor(term).reshape(n).bool()
            trunc = torch.as_tensor(trunc).reshape(n).bool()
            ended = term | trunc
            entries = self._entries(obs, n)
            parts.append(entries)
            if bool(ended.any()):
                last = self._entries(info["final_observation"], n)
                rows = ended.cpu()
                final_parts.append({k: torch.where(_rows(rows, v), last[k], v) for k, v in entries.items()})
                info = info["final_info"]  # the ended episodes' last info; others' rows are current
            else:
                final_parts.append(entries)
            if "success" in info:
                success.append(torch.as_tensor(info["success"]).reshape(n).to(torch.float32).cpu())
            else:
                success.append(torch.full((n,), float("nan")))
            rewards.append(torch.as_tensor(reward).reshape(n).to(torch.float32).cpu())
            terminated.append(term.cpu())
            truncated.append(trunc.cpu())
        terminated_t, truncated_t = torch.cat(terminated), torch.cat(truncated)
        done = terminated_t | truncated_t
        return Step(
            obs=self._obs(parts),
            reward=torch.cat(rewards),
            terminated=terminated_t,
            truncated=truncated_t,
            success=torch.cat(success),
            final_obs=self._obs(final_parts) if bool(done.any()) else None,
        )

    def close(self) -> None:
        for venv in self.shards:
            venv.close()
        self.shards = []


def copy_states(venv: Any, src: list[int]) -> Any:
    """Set env ``i`` of one ManiSkill simulator to env ``src[i]``'s state (task state included,
    through ManiSkill's ``reset_to_env_states``); the new observations."""
    index = torch.as_tensor(src, device=venv.device)

    def pick(tree: Any) -> Any:
        return {k: pick(v) for k, v in tree.items()} if isinstance(tree, dict) else tree[index]

    states = pick(venv.base_env.get_state_dict())
    obs, _ = venv.reset(options={"reset_to_env_states": {"env_states": states}})
    return obs


def _rows(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``mask`` ``[n]`` broadcastable against ``like`` ``[n, ...]``."""
    return mask.reshape(-1, *([1] * (like.dim() - 1)))
