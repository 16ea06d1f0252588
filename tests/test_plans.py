"""Execution plans: the same workflow under every plan and launcher computes the same update, and a
plan's replicas are its processes and its train engine's ranks."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from tensordict import TensorDict

from rlinf_lightning import LMPolicy, RLTrainer
from rlinf_lightning.flow import BatchShape, Stage, Workflow
from rlinf_lightning.launchers import LAUNCHERS
from rlinf_lightning.strategies import STRATEGIES, CollocatedStrategy, HybridStrategy, Resources
from trainer_defaults import (
    DIFFERING,
    MetricsRecorder,
    launcher_matrix,
    scaled,
    tiny_task,
    tiny_trainer_kwargs,
    worker_processes,
)

LAUNCHER_NAMES = ["inprocess", "processes", "ray"]
HYBRID = "rollout,reward,advantage: 0, inference,actor: 1"
# RLinf's overlapping placement on two slots: the actor trains with ddp on both, the rollout and the
# rest take turns with its replicas, offloading (context switching) around each turn
OVERLAPPING = "actor: 0-1, rollout: 0, reward,advantage,inference: 1"
PLANS = {  # every plan gets the same two slots of one thread
    "collocated_1worker": CollocatedStrategy(replicas=1),
    "collocated": "collocated",  # two data-parallel replicas; the actor trains with ddp over both
    "disaggregated": "disaggregated",
    "hybrid": HybridStrategy(placement=HYBRID),
    "overlapping": HybridStrategy(placement=OVERLAPPING, offload=True),
}


KEYS = ("actor/loss", "actor/grad_norm", "reward/reward")


def _fit(assets, root, critic=None, keys=KEYS, task=None, **over):
    steps = MetricsRecorder(keys=keys)
    # float32: plans compute the same update exactly (under bf16 autocast, only up to its rounding)
    kw = tiny_trainer_kwargs(
        root, **{"devices": 2, "num_threads": 1, "callbacks": [steps], "precision": "32-true", **over}
    )
    trainer = RLTrainer(**kw)
    summary = trainer.fit(
        LMPolicy(str(assets["sft"]), lr=1e-3),
        # the format reward gives every iteration a learning signal, even where no answer is right
        tiny_task(
            assets,
            format_reward="number_format",
            format_weight=1.0,
            eval_size=8,
            critic=critic,
            **(task or {}),
        ),
    )
    ckpts = root / "run" / "checkpoints"
    weights = [load_file(str(p / "model.safetensors")) for p in sorted(ckpts.glob("iter-*"))]
    return trainer, summary, steps.metrics, weights


def _maxdiff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a.keys() & b.keys())


def _assert_same_metrics(metrics: list[dict], ref: list[dict], what: tuple) -> None:
    """Each iteration's metrics equal the reference's within float32 rounding: 1e-3, relative
    above 1. Sums taken in another order (two replicas, another thread count in a worker process)
    drift by the third iteration: a grad norm near 3.4 by 1.6e-4, the critic plan's near 3.56 by
    2.5e-4 under `processes` and `ray`; a lost or doubled replica's gradient moves it by tens of
    percent."""
    for it in range(3):
        for key, value in metrics[it].items():
            want = ref[it][key]
            assert abs(value - want) <= 1e-3 * max(1.0, abs(want)), (*what, it, key, value, want)


@pytest.fixture(scope="module")
def reference(assets, tmp_path_factory):
    """Three iterations of the one-worker collocated plan: the baseline every plan must equal."""
    root = tmp_path_factory.mktemp("reference")
    _, _, metrics, weights = _fit(assets, root, strategy=PLANS["collocated_1worker"], ckpt_every=1)
    base = load_file(str(assets["sft"] / "model.safetensors"))
    assert len(weights) == 3 and _maxdiff(weights[0], base) > 1e-4  # it did learn
    assert all(m["actor/grad_norm"] > 0.1 for m in metrics), metrics  # from every iteration
    return metrics, weights


# ray's disaggregated fit runs in test_weights_broadcast_between_groups_equal_the_copied_ones[ray]
@pytest.mark.parametrize(("name", "launcher"), launcher_matrix(PLANS, differing={"ray": ()}))
def test_every_plan_computes_the_same_update_on_every_launcher(assets, tmp_path, reference, name, launcher):
    """Collocated with 1 and 2 replicas, disaggregated, an explicit hybrid placement and the
    overlapping one, run as configs run them (``ckpt_every=0``: each iteration queued while the
    previous one finishes): loss, grad norm and reward equal the reference's (which checkpointed, so
    idled, after every iteration) at each of three iterations, and so do the final weights (one
    AdamW step moves each weight by about lr x sign(grad), so only several steps can show a wrong
    gradient scale; the rewards of iterations 2 and 3 come from the weights synced after 1 and 2)."""
    ref_metrics, ref_weights = reference
    trainer, _, metrics, weights = _fit(
        assets, tmp_path / name, strategy=PLANS[name], launcher=launcher, ckpt_every=0
    )
    assert len(weights) == 1 and len(metrics) == 3, name  # the final checkpoint only
    assert weights[0].keys() == ref_weights[-1].keys()
    assert _maxdiff(weights[0], ref_weights[-1]) <= 1e-4, (name, launcher)
    _assert_same_metrics(metrics, ref_metrics, (name, launcher))
    assert sorted({s for g in trainer.plan.groups for s in g.slots}) == [0, 1], name


# the processes launcher's own property: the differing plans by default, the rest with `-m slow`
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=() if n in DIFFERING["processes"] else pytest.mark.slow) for n in PLANS]
)
def test_the_actor_ranks_are_the_actor_groups_replicas(assets, tmp_path, name):
    """No plan starts more processes or torch threads than the slots its workers take turns on:
    under every plan the workers are the only processes, one per replica, pinned to their slots'
    cores, and the actor's ddp ranks are its group's replicas."""
    import os

    task = tiny_task(assets, eval_size=8)
    policy = LMPolicy(str(assets["sft"]), lr=1e-3)
    trainer = RLTrainer(**tiny_trainer_kwargs(tmp_path, devices=2, num_threads=1, strategy=PLANS[name]))
    workflow, plan = trainer.build_plan(policy, task)
    runtime = LAUNCHERS.get("processes")().launch(workflow, plan, timeout_s=scaled(60))
    try:
        inputs = task.inputs(1, plan.micro_batch_size["__input__->rollout"], trainer.run_spec)
        runtime.run_iteration(1, inputs)
        ranks = runtime.call("actor", "engine_info", replicas="all")
        spawned = [p.pid for p in worker_processes()]
    finally:
        runtime.shutdown()
    actor = plan.group_of("actor")
    pids = [info["pid"] for info in runtime.info.values()]
    assert sorted(spawned) == sorted(pids) and len(set(pids)) == sum(g.replicas for g in plan.groups), name
    held = [s for g in plan.groups for s in g.slots]  # 2 slots, each once unless workers take turns
    assert sum(info["torch_threads"] for info in runtime.info.values()) == len(held), name  # x 1 thread
    usable = sorted(os.sched_getaffinity(0))
    if len(usable) >= 2:  # each process pinned to its slots' cores: one core per slot
        pinned = [core for info in runtime.info.values() for core in info["cores"]]
        assert sorted(pinned) == sorted(usable[s] for s in held), name
    assert [r["rank"] for r in ranks] == list(range(actor.replicas)), name
    assert {r["world_size"] for r in ranks} == {actor.replicas}, name
    assert {r["engine"] for r in ranks} == {"ddp" if actor.replicas > 1 else "single"}, name


def test_trace_shows_overlap_only_when_disaggregated(assets, tmp_path):
    def spans(name):
        path = tmp_path / f"{name}.json"
        _fit(assets, tmp_path / name, strategy=PLANS[name], launcher="processes", trace=str(path),
             max_iterations=2, micro_batch_size=4)  # fmt: skip
        events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
        get = lambda name: [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] == name]  # noqa: E731
        return get("rollout"), get("actor")

    def overlap(a, b):
        return sum(max(0.0, min(x1, y1) - max(x0, y0)) for x0, x1 in a for y0, y1 in b)

    rollout, actor = spans("disaggregated")
    assert len(rollout) == 2 * 4 and len(actor) == 2 * 4  # one span per micro-batch
    assert overlap(rollout, actor) > 0
    rollout, actor = spans("collocated_1worker")
    assert overlap(rollout, actor) == 0


# -- a workflow with a loop: env -> policy -> env, T turns per iteration ------------------------------


class ToyEnv(Stage):
    """Each micro-batch is a set of envs (it keeps their state, so it is sticky): observe, then add
    the policy's action to the state each turn; after the last turn, emit the trajectory."""

    name = "env"
    sticky = True
    out_keys = ("env_id", "obs", "actions", "final")

    def __init__(self, turns: int) -> None:
        self.turns = turns

    def setup(self, ctx):
        self.state, self.trajectory = {}, {}

    def process(self, batch):
        ids = batch["env_id"]
        key = tuple(ids.tolist())
        if "action" not in batch.keys():
            self.state.setdefault(key, ids * 10)
            self.trajectory[key] = []
        else:
            self.state[key] = self.state[key] + batch["action"]
            self.trajectory[key].append(batch["action"])
            if len(self.trajectory[key]) == self.turns:
                actions = torch.stack(self.trajectory[key], 1)
                return TensorDict({"env_id": ids, "actions": actions, "final": self.state[key]}, [len(ids)])
        return TensorDict({"env_id": ids, "obs": self.state[key]}, [len(ids)])


class ToyPolicy(Stage):
    name = "policy"
    in_keys = ("env_id", "obs")
    out_keys = ("action",)

    def setup(self, ctx):
        self.w = 1

    def process(self, batch):
        return TensorDict(
            {"env_id": batch["env_id"], "action": (batch["obs"] * self.w) % 7}, batch.batch_size
        )

    def apply_sync(self, source, state):
        self.w = int(state["w"])


class ToyLearner(Stage):
    """Sums what every replica saw (a collective) and turns it into the policy's next weight."""

    name = "learner"
    in_keys = ("actions", "final")

    def setup(self, ctx):
        self.ctx, self.w = ctx, 1

    def begin_iteration(self, iteration):
        self.total = torch.zeros(1, dtype=torch.long)

    def process(self, batch):
        self.total += batch["final"].sum() + batch["actions"].sum()

    def end_iteration(self):
        self.ctx.all_reduce([self.total])
        self.w = int(self.total) // 10 % 3 + 1
        return {"total": float(self.total), "w": float(self.w)}

    def sync_state(self):
        return TensorDict({"w": torch.tensor(self.w)}, [])


def _loop_workflow(turns: int) -> Workflow:
    return (
        Workflow("toy-loop")
        .chain(ToyEnv(turns), ToyLearner())
        .add(ToyPolicy())
        .loop("env", "policy", turns)
        .sync("learner", "policy", "weights")
        .role("train", "learner")
    )


@pytest.mark.parametrize("launcher", [*LAUNCHER_NAMES[:2], pytest.param("ray", marks=pytest.mark.slow)])
def test_a_loop_workflow_gives_the_same_results_under_every_plan(launcher):
    """Also with overlapping groups (the learner on both slots, env and policy one each) and the
    next iteration queued while one runs: the workers on a shared slot take turns on it, so their
    calls on it never overlap in time, and every turn is bracketed by its onload and offload."""
    envs = [TensorDict({"env_id": torch.arange(4 * k, 4 * k + 4)}, [4]) for k in range(4)]
    results = {}
    plans = {"collocated": "collocated", "collocated_1worker": CollocatedStrategy(replicas=1)}
    overlapping = HybridStrategy(placement="learner: 0-1, env: 0, policy: 1", offload=True)
    for name, strategy in {**plans, "disaggregated": "disaggregated", "overlapping": overlapping}.items():
        wf = _loop_workflow(turns=3)
        wf.check_keys(["env_id"])
        plan = STRATEGIES.resolve(strategy).plan(
            wf, Resources(devices=2, threads_per_slot=1), BatchShape(16, 4)
        )
        plan.validate(wf, 2)
        runtime = LAUNCHERS.get(launcher)().launch(wf, plan, timeout_s=scaled(120))
        try:
            runtime.start_iteration(1, envs)
            for it in (2, 3, None):  # queued: iteration it starts before it - 1 is collected
                if it is not None:
                    runtime.start_iteration(it, envs)
                results.setdefault(name, []).append(runtime.finish_iteration()["learner"])
            spans = runtime.pop_spans()
        finally:
            runtime.shutdown()
        env_calls = sum(s.samples for s in spans if s.stage == "env" and s.kind == "process")
        assert env_calls == 3 * 16 * (1 + 3)  # per iteration, every env: one observation, then 3 turns
        if name == "overlapping":
            for slot, workers in ((0, ("env/0", "learner/0")), (1, ("policy/0", "learner/1"))):
                a, b = ([(s.start, s.end) for s in spans if s.worker == w] for w in workers)
                assert a and b and not any(min(x1, y1) > max(x0, y0) for x0, x1 in a for y0, y1 in b), slot
            kinds = [s.kind for s in sorted(spans, key=lambda s: s.start) if s.worker == "learner/0"]
            switches = [k for k in kinds if k in ("onload", "offload")]  # the first: offloaded at setup
            assert switches == ["offload"] + ["onload", "offload"] * 3, kinds
    assert results["collocated"] == results["collocated_1worker"] == results["disaggregated"]
    assert results["overlapping"] == results["collocated"]
    assert len({r["w"] for r in results["collocated"]}) > 1  # the weight synced back each iteration changed


def test_overlapping_groups_that_would_deadlock_are_refused_before_start():
    """The env and the policy answer each other every step (a loop): on one slot in two groups
    the env's turn would wait for the policy's, which waits for the env's to end."""
    wf = _loop_workflow(turns=3)
    strategy = HybridStrategy(placement="env: 0, policy: 0-1, learner: 1")
    plan = strategy.plan(wf, Resources(devices=2, threads_per_slot=1), BatchShape(16, 4))
    with pytest.raises(ValueError, match=r"slot 0 is shared, and env \(group 'env', replica 0\) takes its "
                       r"turn on it before policy \(group 'policy', replica 0\) but waits on it.*"
                       r"deadlock; place those stages in one group, or on disjoint slots"):  # fmt: skip
        plan.validate(wf, 2)
    assert "slot 1 shared; its workers take turns each iteration: policy/1 -> learner/0" in plan.describe(wf)


def test_offload_context_switching_changes_nothing_but_memory(assets, tmp_path):
    _, _, _, plain = _fit(assets, tmp_path / "plain", strategy="collocated", devices=1, max_iterations=2)
    trainer, _, _, offl = _fit(
        assets, tmp_path / "offload", strategy="collocated_offload", devices=1, max_iterations=2
    )
    assert trainer.plan.groups[0].context_switch
    assert all(torch.equal(plain[-1][k], offl[-1][k]) for k in plain[-1])


def test_offloader_spill_file_holds_state_and_leaves_nothing_on_disk(tmp_path):
    from rlinf_lightning.engines.offload import Offloader

    model = torch.nn.Linear(64, 32)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def moments() -> list[torch.Tensor]:
        return [v for st in opt.state.values() for v in st.values() if v.dim()]

    saved = [v.clone() for v in moments()]
    off = Offloader("cpu", spill_dir=str(tmp_path))
    off.offload(model, opt)
    assert model.weight.numel() == 0 and not list(tmp_path.iterdir())  # unlinked while open
    off.onload(model, opt)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(a, b) for a, b in zip(saved, moments(), strict=True))


@pytest.mark.parametrize("launcher", LAUNCHER_NAMES)
def test_weights_broadcast_between_groups_equal_the_copied_ones(assets, tmp_path, reference, launcher):
    """The broadcast sync transport (a process group from the actor's replica to the rollout's;
    NCCL on GPU, the default there) exercised on CPU with gloo: the same updates as the copy."""
    from rlinf_lightning.strategies import DisaggregatedStrategy

    class BroadcastingDisaggregated(DisaggregatedStrategy):
        def plan(self, workflow, resources, batch):
            plan = super().plan(workflow, resources, batch)
            plan.sync_transport = "broadcast"
            return plan

    trainer, _, metrics, weights = _fit(
        assets,
        tmp_path,
        strategy=BroadcastingDisaggregated(),
        launcher=launcher,
        ckpt_every=1,
        trace=str(tmp_path / "t.json"),
    )
    ref_metrics, ref_weights = reference
    for it in range(3):
        assert _maxdiff(weights[it], ref_weights[it]) <= 1e-4, (launcher, it)
    kinds = {e["cat"] for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"] if e["ph"] == "X"}
    assert {"sync_broadcast", "sync_receive"} <= kinds


SEVERAL_UPDATES = {  # 2 epochs x 2 mini-batches of 2 prompt groups: 4 optimizer steps per iteration
    "algorithm": "reinforce_plus_plus_baseline",  # whitened over the batch, a KL to the reference
    "ppo_epochs": 2,
    "num_mini_batches": 2,
}


@pytest.fixture(scope="module")
def several_updates_reference(assets, tmp_path_factory):
    from rlinf_lightning.algorithms import ALGORITHMS

    name = SEVERAL_UPDATES["algorithm"]
    algorithm = ALGORITHMS.get(name)(**{k: v for k, v in SEVERAL_UPDATES.items() if k != "algorithm"})
    root = tmp_path_factory.mktemp("several_updates")
    _, _, metrics, weights = _fit(
        assets, root, strategy=PLANS["collocated_1worker"], ckpt_every=1, algorithm=algorithm
    )
    optimizer = torch.load(root / "run" / "checkpoints" / "iter-000003" / "optimizer.pt", weights_only=False)
    steps = {int(s["step"]) for s in optimizer["state"].values()}
    assert steps == {3 * 4}, steps  # every mini-batch of every epoch of every iteration stepped
    assert all(m["actor/grad_norm"] > 0.1 for m in metrics), metrics
    return algorithm, metrics, weights


@pytest.mark.parametrize(
    ("name", "launcher"),
    launcher_matrix([n for n in PLANS if n != "collocated_1worker"], launchers=("inprocess", "processes")),
)
def test_several_updates_per_batch_are_the_same_under_every_plan(
    assets, tmp_path, several_updates_reference, name, launcher
):
    """ppo_epochs > 1 and several mini-batches: each mini-batch (whole prompt groups, the same
    under every plan) is one optimizer step dividing by its own count over every replica, the
    behaviour log-probs are taken before the first step and the whitening sums over replicas; so
    loss, grad norm and reward per iteration and the final weights equal the one-worker run's."""
    algorithm, ref_metrics, ref_weights = several_updates_reference
    _, _, metrics, weights = _fit(
        assets, tmp_path / name, strategy=PLANS[name], launcher=launcher, ckpt_every=0, algorithm=algorithm
    )
    assert _maxdiff(weights[0], ref_weights[-1]) <= 1e-4, (name, launcher)
    _assert_same_metrics(metrics, ref_metrics, (name, launcher))


#: PPO with a critic on its own stage: 2 epochs x 2 mini-batches, so 4 steps of each model per iteration
CRITIC_KEYS = ("actor/loss", "actor/grad_norm", "critic/loss", "critic/grad_norm", "reward/reward")
CRITIC_PLANS = {  # as PLANS, with the critic in the advantage stage's place: the hybrid places it
    # apart from the actor, the overlapping plan on the slot it shares with one actor replica
    **PLANS,
    "hybrid": HybridStrategy(placement="rollout,reward,critic: 0, inference,actor: 1"),
    "overlapping": HybridStrategy(placement=OVERLAPPING.replace("advantage", "critic"), offload=True),
}


def _critic_state(root) -> dict:
    last = sorted((root / "run" / "checkpoints").glob("iter-*"))[-1]
    return torch.load(last / "stages" / "critic.pt", weights_only=True)["engine"]


@pytest.fixture(scope="module")
def critic_reference(assets, tmp_path_factory):
    from rlinf_lightning.algorithms import PPO
    from rlinf_lightning.policies import ValueModel

    algorithm, critic = PPO(update_epochs=2, num_minibatches=2), ValueModel(lr=1e-3)
    root = tmp_path_factory.mktemp("critic")
    _, _, metrics, weights = _fit(
        assets,
        root,
        critic=critic,
        keys=CRITIC_KEYS,
        strategy=PLANS["collocated_1worker"],
        ckpt_every=1,
        algorithm=algorithm,
    )
    state = _critic_state(root)
    assert {int(s["step"]) for s in state["optimizer"]["state"].values()} == {3 * 4}  # every step taken
    assert all(m["critic/grad_norm"] > 0 and m["actor/grad_norm"] > 0.1 for m in metrics), metrics
    assert float(state["model"]["head.weight"].abs().max()) > 0  # the critic learned (from a zero head)
    return algorithm, critic, metrics, weights, state["model"]


# several minutes per launcher here (three plans, each with a critic of its own): the default run
# keeps the in-process launcher; the others run with `-m slow`
@pytest.mark.parametrize(
    "launcher", ["inprocess", *(pytest.param(n, marks=pytest.mark.slow) for n in LAUNCHER_NAMES[1:])]
)
def test_the_critics_updates_are_the_same_under_every_plan(assets, tmp_path, critic_reference, launcher):
    """PPO with a critic (its own stage and train engine; under the hybrid plan on a slot apart
    from the actor), queued iterations: the actor's and the critic's loss and grad norm per
    iteration, the final actor weights and the final critic weights equal the one-worker run's."""
    algorithm, critic, ref_metrics, ref_weights, ref_critic = critic_reference
    for name, strategy in CRITIC_PLANS.items():
        if name == "collocated_1worker":
            continue
        root = tmp_path / name
        _, _, metrics, weights = _fit(
            assets,
            root,
            critic=critic,
            keys=CRITIC_KEYS,
            strategy=strategy,
            launcher=launcher,
            ckpt_every=0,
            algorithm=algorithm,
        )
        assert _maxdiff(weights[0], ref_weights[-1]) <= 1e-4, (name, launcher)
        assert _maxdiff(_critic_state(root)["model"], ref_critic) <= 1e-4, (name, launcher)
        _assert_same_metrics(metrics, ref_metrics, (name, launcher))


#: every sample multi-turn: each digit the policy writes ends a turn, answered by a masked reply
MULTI_TURN = {
    "environment": {"class_path": "rlinf_lightning.testing.DigitTurns"},
    "max_turns": 3,
    "max_response_tokens": 24,
}
MULTI_TURN_KEYS = ("actor/loss", "actor/grad_norm", "reward/reward", "rollout/tools/masked_tokens")


@pytest.fixture(scope="module")
def multi_turn_reference(assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("multi_turn")
    _, _, metrics, weights = _fit(
        assets, root, keys=MULTI_TURN_KEYS, task=MULTI_TURN, strategy=PLANS["collocated_1worker"],
        ckpt_every=1,
    )  # fmt: skip
    # every iteration has tool replies; the weights moved (with the counter-based sampler the first
    # iteration's groups all fail here, so that iteration carries no gradient)
    assert all(m["rollout/tools/masked_tokens"] > 0 for m in metrics), metrics
    assert any(m["actor/grad_norm"] > 0.1 for m in metrics), metrics
    return metrics, weights


@pytest.mark.parametrize(
    "launcher", ["inprocess", *(pytest.param(n, marks=pytest.mark.slow) for n in LAUNCHER_NAMES[1:])]
)
def test_multi_turn_updates_are_the_same_under_every_plan(assets, tmp_path, multi_turn_reference, launcher):
    """Multi-turn rows (tool replies masked inside the response), queued iterations: each turn is
    sampled from the sample's own stream whichever rows share the engine call, so the replies,
    the loss, grad norm and reward per iteration and the final weights equal the one-worker run's."""
    ref_metrics, ref_weights = multi_turn_reference
    for name, strategy in PLANS.items():
        if name == "collocated_1worker":
            continue
        _, _, metrics, weights = _fit(
            assets, tmp_path / name, keys=MULTI_TURN_KEYS, task=MULTI_TURN, strategy=strategy,
            launcher=launcher, ckpt_every=0,
        )  # fmt: skip
        assert _maxdiff(weights[0], ref_weights[-1]) <= 1e-4, (name, launcher)
        _assert_same_metrics(metrics, ref_metrics, (name, launcher))
