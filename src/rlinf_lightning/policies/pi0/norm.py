"""π0's normalisation statistics (openpi's ``norm_stats.json``): the state it reads and the actions
it denoises, standardised with the demonstrations' mean and standard deviation.

Both matter to a small π0: raw, the state's informative part (the goal minus the gripper) rides
on far larger coordinates and the actions' spread is a fraction of the flow-matching noise's, so the
fitted velocity ignores the state and the SFT policy reaches no goal (the success rates measured
on FetchReach: docs/benchmarks.md). Entries that barely vary
in the demonstrations (the fingers' velocities, the unused gripper action) have their standard
deviation floored at ``STD_FLOOR`` so that a slightly different value under RL does not blow up.

``rlinf sft`` writes the file beside the π0 it saves; :class:`~.policy.Pi0Policy` reads it from its
``model_path`` (no file: identity), standardises the state, and executes ``mean + std * a`` for a
denoised ``a``. The chain (and so every Flow-Noise log-prob) lives in the standardised space: the
affine map to the env's actions has a constant Jacobian, so PPO's ratios are the same.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

NORM_FILE = "norm_stats.json"
STD_FLOOR = 1e-2


@dataclass
class NormStats:
    """Per-entry ``mean`` and ``std`` of the state (``[state_dim]``) and of the actions
    (``[action_dim]``)."""

    state_mean: torch.Tensor
    state_std: torch.Tensor
    action_mean: torch.Tensor
    action_std: torch.Tensor

    @classmethod
    def of(cls, state: torch.Tensor, action: torch.Tensor, mask: torch.Tensor) -> NormStats:
        """From demonstration rows: ``state`` ``[N, S]``, ``action`` ``[N, chunk, A]`` and its
        ``mask`` ``[N, chunk]`` (only the valid steps count)."""
        valid = action[mask].double()
        state = state.double()
        return cls(
            state.mean(0).float(),
            state.std(0).clamp_min(STD_FLOOR).float(),
            valid.mean(0).float(),
            valid.std(0).clamp_min(STD_FLOOR).float(),
        )

    @classmethod
    def load(cls, directory: str | Path) -> NormStats | None:
        """The statistics saved in ``directory``, or ``None`` where it has none; ``ValueError``
        naming the file when it is not readable as such (openpi's layout, positive deviations)."""
        path = Path(directory) / NORM_FILE
        if not path.is_file():
            return None
        try:
            stats = json.loads(path.read_text(encoding="utf-8"))["norm_stats"]
            state, actions = stats["state"], stats["actions"]
            out = cls(*(torch.tensor(v, dtype=torch.float32) for v in (
                state["mean"], state["std"], actions["mean"], actions["std"])))  # fmt: skip
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise ValueError(
                f"{path}: not a readable {NORM_FILE} ({type(exc).__name__}: {exc}); expected "
                '{"norm_stats": {"state": {"mean": [...], "std": [...]}, "actions": {...}}}, '
                "as rlinf sft writes it"
            ) from None
        for what, mean, std in (
            ("state", out.state_mean, out.state_std),
            ("actions", out.action_mean, out.action_std),
        ):
            if (
                mean.dim() != 1
                or mean.shape != std.shape
                or not bool((std > 0).all() and mean.isfinite().all())
            ):
                raise ValueError(
                    f"{path}: its {what} mean and std must be lists of one length, the std positive and "
                    "everything finite; write it again with rlinf sft"
                )
        return out

    def save(self, directory: str | Path) -> None:
        stats = {
            "state": {"mean": self.state_mean.tolist(), "std": self.state_std.tolist()},
            "actions": {"mean": self.action_mean.tolist(), "std": self.action_std.tolist()},
        }
        (Path(directory) / NORM_FILE).write_text(json.dumps({"norm_stats": stats}, indent=1))

    def state(self, x: torch.Tensor) -> torch.Tensor:
        """Standardise a ``[B, S]`` state."""
        return (x - self.state_mean.to(x.device)) / self.state_std.to(x.device)

    def normalize_action(self, a: torch.Tensor) -> torch.Tensor:
        """Env actions ``[..., A]`` -> the standardised ones π0 denoises."""
        return (a - self.action_mean.to(a.device)) / self.action_std.to(a.device)

    def action(self, a: torch.Tensor) -> torch.Tensor:
        """Standardised actions ``[..., A]`` -> the env's."""
        return a * self.action_std.to(a.device) + self.action_mean.to(a.device)
