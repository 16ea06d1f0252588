"""The range of every algorithm option, in one table, checked before anything loads.

Algorithms are dataclasses whose fields are their options. :data:`OPTION_RANGES` says by option
name what values make sense, so every algorithm (built-in presets, PPO, a plugin's) is checked by
the same rules and a new option gets its check in one place: :func:`option_problems` returns one
``(option, problem)`` pair per value out of range. Options of a plugin's algorithm that the table
does not know are checked by the plugin's own ``problems()`` method, if it has one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Range:
    """Allowed values of one option: a number in ``[low, high]`` (``open_low``/``open_high``
    exclude the bound), ``None`` too when ``nullable``, an integer when ``integer``; or one of
    ``choices``. ``why`` says what the bound protects, for the message."""

    low: float | None = None
    high: float | None = None
    open_low: bool = False
    open_high: bool = False
    nullable: bool = False
    integer: bool = False
    choices: tuple[str, ...] = ()
    why: str = ""

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is out of range, or ``None``."""
        if value is None:
            return None if self.nullable else f"must be set, got null{self._why}"
        if self.choices:
            return (
                None if value in self.choices else f"must be one of {', '.join(self.choices)}; got {value!r}"
            )
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"must be a number, got {value!r}"
        if self.integer and value != int(value):
            return f"must be an integer, got {value}"
        low_bad = self.low is not None and (value <= self.low if self.open_low else value < self.low)
        high_bad = self.high is not None and (value >= self.high if self.open_high else value > self.high)
        if low_bad or high_bad:
            return f"must be {self._text()}, got {value}{self._why}"
        return None

    def _text(self) -> str:
        parts = []
        if self.low is not None:
            parts.append(f"{'>' if self.open_low else '>='} {self.low:g}")
        if self.high is not None:
            parts.append(f"{'<' if self.open_high else '<='} {self.high:g}")
        return " and ".join(parts) + (" (or null)" if self.nullable else "")

    @property
    def _why(self) -> str:
        return f" ({self.why})" if self.why else ""


_FRACTION = Range(0.0, 1.0)
_NONNEGATIVE = Range(0.0)
_POSITIVE_INT = Range(1, integer=True)

#: option name -> its range, for every algorithm that has an option of that name
#: options that name a file: no range; the workflow reads the file before workers start and names
#: the option when it cannot (e.g. ``trainer.algorithm.demo_path``)
FILE_OPTIONS = frozenset({"demo_path"})

OPTION_RANGES: dict[str, Range] = {
    # policy losses
    "clip_eps": Range(0.0, open_low=True, why="the ratio's clip range below 1"),
    "clip_eps_high": Range(0.0, open_low=True, nullable=True, why="null: clip_eps"),
    "dual_clip": Range(1.0, open_low=True, nullable=True, why="a cap of -dual_clip x A above the clip"),
    "loss_agg": Range(
        choices=("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
    ),
    "tis_cap": Range(0.0, open_low=True, nullable=True, why="null: no correction"),
    # off-policy corrections (asynchronous RL)
    "behaviour_weight_cap": Range(1.0, open_low=True, why="a cap on pi_prox / pi_behave above 1"),
    # advantages
    "gamma": _FRACTION,
    "gae_lambda": _FRACTION,
    # KL and entropy
    "kl_coef": _NONNEGATIVE,
    "kl_estimator": Range(choices=("k1", "k2", "k3")),
    "kl_target": Range(0.0, open_low=True, nullable=True, why="null: a fixed kl_coef"),
    "kl_horizon": _POSITIVE_INT,
    "entropy_coef": _NONNEGATIVE,
    "ent_coef": _NONNEGATIVE,
    # several updates per rollout batch
    "ppo_epochs": _POSITIVE_INT,
    "update_epochs": _POSITIVE_INT,
    "num_mini_batches": _POSITIVE_INT,
    "num_minibatches": _POSITIVE_INT,
    # DAPO's reward shaping and sampling
    "overlong_buffer": Range(0.0, 1.0, open_high=True, why="a fraction of task.sampling.max_new_tokens"),
    "overlong_penalty": _NONNEGATIVE,
    "max_sampling_rounds": Range(0, integer=True, why="0: no dynamic sampling"),
    # critic
    "value_clip": Range(0.0, open_low=True, nullable=True, why="null: no clipping"),
    "vf_coef": _NONNEGATIVE,
    "target_kl": Range(0.0, open_low=True, nullable=True, why="null: no early stop"),
    "critic_warmup": Range(0, integer=True, why="0: the actor trains from the first iteration"),
    # off-policy (SAC, RLPD, CrossQ): the replay buffer and the update-to-data ratio
    "tau": Range(0.0, 1.0, open_low=True, why="the target critics' Polyak rate"),
    "batch_size": _POSITIVE_INT,
    "buffer_capacity": Range(1, integer=True, why="transitions the replay buffer holds"),
    "learning_starts": Range(0, integer=True, why="0: update from the first transitions"),
    "updates_per_step": Range(0.0, open_low=True, why="updates per env step; a learner needs some"),
    "init_alpha": Range(0.0, open_low=True, why="the entropy temperature at the start"),
    "target_entropy": Range(
        high=0.0,
        nullable=True,
        why="null: -|A|; a tanh-squashed policy's entropy is at most |A| ln 2, so a target near or above it "
        "makes the temperature grow without end",
    ),  # fmt: skip
    "critic_subset": Range(1, integer=True, nullable=True, why="null: every critic"),
    "actor_aggregate": Range(choices=("min", "mean")),
    "demo_ratio": _FRACTION,
    "policy_delay": Range(1, integer=True, why="updates per actor update; 1: every update"),
}


def option_problems(algorithm: Any) -> list[tuple[str, str]]:
    """``(option, problem)`` for each option of ``algorithm`` out of its :data:`OPTION_RANGES`
    range, then whatever its own ``problems()`` finds (names not registered, options that
    contradict each other)."""
    problems = []
    if dataclasses.is_dataclass(algorithm):
        for f in dataclasses.fields(algorithm):
            rule = OPTION_RANGES.get(f.name)
            if rule is not None and (why := rule.problem(getattr(algorithm, f.name))):
                problems.append((f.name, why))
    own = getattr(algorithm, "problems", None)
    return problems + (own() if callable(own) else [])
