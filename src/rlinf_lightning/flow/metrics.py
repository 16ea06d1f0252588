"""Metrics: an iteration's named scalars, each with the reduction it was declared with.

A stage records what it measures as it goes and returns the accumulator from ``end_iteration``;
the launcher merges the accumulators of a group's replicas and only then turns them into numbers,
so a merged metric is exactly what one replica processing every sample would have reported::

    m = Metrics()
    m.mean("accuracy", 0.75, weight=8)             # weighted mean (weight: samples it covers)
    m.sum("tokens_total", 1024)                    # summed: per iteration, over replicas
    m.max("response_length_max", 37)               # the largest
    m.std("response_length_std", lengths)          # pooled standard deviation of the values
    m.distribution("response_length", lengths)     # mean, ``_std`` and ``_max`` of the values
    Metrics.merged([m, other]).compute()           # {"accuracy": ..., "tokens_total": ..., ...}

Names are what the loggers show under the stage's group (``rollout/tokens_total``); the trainer
also reports every ``*_total`` per wall second (``perf/tokens_per_s``). Declaring one name with
two reductions is an error, named.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

Values = torch.Tensor | Sequence[float]


def _tensor(values: Values) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.float64).reshape(-1)


class _Mean:
    """Weighted mean; where no value carried weight, the plain mean of the values recorded."""

    def __init__(self) -> None:
        self.weighted, self.weight, self.plain, self.calls = 0.0, 0.0, 0.0, 0

    def add(self, value: float, weight: float) -> None:
        self.weighted += value * weight
        self.weight += weight
        self.plain += value
        self.calls += 1

    def merge(self, other: _Mean) -> None:
        self.weighted += other.weighted
        self.weight += other.weight
        self.plain += other.plain
        self.calls += other.calls

    def value(self) -> float:
        return self.weighted / self.weight if self.weight else self.plain / max(self.calls, 1)


class _Sum:
    def __init__(self) -> None:
        self.total = 0.0

    def add(self, amount: float) -> None:
        self.total += amount

    def merge(self, other: _Sum) -> None:
        self.total += other.total

    def value(self) -> float:
        return self.total


class _Max:
    def __init__(self) -> None:
        self.largest = -math.inf

    def add(self, value: float) -> None:
        self.largest = max(self.largest, value)

    def merge(self, other: _Max) -> None:
        self.largest = max(self.largest, other.largest)

    def value(self) -> float:
        return self.largest


class _Std:
    """Population standard deviation, kept as (count, mean, sum of squared deviations) and merged
    with Chan et al.'s pairwise update, which stays exact where ``E[x^2] - E[x]^2`` cancels."""

    def __init__(self) -> None:
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    def add(self, values: torch.Tensor) -> None:
        if len(values):
            part = _Std()
            part.count, part.mean = len(values), float(values.mean())
            part.m2 = float(((values - part.mean) ** 2).sum())
            self.merge(part)

    def merge(self, other: _Std) -> None:
        if not other.count:
            return
        count = self.count + other.count
        delta = other.mean - self.mean
        self.m2 += other.m2 + delta**2 * self.count * other.count / count
        self.mean += delta * other.count / count
        self.count = count

    def value(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count else 0.0


_KINDS = {_Mean: "mean", _Sum: "sum", _Max: "max", _Std: "std"}


class Metrics:
    """Named scalars, each reduced as declared, mergeable across replicas (see the module doc)."""

    def __init__(self) -> None:
        self._entries: dict[str, Any] = {}

    def _entry(self, name: str, kind: type) -> Any:
        entry = self._entries.get(name)
        if entry is None:
            entry = self._entries[name] = kind()
        elif type(entry) is not kind:
            raise ValueError(
                f"metric {name!r} was declared as a {_KINDS[type(entry)]} and now as a {_KINDS[kind]}; "
                "give each reduction its own name"
            )
        return entry

    def mean(self, name: str, value: float | torch.Tensor, weight: float = 1.0) -> None:
        """Record ``value`` for the mean of ``name``, weighted by ``weight`` (e.g. the samples it
        averages over)."""
        self._entry(name, _Mean).add(float(value), float(weight))

    def sum(self, name: str, amount: float | torch.Tensor) -> None:
        """Add ``amount`` to ``name`` (counts: tokens, episodes, timeouts)."""
        self._entry(name, _Sum).add(float(_tensor(amount).sum()))

    def max(self, name: str, value: float | torch.Tensor) -> None:
        """Keep the largest value recorded under ``name``."""
        values = _tensor(value)
        if len(values):
            self._entry(name, _Max).add(float(values.max()))

    def std(self, name: str, values: Values) -> None:
        """Add ``values`` to the population of which ``name`` is the standard deviation."""
        self._entry(name, _Std).add(_tensor(values))

    def distribution(self, name: str, values: Values) -> None:
        """``name`` (mean), ``name_std`` and ``name_max`` of ``values``."""
        values = _tensor(values)
        if len(values):
            self.mean(name, values.mean(), len(values))
        self.std(f"{name}_std", values)
        self.max(f"{name}_max", values)

    def merge(self, other: Metrics) -> Metrics:
        """Add ``other``'s records to these (in place); returns ``self``."""
        for name, entry in other._entries.items():
            self._entry(name, type(entry)).merge(entry)
        return self

    @classmethod
    def merged(cls, parts: Iterable[Metrics]) -> Metrics:
        """One accumulator holding every part's records (the parts are left unchanged)."""
        out = cls()
        for part in parts:
            out.merge(part)
        return out

    @classmethod
    def of_means(cls, values: Mapping[str, float], weight: float) -> Metrics:
        """Plain ``{name: value}`` metrics as means, each weighted by ``weight`` (what a stage that
        returns a dict from ``end_iteration`` gets: its replicas' values weighted by samples)."""
        out = cls()
        for name, value in values.items():
            out.mean(name, value, weight)
        return out

    def take(self) -> Metrics:
        """What was recorded so far, leaving this accumulator empty (a stage's ``end_iteration``)."""
        out = Metrics()
        out._entries, self._entries = self._entries, {}
        return out

    def compute(self) -> dict[str, float]:
        """Each metric's value under its reduction."""
        return {name: entry.value() for name, entry in self._entries.items()}

    def __repr__(self) -> str:
        return f"Metrics({self.compute()})"
