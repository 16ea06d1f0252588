"""ReplayBuffer: the transitions an off-policy learner samples from, held in one preallocated
TensorDict ring.

A transition is ``obs``, ``action``, ``reward``, ``next_obs``, ``terminated`` (and ``truncated``,
kept for inspection): ``next_obs`` is the observation the step led to, the episode's *final*
observation where the step ended it (never the reset observation that follows), and only
``terminated`` stops the bootstrap, so a time limit is not mistaken for the end of the task.

The storage is allocated at the first write from its rows' shapes, ``capacity`` rows, and written
round the ring, the oldest rows replaced first; its size is known before the run starts
(:func:`transition_bytes` x capacity, counted in the plan's memory check). Sampling is uniform
with replacement over the rows written, from a generator the caller seeds, so a learner that seeds
it by update draws the same rows under every plan. :meth:`state_dict` holds the rows written and
the write position: a resumed run samples exactly what the uninterrupted one would.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

#: what a transition holds (``obs`` and ``next_obs`` are TensorDicts of the env's entries)
TRANSITION_KEYS = ("obs", "action", "reward", "next_obs", "terminated", "truncated")


def transition_bytes(obs: TensorDict, action_numel: int) -> int:
    """Bytes of one stored transition: two observations like ``obs`` (one row of it), a float32
    action of ``action_numel`` entries, a float32 reward and two bool flags."""
    one = sum(t[0].numel() * t.element_size() for t in obs.values(include_nested=True, leaves_only=True))
    return 2 * one + 4 * action_numel + 4 + 2


class ReplayBuffer:
    """A ring of at most ``capacity`` transitions (see the module's docstring)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.storage: TensorDict | None = None
        self.position = 0  # the next row written
        self.size = 0  # rows holding a transition

    def __len__(self) -> int:
        return self.size

    def add(self, transitions: TensorDict) -> None:
        """Write ``transitions`` (batch ``[N]``) in order, replacing the oldest rows once full."""
        n = transitions.batch_size[0]
        if self.storage is None:
            self.storage = transitions[:1].expand(self.capacity).clone().zero_()
        if n > self.capacity:  # only the newest capacity rows survive
            transitions, n = transitions[n - self.capacity :], self.capacity
        rows = (self.position + torch.arange(n)) % self.capacity
        self.storage[rows] = transitions
        self.position = (self.position + n) % self.capacity
        self.size = min(self.size + n, self.capacity)

    def sample(self, batch_size: int, generator: torch.Generator) -> TensorDict:
        """``batch_size`` transitions drawn uniformly, with replacement, from the rows written."""
        if self.storage is None or self.size == 0:
            raise RuntimeError("sampling an empty replay buffer")
        return self.storage[torch.randint(self.size, (batch_size,), generator=generator)]

    def state_dict(self) -> dict[str, Any]:
        """The rows written (plain tensors, by flattened key) and the write position. The rows are
        copied out: a slice is a view, and ``torch.save`` writes a view's whole storage, so a
        checkpoint would hold every preallocated row (the capacity) however few were written."""
        rows = {} if self.storage is None else self.storage[: self.size].flatten_keys(".").clone().to_dict()
        return {"capacity": self.capacity, "position": self.position, "size": self.size, "rows": rows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["capacity"] != self.capacity:
            raise ValueError(
                f"the checkpoint's replay buffer holds {state['capacity']} transitions, this run's "
                f"{self.capacity} (keep trainer.algorithm.buffer_capacity to resume)"
            )
        self.storage, self.position, self.size = None, 0, 0
        if state["size"]:
            rows = TensorDict(state["rows"], batch_size=[state["size"]]).unflatten_keys(".")
            self.add(rows)
            self.position = state["position"]
