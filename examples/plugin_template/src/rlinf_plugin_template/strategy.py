"""A strategy turns a workflow into an execution plan; subclassing a built-in is the short way."""

from __future__ import annotations

from rlinf_lightning.strategies import CollocatedStrategy


class SingleWorkerStrategy(CollocatedStrategy):
    """Every stage on one worker spanning every slot: the baseline the other plans must beat."""

    name = "single_worker"

    def __init__(self) -> None:
        super().__init__(replicas=1)
