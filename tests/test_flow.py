"""The flow layer on its own: stages, channels, workflows, plans, placement syntax, wiring and the
in-process launcher."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from rlinf_lightning.flow import BatchShape, Stage, Workflow
from rlinf_lightning.flow.channel import Channel, ChannelTimeout
from rlinf_lightning.flow.placement import parse_placement
from rlinf_lightning.flow.plan import ExecutionPlan, WorkerGroup
from rlinf_lightning.flow.wiring import wire
from rlinf_lightning.flow.worker import StageError
from rlinf_lightning.launchers import LAUNCHERS
from rlinf_lightning.strategies import STRATEGIES, Resources
from trainer_defaults import scaled


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
    plan.validate(workflow, 2)
    return LAUNCHERS.get("inprocess")().launch(workflow, plan, timeout_s=timeout_s)


def test_collocated_runs_a_chain_and_collects_stage_metrics():
    wf = Workflow("toy").chain(AddOne(), Sum())
    plan = STRATEGIES.resolve("collocated").plan(wf, Resources(devices=1), BatchShape(12, 4, 4))
    rt = _launch(wf, plan)
    metrics = rt.run_iteration(1, _batches(3, 4))
    assert metrics["sum"]["total"] == 3 * (0 + 1 + 2 + 3 + 4)
    spans = rt.pop_spans()
    assert sum(1 for s in spans if s.stage == "add" and s.kind == "process") == 3
    assert "collocated" in plan.describe() and "add -> sum" in plan.describe()


def test_a_raising_stage_names_stage_worker_and_traceback():
    wf = Workflow("toy").chain(AddOne(), Boom(), Sum())
    plan = STRATEGIES.resolve("collocated").plan(wf, Resources(devices=1), BatchShape(12, 4, 4))
    rt = _launch(wf, plan)
    with pytest.raises(StageError) as info:
        rt.run_iteration(1, _batches(1, 4))
    err = info.value
    assert err.stage == "boom" and err.worker == "all/0"
    assert "ValueError: bad batch in boom" in str(err) and "in process" in err.tb


def test_two_threaded_workers_abort_each_other_instead_of_hanging():
    wf = Workflow("toy").chain(AddOne(), Boom(), Sum())
    plan = ExecutionPlan(
        "two",
        [
            WorkerGroup("w0", ["add", "boom"], [0], schedule="interleaved"),
            WorkerGroup("w1", ["sum"], [1], schedule="interleaved"),
        ],
    )
    rt = _launch(wf, plan, timeout_s=scaled(30))
    with pytest.raises(StageError, match="boom"):
        rt.run_iteration(1, _batches(2, 4))


def test_channel_get_times_out_with_the_channel_name():
    ch = Channel("rollout->reward", timeout_s=0.2)
    with pytest.raises(ChannelTimeout, match="rollout->reward"):
        ch.get()
    ch.put(1)
    assert ch.poll() == (True, 1) and ch.poll() == (False, None)


def test_plan_validation_names_the_stage_or_slot():
    wf = Workflow("toy").chain(AddOne(), Sum())

    def problems(*groups: WorkerGroup, slots: int = 2) -> str:
        with pytest.raises(ValueError) as info:
            ExecutionPlan("bad", list(groups)).validate(wf, slots)
        return str(info.value)

    assert "stage 'sum' is not placed" in problems(WorkerGroup("w", ["add"], [0]))
    assert "stage 'add' is placed in more than one group" in problems(
        WorkerGroup("a", ["add", "sum"], [0]), WorkerGroup("b", ["add"], [1])
    )
    assert "uses slot(s) [2]" in problems(WorkerGroup("a", ["add", "sum"], [1, 2]))
    # groups may overlap: on slot 1 the add replica takes its turn, then the sum
    ExecutionPlan("overlap", [WorkerGroup("a", ["add"], [0, 1]), WorkerGroup("b", ["sum"], [1])]).validate(
        wf, 2
    )
    assert "do not split into replicas of 2" in problems(
        WorkerGroup("a", ["add", "sum"], [0, 1, 2], slots_per_replica=2), slots=4
    )


def test_placement_syntax_groups_stages_by_slots():
    stages = ["rollout", "reward", "advantage", "inference", "actor"]
    text = "rollout: 0-1, reward,advantage: 0-1, inference,actor: 2-3"
    assert parse_placement(text, 4, stages) == [
        (["rollout", "reward", "advantage"], [0, 1]),
        (["inference", "actor"], [2, 3]),
    ]
    assert parse_placement({"actor,rollout,reward,advantage,inference": "all"}, 2, stages) == [
        (["actor", "rollout", "reward", "advantage", "inference"], [0, 1])
    ]
    assert parse_placement("rollout: 0,2; reward,advantage,inference,actor: 1,3", 4, stages)[0][1] == [0, 2]
    for bad, message in [
        ("rollout: 0-1, actr: 2-3", "unknown stage 'actr'.*did you mean 'actor'"),
        ("rollout: 0-4", "slot 4 does not exist; there are 4 slots"),
        ("rollout 0-1", "cannot read"),
        ("rollout: 3-1", "runs backwards"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_placement(bad, 4, stages)


def test_hybrid_strategy_builds_groups_from_a_placement_and_describes_them():
    wf = Workflow("toy").chain(*[_Named(n) for n in ("rollout", "reward", "advantage", "inference", "actor")])
    strategy = STRATEGIES.resolve("hybrid", placement="rollout,reward: 0-1, advantage,inference,actor: 2-3")
    plan = strategy.plan(wf, Resources(devices=2, num_nodes=2, threads_per_slot=1), BatchShape(128, 8))
    plan.validate(wf, 4)
    assert [(g.name, g.stages, g.slots, g.replicas) for g in plan.groups] == [
        ("rollout", ["rollout", "reward"], [0, 1], 2),
        ("advantage", ["advantage", "inference", "actor"], [2, 3], 2),
    ]
    text = plan.describe()
    assert "0-1 (node 0)" in text and "2-3 (node 1)" in text and "advantage -> inference -> actor" in text
    assert "__input__->rollout: 32" in text
    with pytest.raises(ValueError, match="unknown stage 'rolout'"):
        STRATEGIES.resolve("hybrid", placement="rolout: 0").plan(wf, Resources(devices=2), BatchShape(128, 8))


def test_collocated_replicas_and_the_one_worker_baseline():
    wf = Workflow("toy").chain(AddOne(), Sum())
    res = Resources(devices=4, threads_per_slot=1)
    dp = STRATEGIES.resolve("collocated").plan(wf, res, BatchShape(128, 8))
    one = STRATEGIES.resolve("collocated", replicas=1).plan(wf, res, BatchShape(128, 8))
    assert (dp.groups[0].replicas, dp.groups[0].num_threads, dp.micro_batch_size["__input__->add"]) == (
        4,
        1,
        32,
    )
    assert (one.groups[0].replicas, one.groups[0].num_threads, one.micro_batch_size["__input__->add"]) == (
        1,
        4,
        128,
    )
    with pytest.raises(ValueError, match="replicas=3 must divide the 4 slots"):
        STRATEGIES.resolve("collocated", replicas=3).plan(wf, res, BatchShape(128, 8))


def test_wiring_keeps_a_group_local_and_deals_between_groups():
    class Sticky(Stage):
        name = "env"
        sticky = True

    wf = Workflow("w").chain(Sticky(), AddOne(), Sum()).sync("sum", "add", "w")
    plan = ExecutionPlan(
        "p",
        [WorkerGroup("g0", ["env"], [0]), WorkerGroup("g1", ["add", "sum"], [1, 2])],
    )
    links = wire(wf, plan)
    modes = {ch: (link.mode, link.producers, link.consumers) for ch, link in links.items()}
    assert modes == {
        "__input__->env": ("keyed", 1, 1),  # a sticky stage: dealt by micro-batch index
        "env->add": ("shared", 1, 2),  # into a 2-replica group: pulled by whichever asks first
        "add->sum": ("local", 2, 2),  # within a group: stays on its replica
        "w": ("local", 2, 2),
    }
    assert links["env->add"].ends_expected == 1 and links["add->sum"].ends_expected == 1
    wf.role("train", "sum")  # into the learning stage's group: dealt equally among its ranks
    assert wire(wf, plan)["env->add"].mode == "keyed"


class _Named(Stage):
    def __init__(self, name: str) -> None:
        self.name = name


def test_workflow_checks_its_graph_and_data_contract():
    class Reads(Stage):
        name = "reads"
        in_keys = ("advantage",)

    class Writes(Stage):
        name = "writes"
        out_keys = ("advantage",)

    Workflow("ok").chain(Writes(), Reads()).check_keys(["prompt"])
    with pytest.raises(ValueError, match=r"stage 'reads' reads \['advantage'\] but no stage before it"):
        Workflow("bad").chain(Reads(), Writes()).check_keys(["prompt"])
    wf = Workflow("w").chain(AddOne())
    with pytest.raises(ValueError, match="no stage 'nope'"):
        wf.sync("add", "nope", "x")
    with pytest.raises(ValueError, match="unknown role"):
        wf.role("judge", "add")
    wf.add(Sum())
    with pytest.raises(ValueError, match="read no stream and are in no loop"):
        wf.validate()
    with pytest.raises(ValueError, match="turns must be >= 1"):
        wf.loop("add", "sum", 0)


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


def test_a_replica_may_span_several_slots():
    """slots_per_replica: a group on 4 slots with replicas of 2 (a tensor-parallel engine's shape)
    has 2 workers, each with both slots' threads, and a data-parallel stage sees 2 replicas."""

    class Ranks(Stage):
        name = "sum"

        def setup(self, ctx):
            self.ctx = ctx

        def end_iteration(self):
            return {"replicas": float(self.ctx.replicas), "slots": float(len(self.ctx.slots))}

    wf = Workflow("toy").chain(AddOne(), Ranks())
    strategy = STRATEGIES.resolve("hybrid", placement="add: 0-1, sum: 2-3", slots_per_replica={"add": 2})
    plan = strategy.plan(wf, Resources(devices=4, threads_per_slot=1), BatchShape(16, 4, 4))
    plan.validate(wf, 4)
    assert [(g.name, g.replicas, g.num_threads) for g in plan.groups] == [("add", 1, 2), ("sum", 2, 1)]
    assert "1x2" in plan.describe()
    rt = LAUNCHERS.get("inprocess")().launch(wf, plan, timeout_s=10)
    try:
        assert rt.run_iteration(1, _batches(4, 4))["sum"] == {"replicas": 2.0, "slots": 1.0}
    finally:
        rt.shutdown()


def test_a_slot_is_pinned_to_its_share_of_the_cores(monkeypatch):
    """One slot of a 4-core node is its 4 cores (4 threads, as Resources.threads gives it), not one
    core running 4 threads; 4 slots are a core each; 2 slots of a 2-slot replica, 2 cores each."""
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5, 6, 7})
    wf = Workflow("toy").chain(AddOne())
    for devices, replica_slots, cores in ((1, [0], {4, 5, 6, 7}), (4, [2], {6}), (2, [1], {6, 7})):
        plan = STRATEGIES.get("collocated")().plan(wf, Resources(devices), BatchShape(16, 4, 4))
        assert plan.cores_of(replica_slots) == cores, devices


class EnvironReader(Stage):
    name = "reader"

    def process(self, batch: TensorDict) -> TensorDict:
        return batch

    def environ(self, key: str) -> tuple[str | None, int]:
        import os

        return os.environ.get(key), os.getpid()


def test_process_workers_see_the_drivers_environment_as_it_is_when_they_start(monkeypatch):
    """Workers fork from a fork server started with the first runtime; a variable the driver sets
    after that reaches the next runtime's workers, as it reaches spawned ones, and each runtime
    has processes of its own."""
    wf = Workflow("env").chain(EnvironReader())
    plan = STRATEGIES.resolve("collocated").plan(
        wf, Resources(devices=1, threads_per_slot=1), BatchShape(4, 4)
    )
    seen = []
    for value in (None, "after"):
        if value is not None:
            monkeypatch.setenv("RLINF_TEST_ENVIRON", value)
        rt = LAUNCHERS.resolve("processes").launch(wf, plan, timeout_s=scaled(60))
        try:
            seen.append(rt.call("reader", "environ", "RLINF_TEST_ENVIRON"))
        finally:
            rt.shutdown()
    (before, pid_a), (after, pid_b) = seen
    assert (before, after) == (None, "after") and pid_a != pid_b
