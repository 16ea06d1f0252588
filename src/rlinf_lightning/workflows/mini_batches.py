"""The optimizer steps of several updates per rollout batch: which samples each step trains on.

A learning stage that keeps its share of the rollout batch (the actor with ``ppo_epochs`` /
``num_mini_batches``; the critic of token-level PPO) takes ``epochs`` passes of ``per_pass``
optimizer steps over it. A mini-batch is a set of whole prompt groups, chosen by a permutation of
the iteration's group positions seeded by seed, iteration and epoch, so every replica of a
data-parallel group, under every plan, agrees on which of its samples belong to which step
without exchanging them; each step then divides by its own count summed over the replicas.

How many mini-batches a batch may be cut into is checked before anything loads
(:func:`split_problem`): a step on fewer than :data:`MIN_SAMPLES_PER_MINI_BATCH` samples is a
degenerate update (one optimizer step per sample: the iteration's actor time grows by the number of
steps while each step's loss, its advantages normalised over almost nothing, carries no signal).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from tensordict import TensorDict

from rlinf_lightning.seeds import row_seed

#: the fewest samples an optimizer step of several updates per batch may train on
MIN_SAMPLES_PER_MINI_BATCH = 2


def split_problem(key: str, count: int, samples: int, yielded_by: str) -> tuple[str, str] | None:
    """``(key, problem)`` when cutting ``samples`` (one rollout batch, ``yielded_by`` says how it
    is made, e.g. ``task.num_envs=4 x task.steps=128``) into ``count`` mini-batches leaves fewer
    than :data:`MIN_SAMPLES_PER_MINI_BATCH` samples in one, with the arithmetic and the largest
    count that works; ``None`` when the split is fine."""
    if count < 1 or samples / count >= MIN_SAMPLES_PER_MINI_BATCH:
        return None
    most = max(1, samples // MIN_SAMPLES_PER_MINI_BATCH)
    return (
        key,
        f"{count} mini-batches of the {samples} samples one rollout batch yields ({yielded_by}) hold "
        f"{samples / count:.3g} samples each, fewer than {MIN_SAMPLES_PER_MINI_BATCH}: an optimizer step "
        f"per sample, whose normalised advantages carry no signal; use at most {most}",
    )


def mini_batch_steps(
    kept: list[TensorDict], algorithm: Any, seed: int, iteration: int, prompts_per_iteration: int
) -> Iterator[list[TensorDict]]:
    """For each of the algorithm's ``ppo_epochs x num_mini_batches`` optimizer steps, the parts of
    ``kept`` (micro-batches with ``group_id``, the prompt's position in the stream) that it trains
    on (possibly none on this replica)."""
    epochs, per_pass = algorithm.ppo_epochs, algorithm.num_mini_batches
    first = (iteration - 1) * prompts_per_iteration
    for epoch in range(epochs):
        g = torch.Generator().manual_seed(row_seed(seed, iteration, epoch))
        position = torch.empty(prompts_per_iteration, dtype=torch.long)
        position[torch.randperm(prompts_per_iteration, generator=g)] = torch.arange(prompts_per_iteration)
        for m in range(per_pass):
            parts = []
            for b in kept:
                chosen = position[b["group_id"] - first] * per_pass // prompts_per_iteration == m
                if bool(chosen.any()):
                    parts.append(b[chosen])
            yield parts
