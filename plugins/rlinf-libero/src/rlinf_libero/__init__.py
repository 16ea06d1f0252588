"""rlinf-libero: LIBERO suites for rlinf-lightning's env registry.

Installing this package registers ``libero`` (the suite is a keyword, ``suite="libero_spatial"`` by
default) and one name per standard suite (``libero_spatial``, ``libero_object``, ``libero_goal``,
``libero_10``, ``libero_90``) in ``ENVS`` through the ``rlinf_lightning.plugins`` entry-point
group, so ``make_env("libero", num_envs=8, suite="libero_spatial", task_id=0, image_size=128)`` (or
``make_env("libero_spatial", num_envs=8, task_id=0)``) returns a
:class:`~rlinf_libero.env.LiberoEnvBatch`. LIBERO itself is imported when an env is built.
"""

from __future__ import annotations

from functools import partial

__version__ = "0.1.0"

#: The standard LIBERO suites, each also registered under its own name.
SUITES: dict[str, str] = {
    "libero_spatial": "10 tasks: the same objects, the bowl to pick told apart by its place",
    "libero_object": "10 tasks: pick a named grocery item and place it in the basket",
    "libero_goal": "10 tasks: one scene, different goals",
    "libero_10": "10 long-horizon tasks (LIBERO-Long)",
    "libero_90": "90 short tasks (LIBERO-90)",
}


def register() -> None:
    """Entry point: add ``libero`` and a factory per suite of :data:`SUITES` to ``ENVS``."""
    from rlinf_libero.env import LiberoEnvBatch
    from rlinf_lightning.envs import ENVS

    if "libero" not in ENVS:
        ENVS.register(
            "libero",
            LiberoEnvBatch,
            description="LIBERO (robosuite, MuJoCo): suite=, task_id=, image_size=; one process per env",
            origin="rlinf-libero",
        )
    for suite, text in SUITES.items():
        if suite not in ENVS:
            ENVS.register(
                suite,
                partial(LiberoEnvBatch, suite=suite),
                description=f"LIBERO {suite}: {text}",
                origin="rlinf-libero",
            )
