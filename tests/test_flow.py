"""The flow layer on its own: stages, channels, plans and the in-process launcher."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from rlinf_lightning.flow import Stage, Workflow
from rlinf_lightning.flow.channel import Channel, ChannelTimeout
from rlinf_lightning.flow.plan import ExecutionPlan, WorkerGroupSpec
from rlinf_lightning.flow.worker import StageError
from rlinf_lightning.launchers import LAUNCHERS
from rlinf_lightning.strategies import STRATEGIES, BatchShape, Resources


class AddOne(Stage):
    name = "add"

    def process(self, batch):
        batch["x"] = batch["x"] + 1
        return batch


class Sum(Stage):
    name = "sum"

    def begin_iteration(self, iteration):
        self.total = 0.0

    def process(self, batch):
        self.total += float(batch["x"].sum())

    def end_iteration(self):
        return {"total": self.total}


class Boom(Stage):
    name = "boom"

    def process(self, batch):
        raise ValueError("bad batch in boom")


def _batches(n: int, size: int) -> list[TensorDict]:
    return [TensorDict({"x": torch.arange(size, dtype=torch.float32)}, batch_size=[size]) for _ in range(n)]


def _launch(workflow: Workflow, plan: ExecutionPlan, timeout_s: float = 10.0):
    plan.validate(list(workflow.stages))
    return LAUNCHERS.get("inprocess")().launch(workflow, plan, timeout_s=timeout_s)


def test_collocated_runs_a_chain_and_collects_stage_metrics():
    wf = Workflow("toy").chain(AddOne(), Sum())
    plan = STRATEGIES.resolve("collocated").plan(wf, Resources(devices=1), BatchShape(12, 4, 4))
    rt = _launch(wf, plan)
    metrics = rt.run_iteration(1, _batches(3, 4))
    assert metrics["sum"]["total"] == 3 * (0 + 1 + 2 + 3 + 4)
    spans = rt.pop_spans()
    assert sum(1 for s in spans if s.stage == "add" and s.what == "process") == 3
    assert "collocated" in plan.describe() and "add -> sum" in plan.describe()


def test_a_raising_stage_names_stage_worker_and_traceback():
    wf = Workflow("toy").chain(AddOne(), Boom(), Sum())
    plan = STRATEGIES.resolve("collocated").plan(wf, Resources(devices=1), BatchShape(12, 4, 4))
    rt = _launch(wf, plan)
    with pytest.raises(StageError) as info:
        rt.run_iteration(1, _batches(1, 4))
    err = info.value
    assert err.stage == "boom" and err.worker == "all"
    assert "ValueError: bad batch in boom" in str(err) and "in process" in err.tb


def test_two_threaded_workers_abort_each_other_instead_of_hanging():
    wf = Workflow("toy").chain(AddOne(), Boom(), Sum())
    plan = ExecutionPlan(
        "two",
        [
            WorkerGroupSpec("w0", ["add", "boom"], [0], schedule="interleaved"),
            WorkerGroupSpec("w1", ["sum"], [1], schedule="interleaved"),
        ],
    )
    rt = _launch(wf, plan, timeout_s=30.0)
    with pytest.raises(StageError, match="boom"):
        rt.run_iteration(1, _batches(2, 4))


def test_channel_get_times_out_with_the_channel_name():
    ch = Channel("rollout->reward", timeout_s=0.2)
    with pytest.raises(ChannelTimeout, match="rollout->reward"):
        ch.get()
    ch.put(1)
    assert ch.poll() == (True, 1) and ch.poll() == (False, None)


def test_plan_validation_rejects_unplaced_and_duplicate_stages():
    with pytest.raises(ValueError, match=r"unplaced stages \['sum'\]"):
        ExecutionPlan("bad", [WorkerGroupSpec("w", ["add"], [0])]).validate(["add", "sum"])
    with pytest.raises(ValueError, match=r"placed twice \['add'\]"):
        ExecutionPlan(
            "bad", [WorkerGroupSpec("a", ["add"], [0]), WorkerGroupSpec("b", ["add"], [1])]
        ).validate(["add"])


def test_registry_suggests_close_names():
    assert "collocated" in STRATEGIES.unknown_message("colocated")
    with pytest.raises(KeyError):
        STRATEGIES.get("no-such-strategy")


def test_shared_memory_transport_sends_handles_for_large_tensors():
    from rlinf_lightning.flow.channel import decode, encode

    big = torch.randn(64, 4096)  # 1 MiB
    td = TensorDict({"big": big, "small": torch.arange(4), "text": ["a", "b", "c", "d"]}, batch_size=[])
    data = encode(td)
    assert len(data) < 16 * 1024  # a handle, not a pickled megabyte
    out = decode(data)
    assert out["big"].is_shared() and torch.equal(out["big"], big)
    assert not out["small"].is_shared() and list(out["text"]) == ["a", "b", "c", "d"]
    weights = torch.randn(512, 512)
    snapshot = decode(encode(weights, copy=True))
    weights.add_(1.0)  # the sender keeps training; the receiver holds the values as of put
    assert not torch.equal(snapshot, weights) and not weights.is_shared()
