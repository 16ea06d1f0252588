"""Off-policy embodied RL (SAC, RLPD; ``workflows/offpolicy``): SAC's losses equal a hand-computed
case, the replay buffer samples uniformly and never joins two episodes, a part-full buffer in a
checkpoint resumes to bit-equal updates, the updates are the same under every plan, and bad keys
are one line before anything starts."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file
from tensordict import TensorDict

from rlinf_lightning import RLTrainer
from rlinf_lightning.algorithms import RLPD, SAC, CrossQ
from rlinf_lightning.algorithms.sac import actor_loss, critic_loss, critic_target, temperature_loss
from rlinf_lightning.engines.train import TrainSpec
from rlinf_lightning.errors import ConfigError
from rlinf_lightning.flow.stage import StageContext
from rlinf_lightning.policies import CrossQPolicy, SACPolicy
from rlinf_lightning.policies.sac import polyak
from rlinf_lightning.strategies import CollocatedStrategy, HybridStrategy
from rlinf_lightning.tasks import EmbodiedTask
from rlinf_lightning.workflows.offpolicy.learner import CrossQLoss, OffPolicyLearnerStage, SACLoss
from rlinf_lightning.workflows.offpolicy.replay import ReplayBuffer

ENV = "FetchReachDense-v4"


# -- SAC's losses by hand ---------------------------------------------------------------------------


def test_sac_losses_equal_a_hand_computed_case():
    reward, terminated = torch.tensor([1.0, -0.5]), torch.tensor([False, True])
    next_q, next_logprob = torch.tensor([2.0, 3.0]), torch.tensor([-1.0, 0.5])
    # y = r + gamma (1 - d) (Q' - alpha log pi): 1 + 0.9 (2 + 0.2) = 2.98; terminated: -0.5
    target = critic_target(reward, terminated, next_q, next_logprob, alpha=0.2, gamma=0.9)
    assert torch.allclose(target, torch.tensor([2.98, -0.5]))
    q = torch.tensor([[3.0, 0.5], [2.0, -1.5]])  # two critics x two transitions
    # critic 1: ((0.02)^2 + 1^2) / 2 = 0.5002; critic 2: ((0.98)^2 + 1^2) / 2 = 0.9802
    assert critic_loss(q, target).item() == pytest.approx(0.5002 + 0.9802)
    logprob, q_pi = torch.tensor([-2.0, 1.0]), torch.tensor([1.0, 4.0])
    # mean(0.2 x -2 - 1, 0.2 x 1 - 4) = mean(-1.4, -3.8) = -2.6
    assert actor_loss(logprob, q_pi, alpha=0.2).item() == pytest.approx(-2.6)
    # target entropy -4: mean(-log_alpha (log pi - 4)) = -0.5 x mean(-6, -3) = 2.25
    log_alpha = torch.tensor(0.5, requires_grad=True)
    loss = temperature_loss(log_alpha, logprob, target_entropy=-4.0)
    assert loss.item() == pytest.approx(2.25)
    loss.backward()  # d/dlog_alpha = -mean(log pi + H) = 4.5 > 0: the entropy is above target, alpha falls
    assert log_alpha.grad.item() == pytest.approx(4.5)
    online, target_net = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    with torch.no_grad():
        (
            online.weight.fill_(1.0),
            online.bias.fill_(-1.0),
            target_net.weight.fill_(0.0),
            target_net.bias.fill_(1.0),
        )
    polyak(target_net, online, tau=0.1)  # 0.1 x online + 0.9 x target
    assert target_net.weight.item() == pytest.approx(0.1) and target_net.bias.item() == pytest.approx(0.8)


def _policy(cls: type[SACPolicy] = SACPolicy, **kw) -> SACPolicy:
    obs = TensorDict({"observation": torch.zeros(1, 3)}, batch_size=[1])
    policy = cls(hidden_sizes=(8,), **kw)
    policy.configure_spaces(obs, (1, 2))
    policy.configure_model()
    return policy


def _batch(n: int, g: torch.Generator, subset=(0, 1)) -> TensorDict:
    obs = TensorDict({"observation": torch.randn(n, 3, generator=g)}, batch_size=[n])
    return TensorDict(
        {
            "obs": obs,
            "next_obs": obs.apply(lambda t: t + 0.1),
            "action": torch.rand(n, 2, generator=g) * 2 - 1,
            "reward": torch.randn(n, generator=g),
            "terminated": torch.rand(n, generator=g) < 0.3,
            "truncated": torch.zeros(n, dtype=torch.bool),
            "noise": torch.randn(n, 2, 2, generator=g),
            "critic_subset": torch.tensor(subset).expand(n, -1),
            "update_actor": torch.ones(n, dtype=torch.bool),
        },
        batch_size=[n],
    )


def test_the_summed_sac_loss_moves_each_network_by_its_own_loss_only():
    """One backward of SACLoss's sum gives the critics the critic loss's gradient, the actor the
    actor loss's (the critics read through detached weights) and the temperature its own."""
    policy = _policy(num_critics=3)
    batch = _batch(5, torch.Generator().manual_seed(0), subset=(2, 0))
    total, count, _ = SACLoss(SAC(gamma=0.9), target_entropy=-2.0)(policy, batch)
    total.backward()
    got = {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}
    policy.model.zero_grad()

    m, x, nx = policy.model, policy.features(batch["obs"]), policy.features(batch["next_obs"])
    alpha = m.log_alpha.exp().detach()
    with torch.no_grad():
        na, nlp = policy.sample(nx, batch["noise"][:, 0])
        nq = policy.q(nx, na, net="target")[[2, 0]].min(0).values
        y = critic_target(batch["reward"], batch["terminated"], nq, nlp, alpha, 0.9)
    a, lp = policy.sample(x, batch["noise"][:, 1])
    q_pi = policy.q(x, a).min(0).values
    expected = {}
    for part, loss in (
        ("critics", critic_loss(policy.q(x, batch["action"]), y)),
        ("actor", actor_loss(lp, q_pi, alpha)),
        ("log_alpha", temperature_loss(m.log_alpha, lp, -2.0)),
    ):
        m.zero_grad()
        loss.backward(retain_graph=True)
        expected |= {n: p.grad.clone() * count for n, p in m.named_parameters() if n.startswith(part)}
    assert got.keys() == expected.keys()
    for name in got:
        assert torch.allclose(got[name], expected[name], atol=1e-5), name


def test_bootstrap_at_termination_values_a_terminated_step_like_a_truncated_one():
    """ManiSkill ends an episode at success: with the option, a terminated row's target bootstraps
    (the critic loss equals that of the same batch with no termination); without it, it does not."""
    policy = _policy()
    batch = _batch(6, torch.Generator().manual_seed(1))
    batch["terminated"] = torch.tensor([True, False, True, False, False, True])
    never_ended = batch.clone()
    never_ended["terminated"] = torch.zeros(6, dtype=torch.bool)
    with torch.no_grad():
        bootstrapped = SACLoss(SAC(gamma=0.9, bootstrap_at_termination=True), -2.0)(policy, batch)[2]
        continued = SACLoss(SAC(gamma=0.9), -2.0)(policy, never_ended)[2]
        stopped = SACLoss(SAC(gamma=0.9), -2.0)(policy, batch)[2]
    assert bootstrapped["critic_loss"].item() == pytest.approx(continued["critic_loss"].item(), rel=1e-6)
    assert abs(bootstrapped["critic_loss"].item() - stopped["critic_loss"].item()) > 1e-3


def test_crossq_losses_equal_a_hand_computed_case():
    """CrossQ's critic sees (s, a) and (s', a') as one batch: with s = 1, 3 and s' = 5, 7 the
    input normalization uses their joint mean 4 and variance 5 (separate batches would map both
    halves to -1, 1). The critic reads s only; the actor's actions are tanh(0) = 0 with
    log-prob 1.5 - log(2 pi) / 2; its loss reads the critic with the running statistics."""
    policy = _policy(CrossQPolicy, critic_hidden_sizes=(1,), num_critics=1)
    policy.configure_spaces(TensorDict({"observation": torch.zeros(1, 1)}, [1]), (1, 1))
    policy.model = None
    policy.configure_model()
    bn_in, linear, _, bn_hidden, out = policy.model.critics
    with torch.no_grad():
        for p in policy.model.actor.parameters():
            p.zero_()  # mean 0, log_std -5 + 3.5 (tanh(0) + 1) = -1.5
        linear.weight.copy_(torch.tensor([[[1.0], [0.0]]])), linear.bias.fill_(10.0)  # h = norm(s) + 10 > 0
        out.weight.fill_(2.0), out.bias.fill_(0.5)
    batch = TensorDict(
        {
            "obs": TensorDict({"observation": torch.tensor([[1.0], [3.0]])}, [2]),
            "next_obs": TensorDict({"observation": torch.tensor([[5.0], [7.0]])}, [2]),
            "action": torch.tensor([[0.3], [-0.2]]),
            "reward": torch.tensor([1.0, -0.5]),
            "terminated": torch.tensor([False, True]),
            "noise": torch.zeros(2, 2, 1),
            "critic_subset": torch.zeros(2, 1, dtype=torch.long),
            "update_actor": torch.ones(2, dtype=torch.bool),
        },
        batch_size=[2],
    )
    total, count, metrics = CrossQLoss(CrossQ(gamma=0.9), target_entropy=-1.0)(policy, batch)

    eps = 1e-3
    s = torch.tensor([1.0, 3.0, 5.0, 7.0])
    n = (s - 4) / math.sqrt(5 + eps)  # the joint batch's statistics: mean 4, variance 5
    joint = 2 * n / math.sqrt(float(n.var(unbiased=False)) + eps) + 0.5  # h - mean(h) = n
    q, next_q = joint[:2], joint[2:]
    logprob = 1.5 - 0.5 * math.log(2 * math.pi)  # alpha = 1 (log_alpha 0)
    y = torch.tensor([1.0 + 0.9 * (float(next_q[0]) - logprob), -0.5])
    critic = float(((q - y) ** 2).mean())
    assert metrics["critic_loss"].item() == pytest.approx(critic, rel=1e-5)
    # the running statistics after that one batch (momentum 0.01, unbiased variances)
    mean_in, var_in = 0.01 * 4.0, 0.99 + 0.01 * float(s.var())
    assert bn_in.running_mean[0].item() == pytest.approx(mean_in)
    h = n + 10
    mean_h, var_h = 0.01 * float(h.mean()), 0.99 + 0.01 * float(h.var())
    n_pi = (torch.tensor([1.0, 3.0]) - mean_in) / math.sqrt(var_in + eps) + 10
    q_pi = 2 * (n_pi - mean_h) / math.sqrt(var_h + eps) + 0.5
    actor = float((logprob - q_pi).mean())
    assert metrics["actor_loss"].item() == pytest.approx(actor, rel=1e-5)
    assert metrics["alpha_loss"].item() == pytest.approx(0.0)  # log_alpha is 0
    assert count == 2 and total.item() == pytest.approx(2 * (critic + actor), rel=1e-5)


def test_crossq_updates_the_actor_every_third_update_and_the_critics_at_each():
    """One transition per iteration at UTD 1: one update each; the actor (and temperature) move at
    updates 0 and 3 only."""
    stage = OffPolicyLearnerStage(
        _policy(CrossQPolicy, critic_hidden_sizes=(8,)),
        CrossQ(batch_size=4, learning_starts=0, updates_per_step=1),
        TrainSpec(), transition_bytes=64,
    )  # fmt: skip
    stage.setup(StageContext())
    g, moved = torch.Generator().manual_seed(0), []
    for iteration in range(1, 6):
        before = {k: v.clone() for k, v in stage.engine.policy.model.state_dict().items()}
        steps = _batch(1, g).exclude("noise", "critic_subset", "update_actor").reshape(1, 1)
        t = TensorDict({k: steps[k] for k in steps.keys()}, batch_size=[1])
        t["env_id"], t["policy_version"] = torch.zeros(1, dtype=torch.long), torch.full((1, 1), iteration - 1)
        stage.begin_iteration(iteration)
        stage.process(t)
        stage.end_iteration()
        after = stage.engine.policy.model.state_dict()
        changed = [k for k in after if not torch.equal(before[k], after[k])]
        moved.append(
            {part for part in ("actor", "critics", "log_alpha") if any(k.startswith(part) for k in changed)}
        )
    full = {"actor", "critics", "log_alpha"}
    assert moved == [full, {"critics"}, {"critics"}, full, {"critics"}]


def test_crossq_refuses_a_policy_with_target_critics_and_sac_one_without():
    with pytest.raises(ConfigError) as info:
        RLTrainer(algorithm=CrossQ(), devices=1, logger=False).validate(SACPolicy(), EmbodiedTask(ENV))
    assert info.value.keys == ["policy"] and "CrossQPolicy" in str(info.value)
    assert len(str(info.value).splitlines()) == 2
    with pytest.raises(ConfigError) as info:
        RLTrainer(algorithm=SAC(), devices=1, logger=False).validate(CrossQPolicy(), EmbodiedTask(ENV))
    assert info.value.keys == ["policy"] and "has none" in str(info.value)


# -- the replay buffer --------------------------------------------------------------------------------


def _rows(n: int, first: int = 0) -> TensorDict:
    ids = torch.arange(first, first + n, dtype=torch.float32)
    return TensorDict({"obs": TensorDict({"x": ids[:, None]}, [n]), "reward": ids}, batch_size=[n])


def test_the_buffer_samples_uniformly_and_keeps_the_newest_rows():
    buffer = ReplayBuffer(capacity=20)
    buffer.add(_rows(12))
    buffer.add(_rows(13, first=12))  # 25 rows into 20: rows 0-4 replaced
    assert len(buffer) == 20 and sorted(buffer.storage["reward"].tolist()) == list(range(5, 25))
    draws = 40_000
    rewards = buffer.sample(draws, torch.Generator().manual_seed(0))["reward"].long()
    counts = torch.bincount(rewards - 5, minlength=20).double()
    assert counts.sum() == draws and rewards.min() >= 5
    chi2 = float(((counts - draws / 20) ** 2 / (draws / 20)).sum())
    assert chi2 < 43.82  # the chi-square distribution's 99.9% quantile at 19 degrees of freedom


@pytest.mark.parametrize("written", [5, 11])  # part-full; full, wrapped round to row 3
def test_the_buffer_round_trips_its_state(written):
    buffer = ReplayBuffer(capacity=8)
    buffer.add(_rows(5))
    buffer.add(_rows(written - 5, first=5))
    assert buffer.position == written % 8
    copy = ReplayBuffer(capacity=8)
    copy.load_state_dict(torch.load(_saved(buffer.state_dict()), weights_only=True))
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(buffer.sample(64, g1)["reward"], copy.sample(64, g2)["reward"])
    buffer.add(_rows(6, first=written)), copy.add(_rows(6, first=written))  # the same rows replaced
    assert torch.equal(buffer.storage["reward"], copy.storage["reward"])


def test_a_saved_buffer_holds_the_rows_written_not_its_capacity():
    buffer = ReplayBuffer(capacity=100_000)
    buffer.add(_rows(10))
    saved = _saved(buffer.state_dict()).getbuffer().nbytes
    # 10 rows of two float32 entries are 80 bytes; the preallocated storage is 800 kB
    assert saved < 20_000, f"{saved} bytes saved for 10 rows"


def _saved(state):
    import io

    f = io.BytesIO()
    torch.save(state, f)
    f.seek(0)
    return f


# -- runs through the trainer -------------------------------------------------------------------------


def _fit(root, strategy="collocated", launcher="inprocess", devices=1, iterations=3, crossq=False, **algo):
    from trainer_defaults import MetricsRecorder

    steps = MetricsRecorder()
    options = {"batch_size": 16, "learning_starts": 0, "updates_per_step": 0.5, "tau": 0.1, **algo}
    task = EmbodiedTask(ENV, env_kwargs={"max_episode_steps": 4}, num_envs=4, steps=6, eval_episodes=2)
    trainer = RLTrainer(
        algorithm=(CrossQ if crossq else SAC)(**options),
        strategy=strategy,
        launcher=launcher,
        precision="32-true",
        devices=devices,
        num_threads=1,
        max_iterations=iterations,
        default_root_dir=str(root),
        logger=False,
        enable_progress_bar=False,
        callbacks=[steps],
        timeout_s=120,
    )
    sizes = {"hidden_sizes": (16, 16), "actor_lr": 1e-2, "critic_lr": 1e-2}
    policy = CrossQPolicy(critic_hidden_sizes=(16, 16), **sizes) if crossq else SACPolicy(**sizes)
    summary = trainer.fit(policy, task)
    last = root / "checkpoints" / (root / "checkpoints" / "last").read_text()
    return summary, steps.metrics, load_file(str(last / "model.safetensors")), last


def test_stored_transitions_never_join_two_episodes(tmp_path):
    """FetchReach keeps an episode's goal and draws a new one at each reset: no transition in the
    checkpointed buffer goes from one goal to another, and every 4th step (the time limit here)
    ends its episode as a truncation, not a termination, so its target still bootstraps."""
    _, _, _, last = _fit(tmp_path, iterations=1, learning_starts=10_000)
    rows = torch.load(last / "stages" / "actor.pt", weights_only=True)["buffer"]["rows"]
    assert len(rows["reward"]) == 4 * 6
    assert torch.equal(rows["obs.desired_goal"], rows["next_obs.desired_goal"])
    step = torch.arange(24) // 4  # step-major: 4 envs per step
    assert torch.equal(rows["truncated"], step % 4 == 3) and not rows["terminated"].any()
    # within an episode the next observation is the following step's observation
    inside = (step % 4 != 3) & (step < 5)
    following = torch.arange(24)[inside] + 4
    assert torch.equal(rows["next_obs.observation"][inside], rows["obs.observation"][following])


PLANS = {
    "collocated": (CollocatedStrategy(replicas=1), 1),
    "disaggregated": ("disaggregated", 2),
    "hybrid": (HybridStrategy(placement="env,rollout: 0, actor: 1"), 2),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _fit(tmp_path_factory.mktemp("sac"))


@pytest.mark.parametrize("launcher", ["inprocess", pytest.param("processes", marks=pytest.mark.slow)])
def test_three_iterations_are_the_same_updates_under_every_plan(tmp_path, reference, launcher):
    _, ref_metrics, ref_weights, _ = reference
    assert [m["actor/updates"] for m in ref_metrics] == [12, 12, 12]
    for name, (strategy, devices) in PLANS.items():
        _, metrics, weights, _ = _fit(tmp_path / name, strategy, launcher, devices)
        for it, (m, r) in enumerate(zip(metrics, ref_metrics, strict=True)):
            for key in ("actor/loss", "actor/critic_loss", "actor/alpha", "env/return"):
                assert m[key] == pytest.approx(r[key], abs=1e-5), (name, launcher, it, key)
        assert max(float((weights[k] - ref_weights[k]).abs().max()) for k in weights) <= 1e-5, name


@pytest.mark.parametrize("launcher", ["inprocess", pytest.param("processes", marks=pytest.mark.slow)])
def test_a_learner_on_two_replicas_takes_the_updates_of_one(tmp_path, reference, launcher):
    """Each replica writes every replica's transitions into its buffer and takes a slice of each
    batch; the engine sums the gradients: the updates of one learner, to rounding."""
    _, ref_metrics, ref_weights, _ = reference
    _, metrics, weights, _ = _fit(tmp_path, CollocatedStrategy(replicas=2), launcher, devices=2)
    assert [m["env/return"] for m in metrics] == pytest.approx([r["env/return"] for r in ref_metrics])
    assert max(float((weights[k] - ref_weights[k]).abs().max()) for k in weights) <= 1e-5


@pytest.mark.parametrize(
    ("algorithm", "key"),
    [(CrossQ(), "trainer.strategy"), (SAC(policy_delay=2), "trainer.algorithm.policy_delay")],
)
def test_a_learner_on_two_replicas_refuses_what_a_batch_slice_cannot_do(algorithm, key):
    stage = OffPolicyLearnerStage(_policy(), algorithm, TrainSpec(), 64)
    assert [k for k, _ in stage.check_placement(2, own_process=False)] == [key]
    assert stage.check_placement(1, own_process=False) == []


def test_crossq_takes_the_same_updates_under_every_plan(tmp_path):
    """CrossQ's updates, its batch-norm running statistics included, are the same whether the
    learner shares a worker with the envs or has its own slot."""
    runs = {name: _fit(tmp_path / name, strategy, "inprocess", devices, crossq=True, policy_delay=2)
            for name, (strategy, devices) in PLANS.items()}  # fmt: skip
    _, ref_metrics, ref_weights, _ = runs["collocated"]
    assert "critics.0.running_var" in ref_weights and "target.0.weight" not in ref_weights
    assert float((ref_weights["critics.0.running_mean"]).abs().max()) > 0  # the statistics moved
    for name, (_, metrics, weights, _) in runs.items():
        for m, r in zip(metrics, ref_metrics, strict=True):
            for key in ("actor/loss", "actor/critic_loss", "env/return"):
                assert m[key] == pytest.approx(r[key], abs=1e-5), (name, key)
        assert weights.keys() == ref_weights.keys()
        assert max(float((weights[k] - ref_weights[k]).abs().max()) for k in weights) <= 1e-5, name


def test_the_actor_learner_plan_runs_one_version_behind(tmp_path):
    """``trainer.max_staleness=1`` on disjoint slots: the env workers collect iteration k+1 with
    the weights of k-1 while the learner updates."""
    from trainer_defaults import MetricsRecorder

    steps = MetricsRecorder()
    task = EmbodiedTask(ENV, env_kwargs={"max_episode_steps": 4}, num_envs=4, steps=6, eval_episodes=2)
    RLTrainer(
        algorithm=SAC(batch_size=16, learning_starts=0, updates_per_step=0.5),
        strategy=HybridStrategy(placement="env,rollout: 0, actor: 1"),
        devices=2, num_threads=1, max_iterations=3, max_staleness=1, default_root_dir=str(tmp_path),
        logger=False, enable_progress_bar=False, callbacks=[steps], timeout_s=120,
    ).fit(SACPolicy(hidden_sizes=(16, 16)), task)  # fmt: skip
    assert [m["async/staleness_max"] for m in steps.metrics] == [0, 1, 1]


RESUMED = {
    "sac": (SAC(batch_size=4, buffer_capacity=50, learning_starts=0), {}),
    # 5: the 12 updates before the checkpoint leave the delay's count mid-way
    "crossq": (CrossQ(batch_size=4, buffer_capacity=50, learning_starts=0, policy_delay=5),
               {"cls": CrossQPolicy, "critic_hidden_sizes": (8,)}),
}  # fmt: skip


@pytest.mark.parametrize("name", RESUMED)
def test_a_part_full_buffer_resumes_to_bit_equal_updates(name):
    """A learner whose train state and buffer went through a checkpoint's files takes the same
    next updates, bit for bit, as the one that went on: weights, targets (SAC), batch-norm running
    statistics and the policy delay's count (CrossQ)."""
    algorithm, policy_options = RESUMED[name]
    policy = _policy(**policy_options)
    g = torch.Generator().manual_seed(1)

    def trajectories(iteration):  # two envs x three steps, as the env stage sends them
        steps = _batch(6, g).exclude("noise", "critic_subset", "update_actor").reshape(2, 3)
        t = TensorDict({k: steps[k] for k in steps.keys()}, batch_size=[2])
        t["env_id"], t["policy_version"] = torch.arange(2), torch.full((2, 3), iteration - 1)
        return t

    def learner():
        stage = OffPolicyLearnerStage(policy, algorithm, TrainSpec(), transition_bytes=64, seed=0)
        stage.setup(StageContext())
        return stage

    def iterate(stage, iteration, data):
        stage.begin_iteration(iteration)
        stage.process(data)
        stage.end_iteration()

    data = [trajectories(i) for i in (1, 2, 3)]
    a = learner()
    iterate(a, 1, data[0]), iterate(a, 2, data[1])
    saved = _saved({"train": a.state_dict(), "extra": a.extra_state()})
    iterate(a, 3, data[2])
    state = torch.load(saved, weights_only=False)
    b = learner()
    b.load_state_dict(state["train"]), b.load_extra_state(state["extra"])
    assert len(b.buffer) == 12 < b.buffer.capacity
    assert b.updates == 12
    iterate(b, 3, data[2])
    model_a, model_b = a.engine.state_dict()["model"], b.engine.state_dict()["model"]
    assert model_a.keys() == model_b.keys()
    assert ("target.0.weight" in model_a) == (name == "sac")
    assert ("critics.0.running_mean" in model_a) == (name == "crossq")
    for key in model_a:
        assert torch.equal(model_a[key], model_b[key]), key


def test_the_buffer_holds_the_transitions_in_env_order_whatever_order_the_shards_came_in():
    """Plans cut the envs into shards that reach the learner in any order: the buffer's rows, and
    so every sampled batch, must not depend on it."""
    g = torch.Generator().manual_seed(2)
    steps = _batch(12, g).exclude("noise", "critic_subset", "update_actor").reshape(4, 3)
    shards = [TensorDict({k: steps[k][i : i + 2] for k in steps.keys()}, batch_size=[2]) for i in (0, 2)]
    for i, shard in enumerate(shards):
        shard["env_id"], shard["policy_version"] = torch.arange(2 * i, 2 * i + 2), torch.zeros(2, 3)

    def buffer_after(order):
        stage = OffPolicyLearnerStage(_policy(), SAC(batch_size=4, learning_starts=100), TrainSpec(), 64)
        stage.setup(StageContext())
        stage.begin_iteration(1)
        for i in order:
            stage.process(shards[i])
        stage.end_iteration()
        return stage.buffer.storage[: len(stage.buffer)]

    first, second = buffer_after([0, 1]), buffer_after([1, 0])
    assert torch.equal(first["reward"], second["reward"])
    assert torch.equal(first["reward"][:4], steps["reward"][:, 0])  # step 0 of envs 0..3 first


# -- bad keys -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "key", "text"),
    [
        ({"updates_per_step": 0}, "trainer.algorithm.updates_per_step", "must be > 0"),
        (
            {"batch_size": 512, "buffer_capacity": 256},
            "trainer.algorithm.batch_size",
            "more than buffer_capacity",
        ),
        ({"buffer_capacity": 0}, "trainer.algorithm.buffer_capacity", "must be >= 1"),
        ({"demo_ratio": 1.5, "demo_path": "d.safetensors"}, "trainer.algorithm.demo_ratio", "<= 1"),
        ({"demo_ratio": -0.1}, "trainer.algorithm.demo_ratio", ">= 0"),
        ({"policy_delay": 0}, "trainer.algorithm.policy_delay", "must be >= 1"),
    ],
)
def test_a_bad_key_is_one_line_naming_it(options, key, text):
    with pytest.raises(ConfigError) as info:
        RLTrainer(algorithm=SAC(**options), devices=1, logger=False).validate()
    assert info.value.keys == [key] and text in str(info.value)
    assert len(str(info.value).splitlines()) == 2  # header + one line


def test_sac_on_a_discrete_action_space_is_refused_naming_the_env():
    with pytest.raises(ConfigError) as info:
        RLTrainer(algorithm=SAC(), devices=1, logger=False).validate(SACPolicy(), EmbodiedTask("CartPole-v1"))
    assert info.value.keys == ["task.env"] and "SAC needs continuous actions" in str(info.value)


def test_rlpd_needs_as_many_critics_as_its_target_subset():
    with pytest.raises(ConfigError) as info:
        RLTrainer(algorithm=RLPD(demo_ratio=0.0), devices=1, logger=False).validate(
            SACPolicy(num_critics=1), EmbodiedTask(ENV)
        )
    assert info.value.keys == ["trainer.algorithm.critic_subset"]


def test_the_memory_check_counts_the_replay_buffer():
    obs = TensorDict({"observation": torch.zeros(1, 10)}, batch_size=[1])
    from rlinf_lightning.workflows.offpolicy.replay import transition_bytes

    per = transition_bytes(obs, 4)
    assert per == 2 * 40 + 16 + 4 + 2
    stage = OffPolicyLearnerStage(_policy(), SAC(buffer_capacity=1000), TrainSpec(), per)
    parts = stage.memory("cpu", 1, 1)
    assert parts[-1].nbytes == 1000 * per and "replay buffer" in parts[-1].what
    assert not math.isnan(parts[0].nbytes)


# -- demonstrations and RLPD ----------------------------------------------------------------------------


def test_demos_replay_as_transitions_and_rlpd_trains_on_them(tmp_path):
    """``rlinf demos`` writes a file whose rows replay as transitions (each episode's own goal from
    obs to next_obs, its last step a truncation); RLPD draws half of each batch from it, the target
    from a random pair of its critics."""
    from rlinf_lightning.sft import record_expert_demos
    from rlinf_lightning.workflows.offpolicy.demos import load_demo_transitions

    path = tmp_path / "demos.safetensors"
    record_expert_demos(ENV, episodes=2, chunk=1, out=str(path), env_kwargs={"max_episode_steps": 5})
    obs = TensorDict({k: torch.zeros(1, n) for k, n in (("achieved_goal", 3), ("desired_goal", 3),
                                                         ("observation", 10))}, batch_size=[1])  # fmt: skip
    demos = load_demo_transitions(path, obs)
    assert len(demos) == 10 and int(demos["truncated"].sum()) == 2
    assert torch.equal(demos["obs", "desired_goal"], demos["next_obs", "desired_goal"])
    assert (demos["reward"] < 0).all()  # FetchReachDense: minus the distance to the goal

    task = EmbodiedTask(ENV, env_kwargs={"max_episode_steps": 4}, num_envs=2, steps=4, eval_episodes=2)
    summary = RLTrainer(
        algorithm=RLPD(batch_size=8, updates_per_step=1, demo_path=str(path)),
        devices=1, num_threads=1, max_iterations=2, default_root_dir=str(tmp_path / "run"),
        logger=False, enable_progress_bar=False, timeout_s=120,
    ).fit(SACPolicy(hidden_sizes=(16,), num_critics=4, layer_norm=True), task)  # fmt: skip
    assert summary["nonfinite_steps"] == {"actor": 0}
