"""rlinf-maniskill: ManiSkill3 tasks for rlinf-lightning's env registry.

Installing this package registers ``PickCube-v1``, ``PushCube-v1`` and the other ids of
:data:`rlinf_maniskill.env.TASKS` in ``ENVS`` through the ``rlinf_lightning.plugins`` entry-point
group, so ``make_env("PickCube-v1", num_envs=8, obs_mode="rgb", image_size=64)`` returns a
:class:`~rlinf_maniskill.env.ManiSkillEnvBatch`. ManiSkill itself is imported when an env is built.
"""

from __future__ import annotations

from functools import partial

__version__ = "0.1.0"


def register() -> None:
    """Entry point: add a factory per ManiSkill3 task of ``TASKS`` to ``ENVS``."""
    from rlinf_lightning.envs import ENVS
    from rlinf_lightning.policies.pi0.demos import EXPERTS
    from rlinf_maniskill.env import TASKS, ManiSkillEnvBatch
    from rlinf_maniskill.experts import pick_cube_expert

    EXPERTS.setdefault("PickCube-v1", pick_cube_expert)  # `rlinf demos`: SFT and RLPD demonstrations

    for env_id, instruction in TASKS.items():
        if env_id not in ENVS:
            ENVS.register(
                env_id,
                partial(ManiSkillEnvBatch, env_id),
                description=f"ManiSkill3 {env_id}: {instruction}",
                origin="rlinf-maniskill",
            )
