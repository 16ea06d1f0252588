"""Demonstrations as replay transitions: the demo files ``rlinf demos`` writes (the format of
``policies.pi0.demos``, which ``rlinf sft`` reads) carry each step's ``reward``, ``terminated``,
``truncated`` and ``next_obs.*`` besides its observation and actions, so one file serves SFT and
an off-policy learner's demo buffer (RLPD)."""

from __future__ import annotations

from pathlib import Path

import torch
from tensordict import TensorDict

from rlinf_lightning.policies.pi0.demos import load_demos

#: the columns a demo file needs beyond SFT's to be replayed
TRANSITION_COLUMNS = ("reward", "terminated", "truncated")


def load_demo_transitions(path: str | Path, obs: TensorDict) -> TensorDict:
    """The transitions of demo file ``path`` (batch ``[N]``, the keys of ``replay.TRANSITION_KEYS``):
    each row's first action, up to and including each episode's first end. ``obs`` is one of the
    env's observations: the file must hold the same entries. A ``ValueError`` says what is wrong."""
    from safetensors.torch import load_file

    if not Path(path).is_file():
        raise ValueError(f"{path}: no such file (write one with `rlinf demos`)")
    demos, _ = load_demos(path)
    tensors = load_file(str(path))
    missing = [k for k in TRANSITION_COLUMNS if k not in tensors]
    if missing or not any(k.startswith("next_obs.") for k in tensors):
        raise ValueError(
            f"{path}: holds no {', '.join(missing) or 'next_obs'}: re-record it with `rlinf demos`"
        )
    n = len(demos)
    next_obs = TensorDict({k[9:]: v for k, v in tensors.items() if k.startswith("next_obs.")}, batch_size=[n])
    want = sorted(k for k, v in obs.items() if isinstance(v, torch.Tensor))
    if sorted(demos["obs"].keys()) != want:
        raise ValueError(f"{path}: observations {sorted(demos['obs'].keys())}, the env gives {want}")
    done = tensors["terminated"] | tensors["truncated"]
    keep = torch.ones(n, dtype=torch.bool)
    episode = demos["episode"]
    for e in episode.unique():  # rows after an episode's first end are the next episode's (auto-reset)
        rows = (episode == e).nonzero().squeeze(-1)
        ends = done[rows].nonzero()
        if len(ends):
            keep[rows[int(ends[0]) + 1 :]] = False
    transitions = TensorDict(
        {
            "obs": demos["obs"].select(*want),
            "action": demos["action"][:, 0].float(),
            "reward": tensors["reward"].float(),
            "next_obs": next_obs.select(*want),
            "terminated": tensors["terminated"].bool(),
            "truncated": tensors["truncated"].bool(),
        },
        batch_size=[n],
    )
    return transitions[keep]
