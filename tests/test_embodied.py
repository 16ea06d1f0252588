"""Embodied RL (PPO on gymnasium-robotics' FetchReach and on CartPole's discrete actions, with the
MLP actor-critic): the rollout's log-probs equal the actor's, an iteration is the same update under
every plan and launcher, what the workflow cannot serve is refused before anything loads, and
CartPole learns."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tensordict import TensorDict

from rlinf_lightning import RLTrainer
from rlinf_lightning.algorithms import PPO
from rlinf_lightning.envs import make_env
from rlinf_lightning.errors import ConfigError
from rlinf_lightning.policies import MLPActorCritic
from rlinf_lightning.strategies import CollocatedStrategy, HybridStrategy
from rlinf_lightning.tasks import EmbodiedTask
from trainer_defaults import launcher_matrix, scaled

ENV = "FetchReachDense-v4"
DISCRETE_ENV = "CartPole-v1"


@pytest.mark.parametrize("env_id", [ENV, DISCRETE_ENV])
def test_the_rollouts_log_probs_equal_the_actors_recomputed_ones(tmp_path, env_id):
    env = make_env(env_id, 4)
    obs = env.reset(seed=0)
    policy = MLPActorCritic(hidden_sizes=(32, 32), init_log_std=-0.5)
    policy.configure_spaces(obs, env.action_shape, env.action_choices)
    policy.configure_model()
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    out = policy.act(obs, generators=gens)
    logprob, entropy, value = policy.evaluate(TensorDict({"obs": obs, "action": out["action"]}, [4]))
    assert torch.allclose(logprob, out["logprob"], atol=1e-5) and torch.allclose(value, out["value"])
    again = policy.act(obs, generators=[torch.Generator().manual_seed(i) for i in range(4)])
    assert torch.equal(again["action"], out["action"])  # a row's noise is its generator's
    loaded = MLPActorCritic(str(policy.save_pretrained(tmp_path / "mlp")))
    loaded.configure_spaces(obs, env.action_shape, env.action_choices)
    loaded.configure_model()
    assert torch.equal(
        loaded.act(obs, deterministic=True)["action"], policy.act(obs, deterministic=True)["action"]
    )
    env.close()


def test_a_multi_discrete_head_samples_each_entry_within_its_own_choices():
    """``MultiDiscrete([3, 5])``: one categorical per entry, the narrower one's padded logits never
    drawn nor counted in the entropy (a near-uniform new head: log 3 + log 5)."""
    obs = TensorDict({"observation": torch.randn(400, 4)}, [400])
    policy = MLPActorCritic(hidden_sizes=(16,))
    policy.configure_spaces(obs[:1], (2,), (3, 5))
    policy.configure_model()
    out = policy.act(obs, generators=[torch.Generator().manual_seed(i) for i in range(400)])
    assert out["action"].dtype == torch.long and out["action"].shape == (400, 2)
    first, second = out["action"].unbind(-1)
    assert set(first.tolist()) == {0, 1, 2} and set(second.tolist()) == {0, 1, 2, 3, 4}
    logprob, entropy, _ = policy.evaluate(TensorDict({"obs": obs, "action": out["action"]}, [400]))
    assert torch.allclose(logprob, out["logprob"], atol=1e-6)
    assert entropy.mean().item() == pytest.approx(math.log(3) + math.log(5), abs=1e-3)


def test_the_rollout_values_final_observations_only_where_an_episode_was_truncated():
    from rlinf_lightning.flow.stage import StageContext
    from rlinf_lightning.workflows.embodied.rollout import EnvRolloutStage

    env = make_env(ENV, 4)
    obs = env.reset(seed=0)
    final = env.reset(seed=1)
    policy = MLPActorCritic(hidden_sizes=(32, 32))
    policy.configure_spaces(obs, env.action_shape, env.action_choices)
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


def _workload(name):
    """``(algorithm, task, policy)`` of an equivalence workload. ``ppo`` (FetchReach): a 4-step
    time limit, so every iteration truncates episodes and GAE bootstraps from final values, and
    episodes run on across iterations (the env state is carried). ``grpo`` over episodes: groups of
    4 envs sharing reset seeds, new episodes every iteration. ``discrete``: PPO on CartPole's
    Discrete(2) actions (an 8-step limit: episodes terminate and truncate), with a ``target_kl``
    that stops some iterations' passes early (a decision every replica must make alike)."""
    from rlinf_lightning.algorithms import GRPO

    if name == "grpo":
        task = EmbodiedTask(ENV, num_envs=8, steps=12, group_size=4, eval_episodes=2)
        return GRPO(), task, MLPActorCritic(hidden_sizes=(32, 32), init_log_std=-0.5, lr=1e-2)
    if name == "discrete":
        task = EmbodiedTask(
            DISCRETE_ENV, env_kwargs={"max_episode_steps": 12}, num_envs=8, steps=16, eval_metric="return"
        )
        algorithm = PPO(update_epochs=4, num_minibatches=4, target_kl=DISCRETE_TARGET_KL)
        return algorithm, task, MLPActorCritic(hidden_sizes=(32, 32), lr=1e-2)
    task = EmbodiedTask(ENV, env_kwargs={"max_episode_steps": 4}, num_envs=8, steps=10, eval_episodes=2)
    return PPO(update_epochs=2, num_minibatches=4), task, MLPActorCritic(hidden_sizes=(32, 32))


DISCRETE_TARGET_KL = 0.01


def _fit(root, strategy, launcher, devices=2, iterations=3, workload="ppo", micro_batch=None):
    """``iterations`` iterations of a workload (:func:`_workload`) queued as configs run them (no
    checkpoint or evaluation between), the actor's minibatches in pieces of ``micro_batch``
    samples; returns the trainer, the summary, each iteration's metrics and the final weights."""
    from trainer_defaults import MetricsRecorder

    steps = MetricsRecorder()
    algorithm, task, policy = _workload(workload)
    task.train_micro_batch_size = micro_batch
    trainer = RLTrainer(
        algorithm=algorithm,
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
        timeout_s=scaled(120),
    )
    summary = trainer.fit(policy, task)
    last = (root / "checkpoints" / "last").read_text()
    return trainer, summary, steps.metrics, load_file(str(root / "checkpoints" / last / "model.safetensors"))


def _assert_same_run(name, launcher, metrics, weights, ref_metrics, ref_weights):
    assert len(metrics) == len(ref_metrics) == 3 and weights.keys() == ref_weights.keys()
    optional = ("env/return", "advantage/groups_with_signal", "actor/epochs", "actor/explained_variance")
    for it, (m, r) in enumerate(zip(metrics, ref_metrics, strict=True)):
        # and what only some iterations or workloads report (the returns of the episodes that ended)
        for key in (*COMPARED, *(k for k in optional if k in r)):
            assert m[key] == pytest.approx(r[key], abs=1e-4), (name, launcher, it, key)
    diff = max(float((weights[k] - ref_weights[k]).abs().max()) for k in weights)
    assert diff <= 1e-4, (name, launcher, diff)


def _initial_weights(workload):
    _, task, initial = _workload(workload)
    env = make_env(task.env, 1)
    initial.configure_spaces(env.reset(seed=0), env.action_shape, env.action_choices)
    initial.configure_model()
    env.close()
    return initial.model.state_dict()


PLANS = {
    "collocated_1worker": CollocatedStrategy(replicas=1),
    "collocated": "collocated",  # two replicas of every stage; each env replica owns half the envs
    "disaggregated": "disaggregated",  # the env alone on one slot, four shards pipelined
    "hybrid": HybridStrategy(placement="env,rollout: 0, advantage,actor: 1"),
    # RLinf's ManiSkill placement on two slots: env and rollout pipeline, then the actor trains with
    # ddp on both, each replica taking its turn on its slot after theirs (offloading around it)
    "overlapping": HybridStrategy(placement="actor,advantage: 0-1, env: 0, rollout: 1", offload=True),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The one-worker plan's run of a workload (made once per workload): what every other plan
    must reproduce."""
    runs = {}

    def run(workload):
        if workload not in runs:
            root = tmp_path_factory.mktemp(workload)
            _, _, metrics, weights = _fit(root, PLANS["collocated_1worker"], "inprocess", workload=workload)
            moved = max(float((weights[k] - v).abs().max()) for k, v in _initial_weights(workload).items())
            assert moved > 1e-3  # the Adam steps moved the weights well past the tolerance below
            assert any(abs(m["actor/loss"]) > 0 for m in metrics)  # it learned
            if workload != "grpo":
                assert len({round(m["env/return"], 6) for m in metrics}) == 3  # episodes end every iteration
            if workload == "discrete":  # target_kl stopped some iteration early, not all at once
                assert 1 <= min(m["actor/epochs"] for m in metrics) < 4
                assert "actor/explained_variance" in metrics[0]
            runs[workload] = metrics, weights
        return runs[workload]

    return run


# every workload under every plan in process; under the processes and ray launchers PPO on the
# plans whose code paths differ by default (what GRPO and the discrete workload add is the plans'
# business, not the transports'), the rest with `-m slow`; the discrete one never under ray. Ray's
# case (90 s in CI) is slow too: Ray's channels and weight syncs stay in the default run through
# test_plans' broadcast case, test_ray_cluster and the Ray fault case.
def _equivalence_marks(workload: str, case) -> tuple:
    """Ray: slow for every workload; PPO keeps the matrix's own marks; the others run in process only
    by default."""
    launcher = case.values[1]
    if launcher == "ray" or (workload != "ppo" and launcher != "inprocess"):
        return (pytest.mark.slow,)
    return tuple(case.marks) if workload == "ppo" else ()


EQUIVALENCE = [
    pytest.param(workload, *case.values, id=f"{workload}-{case.id}", marks=_equivalence_marks(workload, case))
    for workload in ("ppo", "grpo", "discrete")
    for case in launcher_matrix(PLANS)
    if (workload, case.values[1]) != ("discrete", "ray")
]


@pytest.mark.parametrize(("workload", "name", "launcher"), EQUIVALENCE)
def test_three_iterations_are_the_same_updates_under_every_plan(
    tmp_path, reference, workload, name, launcher
):
    """Three queued iterations: loss, grad norm and episode returns per iteration (and for PPO the
    explained variance and the passes ``target_kl`` allowed) and the final weights equal the
    one-worker plan's under every plan and launcher (the weights synced to the rollout and the
    envs carried from one iteration to the next included). Workloads: PPO on FetchReach, GRPO over
    episodes, PPO on CartPole's discrete actions."""
    ref_metrics, ref_weights = reference(workload)
    _, _, metrics, weights = _fit(tmp_path / name, PLANS[name], launcher, workload=workload)
    _assert_same_run(name, launcher, metrics, weights, ref_metrics, ref_weights)


@pytest.mark.parametrize("workload", ["ppo", "grpo"])
def test_micro_batches_accumulate_to_the_same_update(tmp_path, reference, workload):
    """``task.train_micro_batch_size`` 3 (the PPO minibatches of 20 samples in pieces of 3, 3, ...,
    2; GRPO's whole batch of 96 in 32 pieces): gradient accumulation makes the one-worker plan's
    updates, the metrics included, to float32's rounding."""
    ref_metrics, ref_weights = reference(workload)
    _, _, metrics, weights = _fit(
        tmp_path, PLANS["collocated_1worker"], "inprocess", workload=workload, micro_batch=3
    )
    _assert_same_run("micro_batch=3", "inprocess", metrics, weights, ref_metrics, ref_weights)


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
    from rlinf_lightning.workflows.embodied.advantage import EpisodeAdvantageStage
    from rlinf_lightning.workflows.embodied.env import EnvStage

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
            "policy_version": torch.zeros(n, steps, dtype=torch.long),
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


def test_training_reset_seeds_never_reach_the_evaluation_episodes_seeds():
    from rlinf_lightning.workflows.embodied.env import EVAL_SEED, EnvStage

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
    from rlinf_lightning.workflows.embodied.env import EnvStage

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


# -- CartPole (discrete actions) from its config ---------------------------------------------------

CARTPOLE = Path(__file__).parents[1] / "configs" / "embodied_ppo_cartpole.yaml"


def _fit_cartpole(root: Path, iterations: int, seed: int = 0) -> tuple[dict, list[float]]:
    """``rlinf fit`` on the CartPole config for ``iterations`` iterations (the learning rate
    annealed over them): the summary and each iteration's mean training episode return."""
    from rlinf_lightning.cli import main

    main(["fit", f"--config={CARTPOLE}", f"--trainer.seed={seed}", f"--trainer.default_root_dir={root}",
          "--trainer.logger=csv", "--trainer.enable_progress_bar=false",
          f"--trainer.max_iterations={iterations}", f"--trainer.eval_every={iterations}",
          f"--trainer.ckpt_every={iterations}",
          f"--policy.init_args.anneal_lr_steps={iterations * 16}"])  # fmt: skip
    rows = csv.DictReader((root / "logs" / "version_0" / "metrics.csv").open())
    returns = [float(r["env/return"]) for r in rows if r.get("env/return")]
    return json.loads((root / "summary.json").read_text()), returns


# a learning run: `-m slow`; the default run keeps the one-step cases (test_vla: an optimizer step
# lowers the policy-gradient loss; the log-probs the update uses are the rollout's, above)
@pytest.mark.slow
def test_ppo_learns_cartpole_from_its_config(tmp_path):
    """40 iterations (20k env steps): the training episodes' return rises from ~22 (a random
    policy) to over 2.5x that, and the deterministic evaluation from ~10 to over 100 (a policy
    gradient of the wrong sign stays at ~22 and ~10)."""
    summary, returns = _fit_cartpole(tmp_path / "run", 40)
    start, end = sum(returns[:3]) / 3, sum(returns[-5:]) / 5
    assert start < 30 and end > 2.5 * start, (start, end)
    assert summary["eval_return_before"] < 20 and summary["eval_return_after"] > 100, summary
    assert "eval_success" not in summary  # CartPole has no success: the headline is the return, no NaN


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_ppo_reaches_475_on_cartpole_within_500k_env_steps(tmp_path, seed):
    """The config as it is (976 iterations, 499 712 env steps): the deterministic evaluation's
    mean return and the last 50k env steps' training episodes reach 475 (CleanRL: 490 +- 6)."""
    summary, returns = _fit_cartpole(tmp_path / "run", 976, seed)
    assert summary["eval_return_after"] >= 475, summary
    assert sum(returns[-98:]) / 98 >= 475  # the last 98 iterations that ended episodes (>= 50k steps)
    assert summary["wall_s"] < 600


# -- what the embodied workflow cannot serve: refused before anything loads ----------------------


def _refusal(algorithm, task, policy) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        RLTrainer(algorithm=algorithm, devices=1, logger=False).validate(policy, task)
    return info.value


def test_an_algorithm_reading_what_the_embodied_workflow_lacks_is_refused_naming_it():
    from rlinf_lightning.algorithms import GRPO

    task, policy = EmbodiedTask(DISCRETE_ENV, num_envs=8, group_size=4), MLPActorCritic()
    error = _refusal(GRPO(kl_coef=0.1), task, policy)  # a KL to a reference: no reference here
    assert error.keys == ["trainer.algorithm"] and "GRPO reads ref_logprobs" in str(error)
    error = _refusal(PPO(kl_coef=0.1), EmbodiedTask(DISCRETE_ENV), policy)  # PPO's KL is for tokens
    assert error.keys == ["trainer.algorithm"] and "PPO reads ref_logprobs" in str(error)

    class Custom:  # says nothing of what it reads, nor has the options the workflow reads
        def compute_advantages(self, *args): ...

    error = _refusal(Custom(), task, policy)
    assert error.keys == ["trainer.algorithm"] and "Custom lacks reads, needs_reference" in str(error)


def test_a_policy_that_cannot_serve_the_envs_actions_is_refused_naming_the_env_and_the_space():
    from rlinf_lightning.policies import TinyVLA

    error = _refusal(PPO(), EmbodiedTask(DISCRETE_ENV), TinyVLA())
    assert error.keys == ["task.env"], error
    assert "CartPole-v1 (actions: discrete, choices (2,))" in str(error) and "continuous" in str(error)


def test_every_ppo_option_out_of_range_is_refused_with_one_line_naming_it():
    bad = {"gamma": 1.5, "gae_lambda": -0.1, "clip_eps": 0.0, "clip_eps_high": -0.2, "dual_clip": 1.0,
           "value_clip": 0.0, "vf_coef": -1.0, "ent_coef": -0.01, "update_epochs": 0, "num_minibatches": 0,
           "target_kl": 0.0, "kl_coef": -1.0, "kl_estimator": "k9", "kl_target": 0.0, "kl_horizon": 0,
           "loss_agg": "nope", "critic_warmup": -1, "behaviour_weight_cap": 1.0,
           "off_policy_correction": "decoupld"}  # fmt: skip
    switches = {"norm_adv", "kl_in_reward"}
    assert set(bad) == {f.name for f in dataclasses.fields(PPO)} - switches  # every numeric option
    RLTrainer(algorithm=PPO(**{k: None for k in ("clip_eps_high", "dual_clip", "value_clip")})).validate()
    for key, value in bad.items():
        with pytest.raises(ConfigError) as info:
            RLTrainer(algorithm=PPO(**{key: value})).validate()
        assert info.value.keys == [f"trainer.algorithm.{key}"], key
        assert str(value) in str(info.value) and len(str(info.value).splitlines()) == 2  # header + 1 line


def test_explained_variance_hand_computed():
    """``1 - Var(R - V) / Var(R)``: returns 1..4 against values (1, 2, 3, 3): 1 - 0.1875 / 1.25."""
    from rlinf_lightning.flow.metrics import Metrics
    from rlinf_lightning.flow.stage import StageContext
    from rlinf_lightning.workflows.embodied.actor import PPOActorStage

    stage = PPOActorStage.__new__(PPOActorStage)  # only its batch statistics, no engine
    stage.ctx = StageContext("cpu", 0, 1, 1, [0])
    data = TensorDict({"return": torch.tensor([1.0, 2, 3, 4]), "value": torch.tensor([1.0, 2, 3, 3])}, [4])
    metrics = Metrics()
    stage._explained_variance(data, metrics)
    assert metrics.compute()["explained_variance"] == pytest.approx(1 - 0.1875 / 1.25)


def test_a_success_headline_the_env_cannot_report_falls_back_to_the_return(tmp_path, capsys):
    """The FetchReach recipe (``eval_metric: success``) on Acrobot, which has no notion of
    success: one warning, and every headline (evaluation lines, summary) is the return, never NaN."""
    from rlinf_lightning.cli import main

    config = Path(__file__).parents[1] / "configs" / "embodied_ppo_fetchreach.yaml"
    status = main([
        "fit", f"--config={config}", f"--trainer.default_root_dir={tmp_path / 'run'}",
        "--task.init_args.env=Acrobot-v1", "--task.init_args.env_kwargs={max_episode_steps: 16}",
        "--task.init_args.num_envs=2", "--task.init_args.steps=8", "--task.init_args.eval_episodes=2",
        "--trainer.max_iterations=1", "--trainer.logger=false",
    ])  # fmt: skip
    out, err = capsys.readouterr()
    assert status == 0, err
    assert err.count("task.eval_metric is success, but Acrobot-v1 reported no success") == 1, err
    assert "held-out return" in out and "nan" not in out.lower(), out
    text = (tmp_path / "run" / "summary.json").read_text()
    summary = json.loads(text)
    assert summary["eval_metric"] == "return" and "eval_success_after" not in summary and "NaN" not in text
    assert all(math.isfinite(summary[k]) for k in ("eval_return_before", "eval_return_after"))


def test_the_memory_check_warns_only_where_the_user_can_act(caplog):
    """A simulator's memory is unknown before it runs: the check counts it as nothing, without a
    warning the user could do nothing about (a policy that cannot be sized still warns)."""
    task = EmbodiedTask(DISCRETE_ENV, num_envs=2, steps=4, eval_metric="return")
    RLTrainer(algorithm=PPO(num_minibatches=2), logger=False).validate(MLPActorCritic(), task)
    assert "memory check" not in caplog.text

    class Unsized(MLPActorCritic):
        def parameter_count(self):
            return None

    RLTrainer(algorithm=PPO(num_minibatches=2), logger=False).validate(Unsized(), task)
    assert "memory check: stage(s) actor, rollout give no estimate" in caplog.text
