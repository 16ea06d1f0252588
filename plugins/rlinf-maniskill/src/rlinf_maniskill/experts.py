"""Scripted experts on ManiSkill's privileged state, for ``rlinf demos`` (SFT and RLPD's demos).

PickCube-v1 with ``obs_mode="state"`` and ``control_mode="pd_ee_delta_pos"`` (actions: the
gripper's x, y, z move, 1 = 10 cm, and the gripper, 1 open / -1 closed). The state vector of
ManiSkill 3.0 holds, after the arm's joint positions and velocities (18), ``is_grasped`` (index
18), the gripper's pose (19-25), the goal (26-28), the cube's pose (29-35), gripper-to-cube (36-38)
and cube-to-goal (39-41) offsets.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

IS_GRASPED, TCP_TO_OBJ, OBJ_TO_GOAL = 18, slice(36, 39), slice(39, 42)


def pick_cube_expert(obs: TensorDict, gain: float = 10.0, hover: float = 0.04) -> torch.Tensor:
    """Over the cube (``hover`` above it until within 1 cm sideways), down, close, then carry the
    cube to the goal; ``gain`` times the offset, clipped to ``[-1, 1]``."""
    state = obs["state"]
    if state.shape[-1] != 42:
        why = f"PickCube's expert reads the 42-entry state (obs_mode='state'), not {state.shape[-1]}"
        raise ValueError(why)
    grasped = state[:, IS_GRASPED] > 0.5
    to_obj, to_goal = state[:, TCP_TO_OBJ].clone(), state[:, OBJ_TO_GOAL]
    sideways = to_obj[:, :2].norm(dim=-1) > 0.01
    to_obj[:, 2] += torch.where(sideways, hover, 0.0)
    reached = ~sideways & (state[:, TCP_TO_OBJ].norm(dim=-1) < 0.01)
    move = torch.where(grasped[:, None], to_goal, torch.where(reached[:, None], 0.0, to_obj))
    gripper = torch.where(grasped | reached, -1.0, 1.0)
    return torch.cat([(gain * move).clamp(-1.0, 1.0), gripper[:, None]], dim=-1)
