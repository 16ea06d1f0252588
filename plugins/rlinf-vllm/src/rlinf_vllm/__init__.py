"""rlinf-vllm: the vLLM rollout engine for rlinf-lightning.

Installing this package registers ``rollout="vllm"`` through the ``rlinf_lightning.plugins``
entry-point group, into the same registry as the built-in ``hf`` engine.
"""

from __future__ import annotations

__version__ = "0.1.0"


def register() -> None:
    """Entry point: add the vLLM engine to ``ROLLOUT_ENGINES`` (vLLM itself is imported lazily)."""
    from rlinf_lightning.engines.rollout import ROLLOUT_ENGINES
    from rlinf_vllm.engine import VLLMRolloutEngine

    if "vllm" not in ROLLOUT_ENGINES:
        ROLLOUT_ENGINES.register("vllm", VLLMRolloutEngine, origin="rlinf-vllm")
