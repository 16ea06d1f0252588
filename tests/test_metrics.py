"""Metrics with declared reductions: merged across replicas they equal the metrics of one replica
that saw every sample, by hand and through real launchers."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from rlinf_lightning.flow import BatchShape, Metrics, Stage, Workflow
from rlinf_lightning.launchers import LAUNCHERS
from rlinf_lightning.strategies import STRATEGIES, Resources
from trainer_defaults import scaled


def _record(values: torch.Tensor, parts: int) -> list[Metrics]:
    """``values`` recorded in ``parts`` chunks of different sizes (micro-batches), one Metrics."""
    m = Metrics()
    for chunk in torch.tensor_split(values, parts):
        m.distribution("x", chunk)
        m.mean("big", float((chunk > 1e6 + 2).double().mean()) if len(chunk) else 0.0, len(chunk))
        m.sum("x_total", chunk.sum())
    return m


def test_merging_two_replicas_equals_computing_on_their_union():
    """Mean (weighted by samples), sum, max and pooled std of two replicas of unequal size."""
    g = torch.Generator().manual_seed(0)
    a = torch.rand(37, generator=g, dtype=torch.float64) * 100 + 1e6  # far from 0: E[x^2] - E[x]^2
    b = torch.rand(5, generator=g, dtype=torch.float64) * 3 + 1e6  # would lose the std here
    union = torch.cat([a, b])
    merged = Metrics.merged([_record(a, 3), _record(b, 2)]).compute()
    want = {
        "x": float(union.mean()),
        "x_std": float(union.std(unbiased=False)),
        "x_max": float(union.max()),
        "big": float((union > 1e6 + 2).double().mean()),
        "x_total": float(union.sum()),
    }
    assert merged.keys() == want.keys()
    assert merged == pytest.approx(want, rel=1e-12, abs=1e-9)
    assert Metrics.merged([_record(union, 1)]).compute() == pytest.approx(want, rel=1e-12, abs=1e-9)


def test_a_replica_that_saw_nothing_changes_nothing_and_take_empties():
    values = torch.tensor([1.0, 2.0, 4.0])
    m = _record(values, 2)
    empty = Metrics()
    assert Metrics.merged([m, empty]).compute() == m.compute()
    taken = m.take()
    assert m.compute() == {} and taken.compute()["x_total"] == 7.0


def test_a_name_declared_with_two_reductions_is_named():
    m = Metrics()
    m.sum("tokens_total", 3)
    with pytest.raises(ValueError, match="'tokens_total' was declared as a sum and now as a mean"):
        m.mean("tokens_total", 1.0)
    other = Metrics()
    other.max("tokens_total", 1.0)
    with pytest.raises(ValueError, match="'tokens_total' was declared as a sum and now as a max"):
        m.merge(other)


def test_means_without_weight_are_plain_means():
    m = Metrics()
    m.mean("lr", 1.0, weight=0)
    m.mean("lr", 3.0, weight=0)
    assert m.compute() == {"lr": 2.0}


class _Emit(Stage):
    """Sticky: input micro-batch ``k`` goes to replica ``k % 2`` (and stays on it downstream), so
    both replicas report (pulling, one replica may take every micro-batch)."""

    name = "emit"
    sticky = True

    def process(self, batch):
        return batch


class _Observe(Stage):
    """Records every value it sees; one replica or several must report the same."""

    name = "observe"

    def setup(self, ctx):
        self.metrics = Metrics()

    def process(self, batch):
        self.metrics.distribution("x", batch["x"])
        self.metrics.sum("x_total", batch["x"].sum())

    def end_iteration(self):
        return self.metrics.take()


class _PlainDict(Stage):
    """A plain dict: its replicas' values are means weighted by the samples each processed."""

    name = "plain"

    def begin_iteration(self, iteration):
        self.values = []

    def process(self, batch):
        self.values.append(batch["x"])
        return batch

    def end_iteration(self):
        return {"x": float(torch.cat(self.values).mean())} if self.values else {}


def _batches() -> list[TensorDict]:
    g = torch.Generator().manual_seed(1)
    return [TensorDict({"x": torch.rand(4, generator=g) * 10}, batch_size=[4]) for _ in range(6)]


@pytest.mark.parametrize("launcher", ["inprocess", "processes"])
def test_stage_metrics_from_two_replicas_merge_exactly(launcher):
    """Two replicas of each stage (each takes whichever micro-batches it pulls) report what one
    replica over every micro-batch would, through a launcher's transport."""
    wf = Workflow("toy").chain(_Emit(), _PlainDict(), _Observe())
    union = torch.cat([b["x"] for b in _batches()]).double()
    resources = Resources(devices=2, threads_per_slot=1)
    plan = STRATEGIES.resolve("collocated").plan(wf, resources, BatchShape(24, 4))
    assert plan.groups[0].replicas == 2
    plan.validate(wf, 2)
    rt = LAUNCHERS.get(launcher)().launch(wf, plan, timeout_s=scaled(60))
    try:
        metrics = rt.run_iteration(1, _batches())
    finally:
        rt.shutdown()
    assert metrics["observe"] == pytest.approx(
        {
            "x": float(union.mean()),
            "x_std": float(union.std(unbiased=False)),
            "x_max": float(union.max()),
            "x_total": float(union.sum()),
        }
    )
    assert metrics["plain"] == pytest.approx({"x": float(union.mean())})
