"""Demonstrations for π0's supervised fine-tuning: the local format, and a scripted FetchReach expert.

**Format** (one ``safetensors`` file; nothing in it is unpickled). Row ``i`` is one observation and
the chunk of actions the demonstrator took from it on:

- ``obs.<key>``: the observation entries as the env gives them (``obs.observation`` float32
  ``[N, 10]``, ``obs.rgb`` uint8 ``[N, H, W, 3]``, ...), under their ``EnvBatch`` names;
- ``action``: float32 ``[N, chunk, action_dim]``: the actions at steps ``t .. t + chunk - 1``;
- ``action_mask``: bool ``[N, chunk]``: False past the episode's end (those actions are zeros);
- ``episode``: int64 ``[N]``, the episode each row comes from;
- ``reward``, ``terminated``, ``truncated`` (``[N]``) and ``next_obs.<key>``: the step's outcome
  (the episode's own last observation where it ended), so an off-policy learner replays the same
  file as transitions (``workflows.offpolicy.demos``);
- metadata (strings): ``instruction``, ``env``, and ``image_keys`` / ``state_keys`` (JSON lists:
  which ``obs.*`` entries are cameras and which make π0's state).

Write one with :func:`record_demos` (any env batch and any expert ``obs -> action``) or from the
command line: ``rlinf demos --env FetchReachDense-v4 --episodes 64 --out
data/fetchreach_demos.safetensors``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDict

if TYPE_CHECKING:
    from rlinf_lightning.envs import EnvBatch


def fetch_reach_expert(obs: TensorDict, gain: float = 10.0) -> torch.Tensor:
    """FetchReach's scripted expert: move the gripper (``observation[:3]``) straight to the goal
    (``desired_goal``), ``gain`` times the offset, clipped to ``[-1, 1]``; the gripper stays. It
    reaches every goal of 32 held-out episodes."""
    action = torch.zeros(obs.batch_size[0], 4)
    action[:, :3] = (gain * (obs["desired_goal"] - obs["observation"][:, :3])).clamp(-1.0, 1.0)
    return action


EXPERTS: dict[str, Callable[[TensorDict], torch.Tensor]] = {
    "FetchReach-v4": fetch_reach_expert,
    "FetchReachDense-v4": fetch_reach_expert,
}


def record_demos(
    batch: EnvBatch,
    expert: Callable[[TensorDict], torch.Tensor],
    chunk: int,
    path: str | Path,
    seed: int = 0,
    instruction: str = "reach the goal",
    state_keys: tuple[str, ...] | None = None,
    image_keys: tuple[str, ...] = (),
    env: str = "",
) -> dict[str, Any]:
    """Run ``expert`` for one episode in each env of ``batch`` (reset with ``seed + i``; closed
    after) and write every step with its next ``chunk`` actions to ``path`` (the format above;
    ``env`` names the env in its metadata); returns the expert's success rate and the rows.
    ``state_keys`` (the metadata's, what π0 reads as its state) default to a goal env's
    ``observation`` and ``desired_goal`` (gymnasium-robotics' Fetch tasks), else to every entry
    that is not an image (ManiSkill's ``state``)."""
    from safetensors.torch import save_file

    episodes = batch.num_envs
    try:
        obs = batch.reset(seed)
        steps = batch.max_episode_steps or 50
        observations, actions, success = [], [], torch.zeros(episodes)
        replay: dict[str, list] = {"reward": [], "terminated": [], "truncated": [], "next_obs": []}
        for _ in range(steps):
            action = expert(obs)
            observations.append(obs.exclude("instruction") if "instruction" in obs.keys() else obs)
            actions.append(action)
            step = batch.step(action)
            ended = step.terminated | step.truncated
            success[ended] = step.success[ended].nan_to_num(0.0)
            next_obs = step.obs.clone()  # an ended episode's own last observation, not the reset one
            if bool(ended.any()):
                next_obs[ended] = step.final_obs[ended]
            for key, value in (
                ("reward", step.reward),
                ("terminated", step.terminated),
                ("truncated", step.truncated & ~step.terminated),
                ("next_obs", next_obs),
            ):
                replay[key].append(value)  # fmt: skip
            obs = step.obs
            if bool(ended.all()):
                break
    finally:
        batch.close()
    obs_seq = torch.stack(observations, dim=1)  # [episodes, T]
    acts = torch.stack(actions, dim=1)  # [episodes, T, A]
    n, length = acts.shape[:2]
    padded = torch.cat([acts, torch.zeros(n, chunk, acts.shape[-1])], dim=1)
    index = torch.arange(length)[:, None] + torch.arange(chunk)  # [T, chunk]
    tensors = {f"obs.{k}": v.reshape(n * length, *v.shape[2:]).contiguous() for k, v in obs_seq.items()}
    tensors["action"] = padded[:, index].reshape(n * length, chunk, -1).contiguous()
    tensors["action_mask"] = (index < length).expand(n, length, chunk).reshape(n * length, chunk).contiguous()
    tensors["episode"] = torch.arange(n).repeat_interleave(length)
    for key in ("reward", "terminated", "truncated"):  # what an off-policy learner replays
        tensors[key] = torch.stack(replay[key], dim=1).reshape(n * length).contiguous()
    next_seq = torch.stack(replay["next_obs"], dim=1)
    next_seq = next_seq.exclude("instruction") if "instruction" in next_seq.keys() else next_seq
    tensors |= {
        f"next_obs.{k}": v.reshape(n * length, *v.shape[2:]).contiguous() for k, v in next_seq.items()
    }
    if state_keys is None:
        goal_env = [k for k in ("observation", "desired_goal") if k in obs_seq.keys()]
        state_keys = goal_env or [k for k in sorted(obs_seq.keys()) if k not in image_keys]
    meta = {"instruction": instruction, "env": env, "state_keys": json.dumps(list(state_keys)),
            "image_keys": json.dumps(list(image_keys))}  # fmt: skip
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=meta)
    return {"expert_success": float(success.mean()), "rows": n * length, "episodes": n}


def load_demos(path: str | Path) -> tuple[TensorDict, dict[str, str]]:
    """A demo file as a ``TensorDict`` of batch ``[N]`` (``obs`` a nested one, ``action``,
    ``action_mask``, ``episode``) and its metadata; :class:`DataError` naming the file and what
    in it does not follow the format (the module docstring)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from rlinf_lightning.errors import DataError

    try:
        with safe_open(str(path), "pt") as f:
            meta = dict(f.metadata() or {})
        tensors = load_file(str(path))
    except Exception as exc:  # noqa: BLE001 (safetensors raises its own error types)
        raise DataError(
            f"{path}: not a readable safetensors file ({exc}); write it with rlinf demos"
        ) from None
    missing = [k for k in ("action", "action_mask", "episode") if k not in tensors]
    if missing:
        raise DataError(f"{path}: not a demonstration file (no {', '.join(missing)}; rlinf demos writes one)")
    if why := _format_problem(tensors, meta):
        raise DataError(f"{path}: {why}")
    n = tensors["action"].shape[0]
    obs = TensorDict({k[4:]: v for k, v in tensors.items() if k.startswith("obs.")}, batch_size=[n])
    rest = {k: tensors[k] for k in ("action", "action_mask", "episode")}
    return TensorDict({"obs": obs, **rest}, batch_size=[n]), meta


def _format_problem(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> str | None:
    """What in a demonstration file's tensors and metadata breaks the format, or ``None``."""
    action, mask = tensors["action"], tensors["action_mask"]
    if action.dim() != 3 or not action.is_floating_point():
        return f"action must be float [N, chunk, action_dim], got {action.dtype} {list(action.shape)}"
    n, chunk = action.shape[:2]
    if mask.dtype != torch.bool or list(mask.shape) != [n, chunk]:
        return f"action_mask must be bool [{n}, {chunk}] (N, chunk), got {mask.dtype} {list(mask.shape)}"
    if list(tensors["episode"].shape) != [n]:
        return f"episode must be [{n}], got {list(tensors['episode'].shape)}"
    obs = {k[4:]: v for k, v in tensors.items() if k.startswith("obs.")}
    if not obs:
        return "no observation entries (obs.<key>)"
    if bad := [k for k, v in obs.items() if v.dim() == 0 or v.shape[0] != n]:
        return f"obs.{bad[0]} has {list(obs[bad[0]].shape)}, not {n} rows like action"
    for key in ("image_keys", "state_keys"):
        try:
            names = json.loads(meta.get(key, "[]" if key == "image_keys" else '["state"]'))
        except ValueError:
            return f"metadata {key} is not a JSON list: {meta[key]!r}"
        if not isinstance(names, list) or any(k not in obs for k in names):
            return f"metadata {key} names {names!r}, but the observation entries are {sorted(obs)}"
    return None
