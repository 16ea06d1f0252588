"""Embodied RL (PPO on gymnasium-robotics' FetchReach with the MLP actor-critic): the rollout's
log-probs equal the actor's, and an iteration is the same update under every plan and launcher."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from tensordict import TensorDict

from rlinf_lightning import RLTrainer
from rlinf_lightning.algorithms import PPO
from rlinf_lightning.envs import make_env
from rlinf_lightning.policies import MLPActorCritic
from rlinf_lightning.strategies import CollocatedStrategy, HybridStrategy
from rlinf_lightning.tasks import EmbodiedTask

ENV = "FetchReachDense-v4"


def test_the_rollouts_log_probs_equal_the_actors_recomputed_ones(tmp_path):
    env = make_env(ENV, 4)
    obs = env.reset(seed=0)
    policy = MLPActorCritic(hidden_sizes=(32, 32), init_log_std=-0.5)
    policy.configure_spaces(obs, env.action_shape)
    policy.configure_model()
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    out = policy.act(obs, generators=gens)
    logprob, entropy, value = policy.evaluate(TensorDict({"obs": obs, "action": out["action"]}, [4]))
    assert torch.allclose(logprob, out["logprob"], atol=1e-5) and torch.allclose(value, out["value"])
    again = policy.act(obs, generators=[torch.Generator().manual_seed(i) for i in range(4)])
    assert torch.equal(again["action"], out["action"])  # a row's noise is its generator's
    loaded = MLPActorCritic(str(policy.save_pretrained(tmp_path / "mlp")))
    loaded.configure_spaces(obs, env.action_shape)
    loaded.configure_model()
    assert torch.equal(
        loaded.act(obs, deterministic=True)["action"], policy.act(obs, deterministic=True)["action"]
    )
    env.close()


def test_the_rollout_values_final_observations_only_where_an_episode_was_truncated():
    from rlinf_lightning.flow.stage import StageContext
    from rlinf_lightning.workflows.embodied import EnvRolloutStage

    env = make_env(ENV, 4)
    obs = env.reset(seed=0)
    final = env.reset(seed=1)
    policy = MLPActorCritic(hidden_sizes=(32, 32))
    policy.configure_spaces(obs, env.action_shape)
    env.close()
    stage = EnvRolloutStage(policy)
    stage.setup(StageContext("cpu", 0, 1, 1, [0]))
    bootstrap = torch.tensor([False, True, False, True])
    batch = TensorDict(
        {"obs": obs, "final_obs": final, "bootstrap": bootstrap, "env_id": torch.arange(4),
         "shard": torch.zeros(4, dtype=torch.long), "step": torch.zeros(4, dtype=torch.long)},
        batch_size=[4],
    )  # fmt: skip
    out = stage.process(batch)
    expected = stage.net.value(final)
    assert torch.allclose(out["final_value"][bootstrap], expected[bootstrap], atol=1e-6)
    assert out["final_value"][~bootstrap].eq(0).all() and expected[~bootstrap].ne(0).all()


COMPARED = ("actor/loss", "actor/grad_norm", "env/env_steps_total")  # every iteration reports these


def _fit(root, strategy, launcher, devices=2, iterations=3, grpo=False):
    """``iterations`` iterations queued as configs run them (no checkpoint or evaluation between);
    returns the trainer, the summary, each iteration's metrics and the final weights. PPO: a 4-step
    time limit, so every iteration truncates episodes and GAE bootstraps from final values, and
    episodes run on across iterations (the env state is carried). GRPO over episodes: groups of 4
    envs sharing reset seeds, new episodes every iteration."""
    from rlinf_lightning.algorithms import GRPO
    from trainer_defaults import MetricsRecorder

    steps = MetricsRecorder()
    trainer = RLTrainer(
        algorithm=GRPO() if grpo else PPO(update_epochs=2, num_minibatches=4),
        strategy=strategy,
        launcher=launcher,
        precision="32-true",  # plans compute the same update exactly; bf16 only to its rounding
        devices=devices,
        num_threads=1,
        max_iterations=iterations,
        default_root_dir=str(root),
        logger=False,
        enable_progress_bar=False,
        callbacks=[steps],
        timeout_s=120,
    )
    if grpo:
        task = EmbodiedTask(ENV, num_envs=8, steps=12, group_size=4, eval_episodes=2)
        policy = MLPActorCritic(hidden_sizes=(32, 32), init_log_std=-0.5, lr=1e-2)
    else:
        task = EmbodiedTask(ENV, env_kwargs={"max_episode_steps": 4}, num_envs=8, steps=10, eval_episodes=2)
        policy = MLPActorCritic(hidden_sizes=(32, 32))
    summary = trainer.fit(policy, task)
    last = (root / "checkpoints" / "last").read_text()
    return trainer, summary, steps.metrics, load_file(str(root / "checkpoints" / last / "model.safetensors"))


def _assert_same_run(name, launcher, metrics, weights, ref_metrics, ref_weights):
    assert len(metrics) == len(ref_metrics) == 3 and weights.keys() == ref_weights.keys()
    for it, (m, r) in enumerate(zip(metrics, ref_metrics, strict=True)):
        # and what only some iterations report: the returns of the episodes that ended in them
        for key in (*COMPARED, *(k for k in ("env/return", "advantage/groups_with_signal") if k in r)):
            assert m[key] == pytest.approx(r[key], abs=1e-4), (name, launcher, it, key)
    diff = max(float((weights[k] - ref_weights[k]).abs().max()) for k in weights)
    assert diff <= 1e-4, (name, launcher, diff)


def _initial_weights(**policy_kw):
    env = make_env(ENV, 1)
    initial = MLPActorCritic(hidden_sizes=(32, 32), **policy_kw)
    initial.configure_spaces(env.reset(seed=0), env.action_shape)
    initial.configure_model()
    env.close()
    return initial.model.state_dict()


PLANS = {
    "collocated_1worker": CollocatedStrategy(replicas=1),
    "collocated": "collocated",  # two replicas of every stage; each env replica owns half the envs
    "disaggregated": "disaggregated",  # the env alone on one slot, four shards pipelined
    "hybrid": HybridStrategy(placement="env,rollout: 0, advantage,actor: 1"),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    _, _, metrics, weights = _fit(tmp_path_factory.mktemp("ref"), PLANS["collocated_1worker"], "inprocess")
    moved = max(float((weights[k] - v).abs().max()) for k, v in _initial_weights().items())
    assert moved > 1e-3  # 24 Adam steps moved the weights well past the tolerance below
    assert len({round(m["env/return"], 6) for m in metrics}) == 3  # episodes end in every iteration
    return metrics, weights


@pytest.mark.parametrize("launcher", ["inprocess", "processes", "ray"])
def test_three_iterations_are_the_same_updates_under_every_plan(tmp_path, reference, launcher):
    """PPO, three queued iterations: loss, grad norm and episode returns per iteration and the
    final weights equal the one-worker plan's under every plan (the weights synced to the rollout
    and the envs carried from one iteration to the next included)."""
    for name, strategy in PLANS.items():
        _, _, metrics, weights = _fit(tmp_path / name, strategy, launcher)
        _assert_same_run(name, launcher, metrics, weights, *reference)


def test_an_embodied_fit_logs_success_and_writes_the_summary(tmp_path):
    trainer, summary, _, _ = _fit(tmp_path, "collocated", "inprocess", devices=1, iterations=2)
    before, after = summary["eval_history"]
    assert (before["iteration"], after["iteration"], summary["eval_episodes"]) == (0, 2, 2.0)
    assert (summary["success_before"], summary["success_after"]) == (before["success"], after["success"])
    assert summary["eval_success_after"] == after["success"] and summary["eval_return"] == after["return"]
    for ev in (before, after):
        assert ev["success"] in (0.0, 0.5, 1.0)  # 2 episodes, each a success or not
        assert -50.0 <= ev["return"] < 0.0  # FetchReachDense: minus the distance, 50 steps at most
    # the evaluation ran the trained weights: the deterministic episodes changed with them
    assert after["return"] != before["return"]
    assert trainer.plan.groups[0].stages == ["env", "rollout", "advantage", "actor"]


# -- GRPO over episodes ----------------------------------------------------------------------------


def test_grpo_groups_share_reset_seeds_and_score_whole_episodes():
    from rlinf_lightning.algorithms import GRPO
    from rlinf_lightning.flow.stage import StageContext
    from rlinf_lightning.workflows.embodied import EnvStage, EpisodeAdvantageStage

    env = EnvStage(ENV, None, steps=3, group_size=4, episodic=True)
    env.setup(StageContext())
    env.begin_iteration(1)
    goals = env._start(0, 0, 8)["obs"]["desired_goal"]
    assert torch.equal(goals[0], goals[3]) and not torch.equal(goals[0], goals[4])  # a group shares its seed
    env.begin_iteration(2)
    assert not torch.equal(
        env._start(0, 0, 8)["obs"]["desired_goal"][0], goals[0]
    )  # new episodes each iteration
    env.teardown()

    stage = EpisodeAdvantageStage(GRPO())
    stage.setup(StageContext())
    n, steps = 8, 3
    traj = TensorDict(
        {
            "obs": TensorDict({"x": torch.zeros(n, steps, 2)}, [n, steps]),
            "action": torch.zeros(n, steps, 4),
            "logprob": torch.zeros(n, steps),
            "value": torch.zeros(n, steps),
            "mask": torch.tensor([[True, True, False]] * n),  # the first episode ended after step 1
            "score": torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 1]),
            "group_id": torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]),
            "env_id": torch.arange(n),
        },
        [n],
    )
    out = stage.process(traj)
    adv, mask = out["advantage"].reshape(n, steps), out["mask"].reshape(n, steps)
    assert adv[0, 0] > 0 > adv[1, 0] and torch.allclose(adv[:4].sum(0), torch.zeros(steps), atol=1e-5)
    assert not mask[4:].any()  # the all-success group carries no signal: dropped
    assert mask[:4, :2].all() and not mask[:, 2].any()  # steps after the first episode end do not count
    assert stage.end_iteration().compute() == {"groups_with_signal": 0.5}


@pytest.fixture(scope="module")
def grpo_reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo_ref")
    _, _, metrics, weights = _fit(root, PLANS["collocated_1worker"], "inprocess", grpo=True)
    moved = max(float((weights[k] - v).abs().max()) for k, v in _initial_weights(init_log_std=-0.5).items())
    assert moved > 1e-3 and any(abs(m["actor/loss"]) > 0 for m in metrics)  # it learned
    return metrics, weights


@pytest.mark.parametrize("launcher", ["inprocess", "processes", "ray"])
def test_grpo_over_episodes_is_the_same_update_under_every_plan(tmp_path, grpo_reference, launcher):
    """GRPO over episodes, three queued iterations: the same per-iteration metrics and final
    weights under every plan (hybrid included) and launcher."""
    for name, strategy in PLANS.items():
        _, _, metrics, weights = _fit(tmp_path / name, strategy, launcher, grpo=True)
        _assert_same_run(name, launcher, metrics, weights, *grpo_reference)


def test_training_reset_seeds_never_reach_the_evaluation_episodes_seeds():
    from rlinf_lightning.workflows.embodied import EVAL_SEED, EnvStage

    for episodic, group_size in ((False, 1), (True, 4)):
        env = EnvStage(ENV, None, steps=3, group_size=group_size, episodic=episodic, seed=7)
        for iteration in (1, 2, 3, 10**4, 10**7):  # long runs too: seeds wrap below EVAL_SEED
            env.iteration = iteration
            assert all(0 <= s < EVAL_SEED for s in env._seeds(0, 64)), (episodic, iteration)
    assert EVAL_SEED + 10**6 < 2**32  # evaluation seeds too fit simulators seeding numpy's RandomState


def test_episodes_without_a_success_value_are_counted_not_dropped_silently():
    """Pendulum reports no success (NaN): its ended episodes count in ``episodes_without_success``
    and ``success`` is left out rather than averaged over nothing; FetchReach's all report one."""
    from rlinf_lightning.flow.stage import StageContext
    from rlinf_lightning.workflows.embodied import EnvStage

    def episodes(env_id: str, steps: int) -> dict[str, float]:
        stage = EnvStage(env_id, None, steps=steps)
        stage.setup(StageContext())
        stage.begin_iteration(1)
        stage._start(0, 0, 3)
        shard = stage.shards[0]
        for _ in range(steps):
            stage._step(shard, torch.zeros(3, *shard.env.action_shape))
        stage.teardown()
        return stage.end_iteration().compute()

    pendulum = episodes("Pendulum-v1", 200)  # its time limit: every env ends once
    assert (pendulum["episodes_total"], pendulum["episodes_without_success"]) == (3.0, 3.0)
    assert "success" not in pendulum and pendulum["env_steps_total"] == 600.0
    fetch = episodes(ENV, 50)
    assert (fetch["episodes_total"], fetch["episodes_without_success"]) == (3.0, 0.0) and "success" in fetch
