"""The auto strategy: its profile, its simulator against measured plans, re-tuning under drift."""

from __future__ import annotations

import os
import statistics
import time

import pytest
import torch
from tensordict import TensorDict

from rlinf_lightning import Callback, RLTrainer
from rlinf_lightning.flow import BatchShape
from rlinf_lightning.flow.placement import parse_placement
from rlinf_lightning.flow.stage import Stage
from rlinf_lightning.flow.trace import Span
from rlinf_lightning.flow.workflow import Workflow
from rlinf_lightning.strategies import STRATEGIES, HybridStrategy, Replan, Resources, RunInfo, Strategy
from rlinf_lightning.strategies.auto import AutoStrategy
from rlinf_lightning.strategies.auto.profile import Profile, StageCost
from rlinf_lightning.strategies.auto.search import candidates
from rlinf_lightning.strategies.auto.simulate import simulate
from rlinf_lightning.tasks.base import Task
from trainer_defaults import scaled

BATCH, UNIT = 64, 4


class Sleeper(Stage):
    """Costs ``a + b x samples`` seconds per call (a sleep, so threads overlap as processes would);
    from iteration ``change_at`` on, ``a`` becomes ``a_after``."""

    def __init__(
        self, name: str, a: float, b: float, a_after: float | None = None, change_at: int = 0,
        end_s: float = 0.0,
    ):  # fmt: skip
        self.name, self.a, self.b, self.a_after, self.change_at = name, a, b, a_after, change_at
        self.end_s = end_s

    def begin_iteration(self, iteration: int) -> None:
        self.cost_a = self.a_after if self.a_after is not None and iteration >= self.change_at else self.a

    def process(self, batch: TensorDict) -> TensorDict:
        time.sleep(self.cost_a + self.b * batch.batch_size[0])
        return batch


class Learner(Sleeper):
    def setup(self, ctx) -> None:
        self.steps = 0

    def process(self, batch: TensorDict) -> None:
        super().process(batch)

    def end_iteration(self) -> dict[str, float]:
        time.sleep(self.end_s)
        self.steps += 1
        return {"steps": float(self.steps), "pid": float(os.getpid())}

    def sync_state(self) -> TensorDict:
        return TensorDict({"steps": torch.tensor(self.steps)}, [])

    def state_dict(self):
        return {"model": {"steps": torch.tensor([float(self.steps)])}, "optimizer": None}

    def load_state_dict(self, state) -> None:
        self.steps = int(state["model"]["steps"])

    def save_sharded(self, path: str) -> bool:
        return False  # the state is small: state_dict carries it


class Generator(Sleeper):
    def apply_sync(self, source, state) -> None:
        self.steps = int(state["steps"])


class SleepTask(Task):
    """A two-stage workflow whose generator's per-call cost jumps to ``a_after`` at ``change_at``
    (``gen``, ``learn``: the stages' classes; ``per_sample_s``: their costs per sample;
    ``step_s``: the learner's end of iteration)."""

    input_keys = ("x",)

    def __init__(
        self,
        change_at: int = 10_000,
        gen: type | None = None,
        learn: type | None = None,
        step_s: float = 0.0,
        per_sample_s: tuple[float, float] = (0.001, 0.0006),
        a_after: float = 0.03,
    ) -> None:
        self.change_at, self.gen, self.learn = change_at, gen or Generator, learn or Learner
        self.step_s, self.per_sample_s, self.a_after = step_s, per_sample_s, a_after

    def batch_shape(self, run) -> BatchShape:
        return BatchShape(BATCH, UNIT, run.micro_batch_size)

    def build_workflow(self, policy, run) -> Workflow:
        gen_b, learn_b = self.per_sample_s
        return (
            Workflow("sleepers")
            .chain(
                self.gen("gen", a=0.0005, b=gen_b, a_after=self.a_after, change_at=self.change_at),
                self.learn("learn", a=0.0005, b=learn_b, end_s=self.step_s),
            )
            .sync("learn", "gen", "weights", staleness=run.max_staleness if run is not None else 0)
            .role("train", "learn")
        )

    def inputs(self, iteration, micro_batch_size, run):
        return [
            TensorDict({"x": torch.zeros(micro_batch_size)}, [micro_batch_size])
            for _ in range(BATCH // micro_batch_size)
        ]

    def evaluate(self, runtime):
        return {"accuracy": 0.0}


class Recorder(Callback):
    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_iteration_end(self, trainer, iteration, metrics):
        self.rows.append({"iteration": iteration, **metrics})


class _Policy:
    pass


def _trainer(
    tmp_path, strategy, iterations: int, launcher: str = "inprocess", max_staleness: int = 0
) -> tuple[RLTrainer, Recorder]:
    rec = Recorder()
    trainer = RLTrainer(
        strategy=strategy,
        launcher=launcher,
        devices=2,
        max_iterations=iterations,
        default_root_dir=tmp_path,
        logger=False,
        enable_progress_bar=False,
        callbacks=[rec],
        timeout_s=scaled(60),
        max_staleness=max_staleness,
    )
    return trainer, rec


def _fit(tmp_path, strategy, iterations: int, max_staleness: int = 0, **task) -> tuple[RLTrainer, Recorder]:
    trainer, rec = _trainer(tmp_path, strategy, iterations, max_staleness=max_staleness)
    trainer.fit(_Policy(), SleepTask(**task))
    return trainer, rec


def test_stage_cost_fit_recovers_a_line_and_clamps_to_nonnegative():
    c = StageCost.fit([(8, 0.01 + 8 * 0.002), (16, 0.01 + 16 * 0.002), (32, 0.01 + 32 * 0.002)])
    assert c.a == pytest.approx(0.01) and c.b == pytest.approx(0.002)
    assert StageCost.fit([(8, 0.05), (16, 0.04)]).b == 0.0  # no negative slope
    one = StageCost.fit([(16, 0.032)])
    assert one.a == 0.0 and one.call_s(16) == pytest.approx(0.032)


def test_stage_cost_fit_is_not_moved_by_one_slow_call():
    """The median call of each size: a pause in one of three calls must not bend the line."""
    calls = [(32, 0.0227), (32, 0.0503), (32, 0.0229), (64, 0.0407), (64, 0.0409), (64, 0.0411)]
    c = StageCost.fit(calls)
    assert c.call_s(32) == pytest.approx(0.0229) and c.call_s(64) == pytest.approx(0.0409)


def test_simulated_pipeline_matches_the_hand_computed_schedule():
    """Disaggregated gen | learn, M micro-batches: the pipeline's makespan is
    M x max(stage) + min(stage) (plus the sync's two ends)."""
    wf = SleepTask().build_workflow(None, None)
    p = Profile("sleepers", message_s=0.0)
    p.stages = {"gen": StageCost(0.001, 0.001), "learn": StageCost(0.0, 0.0005, end_s=0.002)}
    p.sync_s = {"learn": 0.001, "gen": 0.001}
    for mb in (8, 16, 32):
        plan = STRATEGIES.get("disaggregated")().plan(wf, Resources(2), BatchShape(BATCH, UNIT, mb))
        m, gen, learn = BATCH // mb, 0.001 + 0.001 * mb, 0.0005 * mb
        expected = m * gen + learn + 0.002 + 0.001 + 0.001
        assert simulate(wf, plan, p, BATCH) == pytest.approx(expected)
    # collocated: each of two replicas runs half the micro-batches, then the collective step
    plan = STRATEGIES.get("collocated")().plan(wf, Resources(2), BatchShape(BATCH, UNIT, 8))
    half = BATCH // 8 // 2
    assert simulate(wf, plan, p, BATCH) == pytest.approx(half * (0.009 + 0.004) + 0.002 + 0.002)


def test_lagged_syncs_overlap_the_next_rollout_with_this_update():
    """gen (1 s) on slot 0, learn (L s) on slot 1. Synchronous, gen waits for each update: an
    iteration takes 1 + L. With staleness k >= 1 gen rolls out iteration j + 1 on version j - k
    while learn trains on j, so the steady period is the slower of the two, max(1, L); one worker
    hosting both gains nothing, at any k."""

    def workflow(k: int) -> Workflow:
        wf = Workflow("lag").chain(_named("gen"), _named("learn"))
        return wf.sync("learn", "gen", "weights", staleness=k).role("train", "learn")

    shape = BatchShape(16, 4, 16)
    for learn_s in (0.5, 1.0, 3.0):
        costs = {"gen": StageCost(1.0, 0.0), "learn": StageCost(learn_s, 0.0)}
        p = Profile("lag", message_s=0.0, stages=costs)
        for k, expected in ((0, 1.0 + learn_s), (1, max(1.0, learn_s)), (2, max(1.0, learn_s))):
            wf = workflow(k)
            apart = HybridStrategy(placement="gen: 0, learn: 1").plan(wf, Resources(2), shape)
            assert simulate(wf, apart, p, 16) == pytest.approx(expected), (learn_s, k)
            one = STRATEGIES.get("collocated")(replicas=1).plan(wf, Resources(1), shape)
            assert simulate(wf, one, p, 16) == pytest.approx(1.0 + learn_s), (learn_s, k)
    # the search ranks the split first only where the lag lets it overlap: gen 1/16 s per sample,
    # learn 1/32 s per sample and a 0.5 s step no replica count divides. Collocated, two replicas:
    # 8 x 1/16 + 8 x 1/32 + 0.5 = 1.25 s at any k; apart, with k = 1: max(1, 0.5 + 0.5) = 1 s
    costs = {"gen": StageCost(0.0, 1 / 16), "learn": StageCost(0.0, 1 / 32, end_s=0.5)}
    for k, first, best_s in ((0, "collocated", 1.25), (1, "disaggregated", 1.0)):
        profile = Profile("lag", message_s=0.0, stages=costs)
        ranked = candidates(workflow(k), Resources(2), BatchShape(16, 4), profile)
        assert (ranked[0].name, ranked[0].predicted_s) == (first, pytest.approx(best_s)), k


def _named(name: str) -> Stage:
    stage = Stage()
    stage.name = name
    return stage


def test_simulated_overlapping_groups_take_turns_on_their_slots():
    """a (slot 0) -> b (slot 1) -> learn (both slots), 1 s per call, 4 micro-batches: b's outputs
    are ready at 2, 3, 4 and 5 s, but learn's replica 0 may start only when a's turn on slot 0
    ends (4 s) and replica 1 when b's ends (5 s): four calls end at 7 s, not at 6 as they would on
    slots of their own. The search offers that placement, and ``rlinf plan``'s syntax parses back."""
    wf = Workflow("w3").chain(_named("a"), _named("b"), _named("learn")).role("train", "learn")
    p = Profile("w3", message_s=0.0, stages={s: StageCost(1.0, 0.0) for s in ("a", "b", "learn")})
    shape = BatchShape(16, 4, 4)
    plan = HybridStrategy(placement="learn: 0-1, a: 0, b: 1").plan(wf, Resources(2), shape)
    assert simulate(wf, plan, p, 16) == pytest.approx(7.0)
    apart = HybridStrategy(placement="learn: 2-3, a: 0, b: 1").plan(wf, Resources(4), shape)
    assert simulate(wf, apart, p, 16) == pytest.approx(6.0)
    ranked = candidates(wf, Resources(2), BatchShape(16, 4), p)
    overlapping = [c for c in ranked if c.name == "overlapping"]
    assert [c.placement for c in overlapping[:1]] == ["learn: 0-1, a: 0, b: 1"]
    assert parse_placement(overlapping[0].placement, 2, wf.stages) == [
        (["learn"], [0, 1]),
        (["a"], [0]),
        (["b"], [1]),
    ]


def test_a_replica_over_several_slots_is_predicted_from_its_measured_speedup_only():
    wf = SleepTask().build_workflow(None, None)
    plan = STRATEGIES.get("collocated")(replicas=1).plan(wf, Resources(2), BatchShape(BATCH, UNIT, 16))
    p = Profile(
        "sleepers", message_s=0.0, stages={"gen": StageCost(0.0, 0.001), "learn": StageCost(0.0, 0.0005)}
    )
    with pytest.raises(ValueError, match=r"group\(s\) \['all'\] have replicas spanning several slots"):
        simulate(wf, plan, p, BATCH)
    p.speedup = {"2": {"gen": 2.0, "learn": 1.0}}  # gen twice as fast on two slots, learn not at all
    assert simulate(wf, plan, p, BATCH) == pytest.approx(BATCH * 0.001 / 2 + BATCH * 0.0005)
    # re-fitting from that replica's own calls takes them back to one slot: 10 ms there is 20 ms here
    p.add_spans([Span("all/0", "gen", "process", 0.0, 0.01, 16)], 16, widths={"gen": 2})
    assert p.points["gen"] == [(16, pytest.approx(0.02))]


def test_a_stage_that_works_at_the_end_of_the_iteration_is_sped_up_by_its_end():
    """The embodied actor buffers in its calls (microseconds) and trains in ``end_iteration``.
    Profiled on one slot (the first iteration, set-up and all: its end kept out of the fit) and
    then on two, its speed-up is its end's: 1.0 s against 0.5 s is 2, and the wide end taken back
    to one slot is 1.0 s. Counting the calls alone said 1, and a 21 M-parameter VLA's update was
    predicted at its two-thread time on one core (6.5 s against 11.5 s measured)."""

    def iteration(end: float) -> list[Span]:
        calls = [Span("all/0", "learn", "process", 0.01 * i, 0.01 * i + 1e-6, 16) for i in range(4)]
        return [*calls, Span("all/0", "learn", "end_iteration", 1.0, 1.0 + end)]

    p = Profile("embodied")
    p.add_spans(iteration(1.0), 16, skip_first=True)
    p.refit()
    assert p.stages["learn"].end_s == 0.0 and p.first_end_s == {"learn": 1.0}
    p.add_speedup(2, iteration(0.5), 16)
    assert p.speedup["2"]["learn"] == pytest.approx(2.0, rel=1e-3)
    p.add_spans(iteration(0.5), 16, widths={"learn": 2})
    p.refit()
    assert p.stages["learn"].end_s == pytest.approx(1.0, rel=1e-3)
    assert Profile.from_dict(p.to_dict()).first_end_s == {"learn": 1.0}


def test_a_learner_that_trains_at_the_end_is_predicted_by_its_share_of_the_samples():
    """``Stage.end_per_sample``: two data-parallel replicas each train on half the samples at the
    end of the iteration, so each takes half the one-worker end (a fixed optimizer step would
    not); and a replica's measured end, taken back to the whole iteration, is what one worker takes."""
    wf = SleepTask().build_workflow(None, None)
    p = Profile("sleepers", message_s=0.0, stages={"gen": StageCost(0.0, 0.0), "learn": StageCost(end_s=1.0)})
    two = STRATEGIES.get("collocated")(replicas=2).plan(wf, Resources(2), BatchShape(BATCH, UNIT, 16))
    assert simulate(wf, two, p, BATCH) == pytest.approx(1.0)  # a fixed cost per iteration
    wf.stages["learn"].end_per_sample = True
    assert simulate(wf, two, p, BATCH) == pytest.approx(0.5)
    spans = [
        *(Span(f"all/{r}", "learn", "process", i, i + 1e-6, 16) for r in (0, 1) for i in range(2)),
        Span("all/0", "learn", "end_iteration", 1.0, 1.5),
        Span("all/1", "learn", "end_iteration", 1.0, 1.6),
    ]
    measured = Profile("sleepers")
    measured.add_spans(spans, 16, per_sample_ends={"learn"})
    assert measured.end_samples["learn"] == [pytest.approx(1.0)]  # the faster replica's, x 2


def test_profile_round_trips_through_json(tmp_path):
    p = Profile("w", stages={"a": StageCost(0.1, 0.2, 0.3, [8])}, sync_s={"a": 0.01}, launch_s=2.0)
    p.launch_estimated, p.inprocess_launch_s, p.speedup = True, 0.2, {"2": {"a": 1.5}}
    p.points = {"a": [(8, 1.7)]}
    assert Profile.load(p.save(tmp_path / "p.json")).to_dict() == p.to_dict()
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="bad.json: not a readable profile"):
        Profile.load(tmp_path / "bad.json")


# measured on the wall clock (sleeping stages), so a benchmark more than a test: `-m slow`. The
# default run checks the prediction on a fake clock (the simulated schedules above and the
# hand-timed iterations below) and that auto profiles and reports (test_one_granularity_...).
@pytest.mark.slow
def test_auto_profiles_predicts_within_15_percent_and_reports_it(tmp_path):
    trainer, rec = _fit(tmp_path, "auto", iterations=8)
    assert (tmp_path / "profile.json").is_file()
    # starting two in-process replicas costs next to nothing and halves the iteration: taken
    assert len(trainer.plan.workers) == 2 and trainer.plan.launcher is None
    tuned = [r for r in rec.rows if "auto/predicted_s" in r]
    assert [r["iteration"] for r in tuned] == list(range(4, 9))  # 3 profiling iterations
    errors = [abs(r["auto/measured_s"] - r["auto/predicted_s"]) / r["auto/measured_s"] for r in tuned]
    assert sorted(errors)[len(errors) // 2] < 0.15, errors


def _iteration(mb: int, t: float, slow: float = 1.0) -> tuple[float, list[Span]]:
    """One iteration of the sleepers on one worker at ``mb`` samples per message, costs as
    ``SleepTask`` sets them (``slow`` times each call): its seconds and its spans."""
    spans, t0 = [], t
    for _ in range(BATCH // mb):
        for stage, a, b in (("gen", 0.0005, 0.001), ("learn", 0.0005, 0.0006)):
            spans.append(Span("all/0", stage, "process", t, t + slow * (a + b * mb), mb))
            t = spans[-1].end
    for stage, kind, d in (("learn", "end_iteration", 0.002), ("learn", "sync_state", 0.0005)):
        spans.append(Span("all/0", stage, kind, t, t + d))
        t += d
    spans.append(Span("all/0", "gen", "apply_sync", t, t + 0.0005))
    return t + 0.0005 - t0 + 0.001, spans


@pytest.mark.parametrize("iterations, moves", [(10, False), (1000, True)])
def test_auto_moves_to_worker_processes_only_when_the_run_repays_their_start(tmp_path, iterations, moves):
    """One in-process worker takes ~0.1 s per iteration, two replicas would take half; starting
    worker processes costs 2 s. Over 7 remaining iterations that never pays (auto stays in this
    process); over 997 it does (auto moves to the trainer's launcher, data-parallel)."""
    wf = SleepTask().build_workflow(None, None)
    auto = AutoStrategy(launch_s=2.0, save_profile="")
    plan = auto.plan(wf, Resources(2), BatchShape(BATCH, UNIT))
    assert plan.launcher == "inprocess" and len(plan.workers) == 1  # profiles in this process
    auto.on_launch(RunInfo(tmp_path, iterations, 0.01, separate_processes=True))
    t, replan = 0.0, None
    for it in (1, 2, 3, 4):  # the 4th if the worker on both slots is timed again before narrowing
        mb = plan.micro_batch_size[wf.source_edge.channel]
        seconds, spans = _iteration(mb, t)
        t += seconds
        replan = auto.observe(it, seconds, spans, mb, queued=False)
        if it < 3:
            assert replan is not None and replan.plan.launcher == "inprocess", it
            plan = replan.plan
            if it == 2:  # the same worker on both slots, for its speed-up
                assert plan.groups[0].slots == [0, 1]
                auto.on_relaunch(RunInfo(tmp_path, iterations, 0.01, separate_processes=True))
        elif not auto._profiling:
            break
    if moves:
        assert replan is not None and replan.plan.launcher is None and len(replan.plan.workers) == 2
    else:
        assert replan is None or replan.plan.launcher == "inprocess"
        # the in-process worker takes one slot or both in place: no start-up either way
        narrow_or_wide = [c for c in auto.ranked if c.plan.launcher == "inprocess"]
        assert len(narrow_or_wide) >= 2 and {auto._start_s(c) for c in narrow_or_wide} == {0.0}


@pytest.mark.parametrize("second", [0.6, 3.0])
def test_a_narrower_worker_is_taken_only_after_a_second_wide_iteration_agrees(tmp_path, second):
    """The worker on both slots ran its first iteration 3x slow (a one-off set-up), so the worker
    on one slot looks faster: auto times the wide worker again before narrowing it, and narrows
    only when the second iteration agrees (3x slow again), not when it ran faster than on one
    slot (0.6x)."""
    wf = SleepTask().build_workflow(None, None)
    auto = AutoStrategy(launch_s=100.0, save_profile="")
    plan = auto.plan(wf, Resources(2), BatchShape(BATCH, UNIT))
    auto.on_launch(RunInfo(tmp_path, 10, 0.01, separate_processes=True))
    t = 0.0
    for it, slow in ((1, 1.0), (2, 1.0), (3, 3.0), (4, second)):
        mb = plan.micro_batch_size[wf.source_edge.channel]
        seconds, spans = _iteration(mb, t, slow=slow)
        t += seconds
        replan = auto.observe(it, seconds, spans, mb, queued=False)
        if it < 3:
            plan = replan.plan
        if it == 3:
            assert replan is None and auto.holds_after(3)  # timed again on both slots first
    narrowed = replan is not None and replan.plan.groups[0].slots == [0]
    assert narrowed == (second == 3.0)


def test_a_short_run_never_starts_a_worker_process(tmp_path):
    """Given the processes launcher, auto measures and (the run being too short to repay a
    process start) trains in this very process: every iteration's learner ran here."""
    auto = {"class_path": "rlinf_lightning.strategies.AutoStrategy", "init_args": {"launch_s": 30.0}}
    trainer, rec = _trainer(tmp_path, auto, iterations=5, launcher="processes")
    trainer.fit(_Policy(), SleepTask())
    assert [r["learn/pid"] for r in rec.rows] == [os.getpid()] * 5
    assert trainer.plan.launcher == "inprocess"


# the wall clock again (a plan measured against its prediction): `-m slow`, as the test above
@pytest.mark.slow
@pytest.mark.parametrize("max_staleness", [0, 1])
def test_a_plan_auto_never_ran_is_predicted_from_its_profile(tmp_path, max_staleness):
    """Out of sample: auto profiles one worker; from the profile it saved, before it runs, the
    disaggregated plan (gen | learn on their own slots: pipelined by micro-batch, and with a
    lagged sync each rolling out the next iteration while the other trains) is predicted within
    20% (gen 66 ms, learn 38 ms and a 40 ms step: about 0.12 s synchronous, 0.08 s lagged)."""
    trainer, _ = _trainer(tmp_path / "auto", "auto", iterations=3, max_staleness=max_staleness)
    trainer.fit(_Policy(), SleepTask(step_s=0.04))
    profile = Profile.load(tmp_path / "auto" / "profile.json")
    trainer, rec = _trainer(tmp_path / "fixed", "disaggregated", iterations=8, max_staleness=max_staleness)
    predicted = simulate(*trainer.build_plan(_Policy(), SleepTask()), profile, BATCH)
    trainer.fit(_Policy(), SleepTask(step_s=0.04))
    measured = statistics.median(r["time/iteration"] for r in rec.rows[3:])
    assert abs(measured - predicted) / measured < 0.2, (measured, predicted)


def test_retuning_switches_granularity_within_three_iterations_of_a_cost_change(tmp_path):
    """The generator's per-call cost jumps from 0.5 ms to 50 ms at iteration 8: small micro-batches
    (short pipeline fill) were best; now few large ones are (the per-call cost dominates).

    Both stages cost 3 ms a sample, so that the choice survives the runtime's own cost per
    message (about 5 ms on a loaded CI machine; at 1 ms a sample it made 32 best before the
    change). With c the cost of a call beyond its samples, 16 beats 32 by 48 ms - 2c before the
    change (c about 1-10 ms) and 32 beats 16 by 2c - 48 ms after it (c above 50 ms)."""
    change = 8
    strategy = {
        "class_path": "rlinf_lightning.strategies.AutoStrategy",
        "init_args": {"placements": ["split"], "retune_patience": 1},
    }
    task = {"change_at": change, "per_sample_s": (0.003, 0.003), "a_after": 0.05}
    trainer, rec = _fit(tmp_path, strategy, iterations=change + 5, **task)
    mb = {int(r["iteration"]): int(r["auto/micro_batch"]) for r in rec.rows if "auto/micro_batch" in r}
    assert mb[change - 1] <= 16, mb
    switched = [it for it in range(change, change + 4) if mb[it] >= 32]
    assert switched and switched[0] <= change + 3, mb
    assert all(mb[it] >= 32 for it in range(switched[0], change + 5)), mb


def test_rlinf_plan_ranks_a_cluster_from_a_saved_profile(assets, tmp_path, capsys):
    from rlinf_lightning.cli import main
    from rlinf_lightning.flow.placement import parse_placement

    stages = ("rollout", "reward", "advantage", "inference", "actor")
    prof = Profile("reasoning", message_s=0.001, launch_s=5.0)
    prof.stages = {s: StageCost(0.002, 0.0003) for s in stages}
    prof.stages["actor"] = StageCost(0.03, 0.0002, end_s=0.005)
    path = prof.save(tmp_path / "profile.json")
    argv = ["plan", "--config", "configs/math_grpo_tiny.yaml", "--profile", str(path)]
    argv += ["--policy.model_path", str(assets["sft"]), "--task.train_path", str(assets["train"])]
    argv += ["--task.test_path", str(assets["test"])]
    assert main([*argv, "--devices", "8", "--num_nodes", "2", "--speedup", "{rollout: 2.0}"]) == 0
    out = capsys.readouterr().out
    assert "plans for 2 node(s) x 8 device(s)" in out and " 1. " in out and " 5. " in out
    placement = next(ln for ln in out.splitlines() if ln.startswith("placement: "))[len("placement: ") :]
    groups = parse_placement(placement, 16, stages)
    assert sorted(s for names, _ in groups for s in names) == sorted(stages)
    assert int(next(ln for ln in out.splitlines() if ln.startswith("micro_batch_size: ")).split()[-1]) > 0

    (tmp_path / "broken.json").write_text("{")
    assert main([*argv[:3], "--profile", str(tmp_path / "broken.json"), *argv[5:]]) == 2
    assert "broken.json: not a readable profile" in capsys.readouterr().err


@pytest.mark.parametrize(
    "iterations, background, ahead", [(10, True, False), (1000, True, True), (1000, False, False)]
)
def test_auto_starts_the_chosen_workers_ahead_once_profiled_and_switches_when_they_are_up(
    tmp_path, iterations, background, ahead
):
    """Nothing starts beside the profiling iterations (on CPU it would take the cores they
    measure). Once profiled, a run long enough to repay worker processes starts them in the
    background where the launcher can, and trains on in this process, comparing nothing, until
    an iteration ends with them up; without a background start it switches at once; a short run
    never starts them."""
    wf = SleepTask().build_workflow(None, None)
    auto = AutoStrategy(launch_s=2.0, save_profile="")
    plan = auto.plan(wf, Resources(2), BatchShape(BATCH, UNIT))
    auto.on_launch(RunInfo(tmp_path, iterations, 0.01, separate_processes=True, background_start=background))
    t, replan = 0.0, None
    for it in (1, 2, 3):
        assert auto.ahead() is None, it
        mb = plan.micro_batch_size[wf.source_edge.channel]
        seconds, spans = _iteration(mb, t)
        t += seconds
        replan = auto.observe(it, seconds, spans, mb, queued=False)
        if it < 3:
            plan = replan.plan
    if not ahead:
        moved = replan is not None and replan.plan.launcher is None
        assert moved == (iterations == 1000) and auto.ahead() is None
        return
    started = auto.ahead()
    assert started is not None and started.launcher is None and len(started.workers) == 2
    assert replan is None or replan.plan.launcher == "inprocess"  # a granularity change at most
    assert auto.holds_after(3)  # so that the switch can follow any iteration
    mb = (replan.plan if replan else plan).micro_batch_size[wf.source_edge.channel]
    slow, spans = _iteration(mb, t, slow=3.0)  # sharing the cores with their start-up
    assert auto.observe(4, slow, spans, mb, queued=False) is None  # not up, and no drift counted
    assert auto._drift == 0
    switch = auto.observe(5, slow, spans, mb, queued=False, ahead_ready=True)
    assert switch is not None and switch.plan.layout() == started.layout()
    assert auto.ahead() is None
    # on the new workers: the first iteration pays their set-up and is not compared; the next is
    auto.observe(6, 10 * slow, spans, mb, queued=False)
    assert auto._drift == 0
    auto.observe(7, 10 * slow, spans, mb, queued=False)
    assert auto._drift == 1


class _SwitchAhead(Strategy):
    """One in-process worker; asks for two collocated worker processes ahead after iteration 1
    and switches to them after iteration 3."""

    def plan(self, workflow, resources, batch):
        from rlinf_lightning.strategies.auto.search import one_worker_plan

        self.target = STRATEGIES.get("collocated")().plan(workflow, resources, batch)
        self.it, self.launch_s = 0, None
        return one_worker_plan(workflow, resources, batch, 1)

    def holds_after(self, iteration):
        return iteration <= 3

    def observe(self, iteration, seconds, spans, micro_batch, queued, ahead_ready=False):
        self.it = iteration
        return Replan(self.target, "test") if iteration == 3 else None

    def ahead(self):
        return self.target if self.it < 3 else None

    def on_relaunch(self, info):
        self.launch_s = info.launch_s


def test_a_switch_takes_the_workers_started_ahead(tmp_path):
    """The switch after iteration 3 waits only for what is left of the start-up begun after
    iteration 1, and the workers started then train the rest."""
    strategy = _SwitchAhead()
    trainer, rec = _trainer(tmp_path, strategy, iterations=6, launcher="processes")
    summary = trainer.fit(_Policy(), SleepTask())
    assert [r["learn/pid"] == os.getpid() for r in rec.rows] == [True] * 3 + [False] * 3
    assert rec.rows[-1]["learn/steps"] == 6  # the training state came along
    assert 0.0 < summary["replan_s"] < strategy.launch_s, (summary["replan_s"], strategy.launch_s)


class _AheadThenStay(AutoStrategy):
    """Asks for worker processes ahead after iterations 1-2, then for none: they must stop."""

    def ahead(self):
        if self.seen[-1].iteration <= 2:
            return STRATEGIES.get("collocated")().plan(self.workflow, self.resources, self.batch)
        return None


def test_workers_started_ahead_and_not_taken_are_stopped(tmp_path, caplog):
    import multiprocessing

    caplog.set_level("INFO", logger="rlinf_lightning")
    trainer, rec = _trainer(tmp_path, _AheadThenStay(launch_s=60.0, save_profile=""), 6, "processes")
    trainer.fit(_Policy(), SleepTask())
    assert caplog.text.count("starting ahead, in the background") == 1
    assert trainer.plan.launcher == "inprocess"  # never switched to them
    assert multiprocessing.active_children() == []


class StickyGenerator(Generator):
    """The generator as an env stage is: state per micro-batch, so one granularity."""

    sticky = True


def test_one_granularity_is_profiled_in_two_iterations(tmp_path):
    """A sticky first stage runs at one micro-batch size: iteration 1 on one slot, iteration 2
    on every slot gives the speed-up and the end-of-iteration costs; the plan follows at 3."""
    trainer, rec = _trainer(tmp_path, "auto", iterations=5)
    trainer.fit(_Policy(), SleepTask(gen=StickyGenerator))
    assert [r["iteration"] for r in rec.rows if "auto/predicted_s" in r] == [3, 4, 5]
    profile = Profile.load(tmp_path / "profile.json")
    assert set(profile.speedup["2"]) == {"gen", "learn"}
    assert profile.stages["learn"].end_s > 0 and profile.sync_s  # from the wide iteration


def test_the_in_process_worker_takes_a_wider_or_narrower_plan_in_place():
    """Auto's profiling worker widened to every slot (or narrowed back) keeps its workers, set-up
    and state: only torch's threads change. Another grouping (two replicas) needs new workers."""
    from rlinf_lightning.launchers.inprocess import InProcessLauncher
    from rlinf_lightning.strategies.auto.search import one_worker_plan

    wf, resources, shape = SleepTask().build_workflow(None, None), Resources(2), BatchShape(BATCH, UNIT, 16)
    narrow, wide = (one_worker_plan(wf, resources, shape, width) for width in (1, 2))
    before = torch.get_num_threads()
    runtime = InProcessLauncher().launch(wf, narrow, timeout_s=30)
    try:
        workers = dict(runtime.objects)
        assert runtime.adopt(wide) and runtime.objects == workers and runtime.plan is wide
        assert torch.get_num_threads() == wide.groups[0].num_threads
        assert runtime.adopt(narrow) and torch.get_num_threads() == narrow.groups[0].num_threads
        assert not runtime.adopt(STRATEGIES.get("collocated")().plan(wf, resources, shape))
    finally:
        runtime.shutdown()
        torch.set_num_threads(before)


def test_cost_curves_give_the_profile_and_scaling_they_state():
    """gen: per-call seconds at two sample counts (a line); learn: seconds per iteration at 1 and
    2 devices (2 devices take 0.040 s, not the 0.032 s of perfect scaling: each call costs 1.25x)."""
    from rlinf_lightning.strategies.auto.curves import profile_from_curves

    wf = SleepTask().build_workflow(None, None)
    curves = {
        "message_s": 0.0,
        "stages": {"gen": {"call_s": {4: 0.005, 16: 0.017}}, "learn": {"devices": {1: 0.064, 2: 0.040}}},
    }
    p = profile_from_curves(curves, wf, BATCH)
    assert p.stages["gen"].a == pytest.approx(0.001) and p.stages["gen"].b == pytest.approx(0.001)
    assert p.stages["learn"].call_s(8) == pytest.approx(0.008)
    assert [p.replicas_factor("learn", n) for n in (1, 2, 4)] == pytest.approx([1.0, 1.25, 1.5])
    assert p.replicas_factor("gen", 8) == 1.0  # no device curve: scales as simulated
    # collocated over 2 slots: each replica runs 4 micro-batches of 8 through gen, then learn at 1.25x
    plan = STRATEGIES.get("collocated")().plan(wf, Resources(2), BatchShape(BATCH, UNIT, 8))
    assert simulate(wf, plan, p, BATCH) == pytest.approx(4 * 0.009 + 4 * 0.008 * 1.25)


@pytest.mark.parametrize(
    "curves, message",
    [
        ({"stages": {"gen": {"call_s": {4: 0.005}}}}, r"stages \['learn'\] have no curve"),
        (
            {"stages": {"gen": {"call_s": {4: 0.1}}, "learn": {"devicez": {1: 1.0}}}},
            r"stages.learn: expected",
        ),
        (
            {"stages": {"gen": {"call_s": {0: 0.1}}, "learn": {"end_s": 1}}},
            r"stages.gen.call_s: sample counts",
        ),
        (
            {"stages": {"gen": {"call_s": {4: -1}}, "learn": {"end_s": 1}}},
            r"stages.gen.call_s.4: expected sec",
        ),
        ({"stages": {"gen": {"call_s": {4: 1}}, "learn": {"end_s": 1}}}, r"stages.learn: needs call_s"),
        ({"stages": {"gen": {"call_s": {4: 1}}, "learn": {"devices": {1: 1}}, "x": {}}}, r"\['x'\] not in"),
        ({"workflow": "other", "stages": {}}, r"workflow 'other'; this config's is 'sleepers'"),
        ({"stage": {}}, r"unknown keys \['stage'\]"),
    ],
)
def test_bad_cost_curves_are_refused_naming_the_key(curves, message):
    from rlinf_lightning.strategies.auto.curves import profile_from_curves

    with pytest.raises(ValueError, match=message):
        profile_from_curves(curves, SleepTask().build_workflow(None, None), BATCH)


def test_rlinf_plan_ranks_a_cluster_from_cost_curves(assets, tmp_path, capsys):
    from rlinf_lightning.cli import main
    from rlinf_lightning.flow.placement import parse_placement

    stages = ("rollout", "reward", "advantage", "inference", "actor")
    curves = tmp_path / "curves.yaml"
    curves.write_text(
        "accelerator: cuda\nsamples: 128\nstages:\n"
        "  rollout: {call_s: {16: 0.05, 64: 0.12}}\n  reward: {call_s: {64: 0.001}}\n"
        "  advantage: {call_s: {64: 0.0005}}\n  inference: {devices: {1: 0.4, 4: 0.12}}\n"
        "  actor: {devices: {1: 2.0, 2: 1.1, 4: 0.65}, end_s: 0.05}\n"
    )
    argv = ["plan", "--config", "configs/math_grpo_tiny.yaml", "--profile", str(curves)]
    argv += ["--policy.model_path", str(assets["sft"]), "--task.train_path", str(assets["train"])]
    argv += ["--task.test_path", str(assets["test"])]
    assert main([*argv, "--devices", "8"]) == 0
    out = capsys.readouterr().out
    assert "the device curves of inference, actor stop short of 8: extrapolated" in out
    placement = next(ln for ln in out.splitlines() if ln.startswith("placement: "))[len("placement: ") :]
    assert sorted(s for names, _ in parse_placement(placement, 8, stages) for s in names) == sorted(stages)

    curves.write_text(curves.read_text().replace("0.05", "fast"))
    assert main([*argv, "--devices", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    why = "stages.rollout.call_s.16: expected seconds (a number >= 0), got 'fast'"
    assert err == [f"rlinf plan: --profile {curves}: {why}"]


class _BreaksInItsOwnProcess(Learner):
    def setup(self, ctx) -> None:
        if ctx.own_process:
            raise RuntimeError("learner cannot start in a worker process")
        super().setup(ctx)


def test_workers_failing_to_start_ahead_end_the_run_at_the_switch_with_their_error(tmp_path):
    import multiprocessing

    from rlinf_lightning.flow.worker import StageError

    trainer, rec = _trainer(tmp_path, _SwitchAhead(), iterations=6, launcher="processes")
    with pytest.raises(StageError, match="learner cannot start in a worker process"):
        trainer.fit(_Policy(), SleepTask(learn=_BreaksInItsOwnProcess))
    assert len(rec.rows) == 3  # trained in this process until the switch
    assert multiprocessing.active_children() == []
