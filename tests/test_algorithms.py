import math

import pytest
import torch

from rlinf_lightning.algorithms import ALGORITHMS, GRPO
from rlinf_lightning.algorithms.advantages import group_normalized_advantages
from rlinf_lightning.algorithms.contract import reads
from rlinf_lightning.algorithms.losses import aggregate, kl_k3, ppo_clip_per_token


def test_group_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    groups = torch.tensor([7, 7, 7, 3, 3, 3])
    adv = group_normalized_advantages(rewards, groups, eps=0.0)
    # group 7: mean 1/3, unbiased std sqrt(1/3): (2/3)/0.57735 = 1.1547, (-1/3)/0.57735 = -0.57735
    s = math.sqrt(1 / 3)
    expected = torch.tensor([(2 / 3) / s, (-1 / 3) / s, (-1 / 3) / s, (-2 / 3) / s, (1 / 3) / s, (1 / 3) / s])
    torch.testing.assert_close(adv, expected)
    centred = group_normalized_advantages(rewards, groups, scale_std=False)
    torch.testing.assert_close(centred, torch.tensor([2 / 3, -1 / 3, -1 / 3, -2 / 3, 1 / 3, 1 / 3]))


def test_equal_rewards_and_groups_of_one_give_zero_advantage():
    adv = group_normalized_advantages(torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]))
    assert adv[:2].tolist() == [0.0, 0.0] and adv[2] < 0 < adv[3]
    # a group of one has no baseline: no signal (not r / eps, not NaN)
    alone = group_normalized_advantages(torch.tensor([0.0, 1.0, 5.0]), torch.tensor([0, 0, 1]))
    assert alone[2] == 0.0 and alone[0] < 0 < alone[1]


def test_ppo_clip_hand_computed():
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.0]]))  # ratios 1.5, 0.5, 1.0 against old = 0
    old = torch.zeros(1, 3)
    loss, clipped = ppo_clip_per_token(
        logp, old, torch.tensor([[1.0, -1.0, 2.0]]), clip_low=0.2, clip_high=0.3
    )
    # A=+1, r=1.5: min(1.5, 1.3) -> 1.3 ; A=-1, r=0.5: min(-0.5, -0.8) -> -0.8 ; A=2, r=1: 2
    torch.testing.assert_close(loss, torch.tensor([[-1.3, 0.8, -2.0]]))
    assert clipped.tolist() == [[1.0, 1.0, 0.0]]


def test_kl_k3_hand_computed_and_nonnegative():
    logp = torch.tensor([0.0, -1.0])
    ref = torch.tensor([0.0, -2.0])
    # d = ref - logp = [0, -1]: exp(d) - d - 1 = [0, e^-1]
    torch.testing.assert_close(kl_k3(logp, ref), torch.tensor([0.0, math.exp(-1.0)]))
    assert (kl_k3(torch.randn(100), torch.randn(100)) >= 0).all()
    # float32 log-probs a rounding apart (the actor's and the rollout's of the same token): exp(d) - 1
    # in float32 cancelled to -6e-8 for a tenth of these
    logp = torch.full((1000,), -1.0)
    assert (kl_k3(logp, logp + torch.linspace(-3e-7, 3e-7, 1000)) >= 0).all()


def test_aggregations_hand_computed():
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    s, c = aggregate(v, m, "token-mean")
    assert (float(s), float(c)) == (10.0, 4.0)
    s, c = aggregate(v, m, "seq-mean-token-mean")
    assert (float(s), float(c)) == (2.0 + 4.0, 2.0)
    s, c = aggregate(v, m, "seq-mean-token-sum")
    assert (float(s), float(c)) == (6.0 + 4.0, 2.0)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_loss_sum_over_micro_batches_equals_whole_batch(agg):
    """Sum/count aggregation is what makes a split batch give the same gradient as a whole one."""
    torch.manual_seed(0)
    logits = torch.randn(8, 5, requires_grad=True)
    old = torch.randn(8, 5).detach() * 0.1 + logits.detach()
    adv, mask = torch.randn(8), (torch.rand(8, 5) > 0.3).float()
    ref = old + 0.05
    algo = GRPO(kl_coef=0.1, loss_agg=agg)
    s, c, _ = algo.loss(logits, old, adv, mask, ref)
    (g_whole,) = torch.autograd.grad(s / c, logits)
    total_s, total_c = 0.0, 0.0
    for idx in (slice(0, 3), slice(3, 8)):
        si, ci, _ = algo.loss(logits[idx], old[idx], adv[idx], mask[idx], ref[idx])
        total_s, total_c = total_s + si, total_c + ci
    (g_split,) = torch.autograd.grad(total_s / total_c, logits)
    torch.testing.assert_close(g_whole, g_split)


def test_registry_resolves_names_and_objects():
    assert isinstance(ALGORITHMS.resolve("grpo"), GRPO)
    mine = GRPO(kl_coef=0.5)
    assert ALGORITHMS.resolve(mine) is mine
    with pytest.raises(KeyError, match="Did you mean 'grpo'"):
        ALGORITHMS.get("grp")


# -- PPO: GAE, dual clip, clipped value loss, by hand ------------------------------------------------


def test_gae_bootstraps_on_truncation_and_not_on_termination():
    from rlinf_lightning.algorithms.advantages import gae

    # one env, three steps: step 0 truncated (a time limit), step 1 terminated, step 2 runs on
    r = torch.tensor([[1.0, 2.0, 3.0]])
    v = torch.tensor([[0.5, 0.25, 1.0]])
    term = torch.tensor([[False, True, False]])
    trunc = torch.tensor([[True, False, False]])
    final_v = torch.tensor([[4.0, 9.0, 9.0]])  # V of the truncated episode's last observation
    next_v = torch.tensor([2.0])
    g, lam = 0.9, 0.5
    adv, ret = gae(r, v, term, trunc, final_v, next_v, gamma=g, lam=lam)
    a2 = 3.0 + g * 2.0 - 1.0  # bootstraps from next_value
    a1 = 2.0 + g * 0.0 - 0.25  # terminal: no bootstrap, and the recursion restarts
    a0 = 1.0 + g * 4.0 - 0.5  # truncated: bootstrap from V(final obs), recursion restarts
    assert torch.allclose(adv, torch.tensor([[a0, a1, a2]]))
    assert torch.allclose(ret, adv + v)
    # without episode ends, the lambda-return recursion chains the deltas
    none = torch.zeros_like(term)
    adv, _ = gae(r, v, none, none, final_v, next_v, gamma=g, lam=lam)
    d = [1.0 + g * 0.25 - 0.5, 2.0 + g * 1.0 - 0.25, 3.0 + g * 2.0 - 1.0]
    expected = [d[0] + g * lam * (d[1] + g * lam * d[2]), d[1] + g * lam * d[2], d[2]]
    assert torch.allclose(adv, torch.tensor([expected]))


def test_ppo_dual_clip_caps_the_loss_on_negative_advantages():
    from rlinf_lightning.algorithms.losses import ppo_clip_per_token

    logp = torch.log(torch.tensor([5.0, 5.0, 0.5]))  # ratios 5, 5, 0.5 against old log-prob 0
    adv = torch.tensor([-1.0, 1.0, -1.0])
    loss, clipped = ppo_clip_per_token(logp, torch.zeros(3), adv, clip_low=0.2, clip_high=0.2)
    assert torch.allclose(loss, torch.tensor([5.0, -1.2, 0.8]))  # -min(rA, clip(r)A)
    loss, clipped = ppo_clip_per_token(logp, torch.zeros(3), adv, clip_low=0.2, clip_high=0.2, dual_clip=3.0)
    assert torch.allclose(loss, torch.tensor([3.0, -1.2, 0.8]))  # 5 capped at -3 * A = 3
    assert clipped.tolist() == [1.0, 1.0, 1.0]


def test_ppo_loss_sums_clipped_value_and_entropy_terms():
    from rlinf_lightning.algorithms import PPO

    algo = PPO(clip_eps=0.2, value_clip=0.5, vf_coef=0.5, ent_coef=0.1)
    logp, old = torch.tensor([0.0, 0.0]), torch.tensor([0.0, 0.0])
    adv = torch.tensor([1.0, -2.0])
    values, old_values, returns = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 0.0]), torch.tensor([1.0, 1.0])
    entropy = torch.tensor([1.0, 3.0])
    loss_sum, count, m = algo.loss(logp, old, adv, values, old_values, returns, entropy)
    # pg: ratio 1 -> -A; value: max((2-1)^2, (0.5-1)^2)/2 = 0.5 and max(1, 1)/2 = 0.5; entropy bonus
    expected = (-1.0 + 0.5 * 0.5 - 0.1 * 1.0) + (2.0 + 0.5 * 0.5 - 0.1 * 3.0)
    assert torch.isclose(loss_sum, torch.tensor(expected)) and float(count) == 2.0
    assert float(m["value_loss"]) == 0.5 and float(m["entropy"]) == 2.0


def test_truncated_importance_sampling_weights_tokens_by_the_capped_mismatch():
    """GRPO(tis_cap): the ratio is against the actor's own log-probs (value 1 at the step), each
    token's loss weighted by min(pi_actor / pi_rollout, cap); without a mismatch, plain GRPO."""
    torch.manual_seed(0)
    logits = torch.randn(2, 5, requires_grad=True)
    logp = torch.log_softmax(logits, -1)
    rollout = logp.detach() + torch.tensor([[0.0, 0.5, -0.5, -2.0, 0.1], [0.0, 0.0, 0.0, 0.0, 0.0]])
    adv, mask = torch.tensor([1.0, -1.0]), torch.ones(2, 5)
    loss, count, metrics = GRPO(tis_cap=2.0).loss(logp, logp.detach(), adv, mask, rollout_logprobs=rollout)
    weight = torch.exp(logp.detach() - rollout).clamp(max=2.0)
    expected = (-(torch.exp(logp - logp.detach()) * adv[:, None]) * weight).sum()
    assert torch.allclose(loss, expected) and count == 10
    assert metrics["tis_weight"] == pytest.approx(float(weight.mean()))
    assert weight.max() == 2.0 and weight.min() < 1.0  # capped above, and below 1 where pi_rollout > pi
    same = GRPO(tis_cap=2.0).loss(logp, logp.detach(), adv, mask, rollout_logprobs=logp.detach())[0]
    assert torch.allclose(same, GRPO().loss(logp, logp.detach(), adv, mask)[0])


def test_an_estimator_and_a_loss_registered_by_name_are_what_grpo_computes():
    from rlinf_lightning.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSSES

    @reads("rewards", "group_ids")
    def leave_one_out(inputs, config):
        rewards, group_ids = inputs["rewards"], inputs["group_ids"]
        _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
        sums = torch.zeros(len(counts), dtype=rewards.dtype).index_add_(0, inverse, rewards)
        n = counts[inverse].to(rewards.dtype)
        return rewards - (sums[inverse] - rewards) / (n - 1)

    def plain_pg(logprobs, old_logprobs, advantages, mask, config):
        return -advantages * logprobs, {"plain": torch.tensor(1.0)}

    ADVANTAGE_ESTIMATORS.register("test_rloo", leave_one_out)
    POLICY_LOSSES.register("test_plain_pg", plain_pg)
    alg = GRPO(advantage_estimator="test_rloo", policy_loss="test_plain_pg")
    adv = alg.compute_advantages(
        {"rewards": torch.tensor([1.0, 0.0, 0.0, 2.0]), "group_ids": torch.tensor([7, 7, 7, 9])}
    )
    # group 7: 1 - 0, 0 - 0.5, 0 - 0.5 (by hand); group 9 has one sample and no baseline: 2 - 0/0
    assert adv[:3].tolist() == [1.0, -0.5, -0.5]
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss_sum, count, metrics = alg.loss(logp, logp.detach(), torch.tensor([2.0]), torch.ones(1, 2))
    assert loss_sum.item() == pytest.approx(6.0) and count.item() == 2 and "plain" in metrics
    assert "clip_frac" not in metrics  # the registered loss ran, not ppo_clip


def test_out_of_range_or_unknown_algorithm_options_are_refused_before_anything_loads():
    from rlinf_lightning import RLTrainer
    from rlinf_lightning.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        RLTrainer(algorithm=GRPO(tis_cap=-1.0, advantage_estimator="nope")).validate()
    assert set(info.value.keys) == {"trainer.algorithm.tis_cap", "trainer.algorithm.advantage_estimator"}
    assert "unknown advantage estimator 'nope'" in str(info.value)


# -- the estimators of the presets, by hand ----------------------------------------------------------


def _estimate(name, config=None, **inputs):
    from rlinf_lightning.algorithms import ADVANTAGE_ESTIMATORS

    return ADVANTAGE_ESTIMATORS.get(name)(inputs, config or GRPO())


def test_rloo_leaves_each_sample_out_of_its_baseline():
    r, g = torch.tensor([1.0, 0.0, 0.0, 3.0, 2.0, 2.0, 7.0]), torch.tensor([4, 4, 4, 1, 1, 9, 2])
    adv = _estimate("rloo", rewards=r, group_ids=g)
    # group 4: 1 - (0+0)/2, 0 - (1+0)/2, 0 - (1+0)/2 ; group 1: 3 - 2, 2 - 3 ; group 9 and 2: alone -> 0
    assert adv.tolist() == [1.0, -0.5, -0.5, 1.0, -1.0, 0.0, 0.0]
    assert _estimate("rloo", rewards=torch.ones(3), group_ids=torch.zeros(3)).tolist() == [0.0] * 3


def test_reinforce_plus_plus_returns_to_go_over_response_tokens():
    from rlinf_lightning.algorithms import ReinforcePlusPlus

    tr = torch.tensor([[-0.1, -0.2, 1.0, 5.0], [0.5, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])  # the 5.0 is padding
    adv = _estimate("reinforce_plus_plus", ReinforcePlusPlus(gamma=0.5), token_rewards=tr, response_mask=mask)
    # row 0: G2 = 1, G1 = -0.2 + 0.5 * 1 = 0.3, G0 = -0.1 + 0.5 * 0.3 = 0.05 ; row 1: 0.5
    torch.testing.assert_close(adv, torch.tensor([[0.05, 0.3, 1.0, 0.0], [0.5, 0.0, 0.0, 0.0]]))


def test_reinforce_plus_plus_baseline_centres_without_the_std():
    adv = _estimate(
        "reinforce_plus_plus_baseline",
        rewards=torch.tensor([1.0, 0.0, 0.0, 4.0]),
        group_ids=torch.tensor([0, 0, 0, 1]),
    )
    torch.testing.assert_close(adv, torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.0]))


def test_token_rewards_put_the_outcome_on_the_last_token_and_the_kl_on_every_token():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 9.0, 9.0]])
    out = GRPO().token_rewards(torch.tensor([1.0, 2.0]), mask, kl, 0.5)
    torch.testing.assert_close(out, torch.tensor([[-0.05, -0.1, 1.0 - 0.15], [2.0 - 0.2, 0.0, 0.0]]))


def test_dapo_overlong_penalty_falls_linearly_over_the_buffer():
    from rlinf_lightning.algorithms import DAPO

    dapo = DAPO(overlong_buffer=0.25, overlong_penalty=2.0)  # horizon 20: buffer of the last 5 tokens
    pen = dapo.overlong_penalty_of(torch.tensor([10, 15, 17, 20]), 20)
    torch.testing.assert_close(pen, torch.tensor([0.0, 0.0, -2.0 * 2 / 5, -2.0]))
    assert GRPO().overlong_penalty_of(torch.tensor([20]), 20).tolist() == [0.0]  # off by default


# -- the policy losses of the presets, by hand -------------------------------------------------------


def test_ppo_clip_loss_applies_the_dual_clip_option():
    logp = torch.log(torch.tensor([[5.0, 0.5]]))
    adv = torch.tensor([[-1.0, -1.0]])
    loss, _, _ = GRPO(dual_clip=3.0).loss(logp, torch.zeros(1, 2), adv, torch.ones(1, 2))
    assert float(loss) == pytest.approx(3.0 + 0.8)  # 5 capped at 3; 0.5 -> clip 0.8
    loss, _, _ = GRPO().loss(logp, torch.zeros(1, 2), adv, torch.ones(1, 2))
    assert float(loss) == pytest.approx(5.0 + 0.8)


def test_gspo_clips_one_length_normalised_ratio_per_sequence():
    from rlinf_lightning.algorithms import GSPO

    old = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    # row 0: log-ratios 0.2, 0.0 (+ a masked 9.0): s = exp(0.1) ; row 1: all 0.01 -> s = exp(0.01)
    logp = torch.tensor([[0.2, 0.0, 9.0], [0.01, 0.01, 0.01]], requires_grad=True)
    adv = torch.tensor([1.0, 1.0])
    algo = GSPO(clip_eps=0.05, clip_eps_high=0.05)
    loss, count, metrics = algo.loss(logp, old, adv, mask)
    # row 0: s = 1.105 > 1.05 with A > 0 -> clipped to 1.05, no gradient ; row 1: s = 1.01, unclipped
    s1 = math.exp(0.01)
    assert float(loss.detach()) == pytest.approx(-1.05 - s1, rel=1e-5) and float(count) == 2
    assert float(metrics["clip_frac"]) == pytest.approx(2 / 5)
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[0].abs().sum() == 0  # the clipped sequence gives nothing, masked token included
    # d/dlogp_t of -s over its 3 tokens (seq-mean-token-mean: mean over tokens of the same -s) = -s / 3
    torch.testing.assert_close(grad[1], torch.full((3,), -s1 / 3))


def test_cispo_keeps_the_gradient_of_clipped_tokens_through_the_detached_weight():
    from rlinf_lightning.algorithms import CISPO

    logp = torch.log(torch.tensor([[2.0, 0.5, 1.1]])).requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    loss, count, metrics = CISPO(clip_eps=0.2, clip_eps_high=0.28).loss(
        logp, torch.zeros(1, 3), adv, torch.ones(1, 3)
    )
    # weights clip(2.0, 0.8, 1.28) = 1.28, clip(0.5) = 0.8, 1.1 ; loss = -sum(w * A * logp)
    w = torch.tensor([1.28, 0.8, 1.1])
    expected = -(w * adv[0] * logp.detach()[0]).sum()
    assert float(loss.detach()) == pytest.approx(float(expected)) and float(count) == 3
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad[0], -w * adv[0])  # every token keeps a gradient, PPO's would be 0
    assert float(metrics["clip_frac"]) == pytest.approx(2 / 3)


def test_kl_estimators_k1_k2_k3_by_hand():
    from rlinf_lightning.algorithms.losses import kl_penalty

    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -1.0])
    assert kl_penalty(logp, ref, "k1").tolist() == [1.0, -1.0]
    assert kl_penalty(logp, ref, "k2").tolist() == [0.5, 0.5]
    torch.testing.assert_close(
        kl_penalty(logp, ref, "k3"), torch.tensor([math.exp(-1) + 1 - 1, math.exp(1) - 1 - 1])
    )


def test_kl_in_the_loss_with_each_estimator_and_a_coefficient_override():
    logp, old, ref = torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([[-1.0, 0.0]])
    mask = torch.ones(1, 2)
    adv = torch.zeros(1)  # only the KL term is left
    for est, per_token in (("k1", [1.0, 0.0]), ("k2", [0.5, 0.0]), ("k3", [math.exp(-1) - (-1) - 1, 0.0])):
        loss, count, m = GRPO(kl_coef=0.1, kl_estimator=est).loss(logp, old, adv, mask, ref)
        assert float(loss) == pytest.approx(0.1 * sum(per_token)), est
        loss, _, _ = GRPO(kl_coef=0.1, kl_estimator=est).loss(logp, old, adv, mask, ref, kl_coef=0.3)
        assert float(loss) == pytest.approx(0.3 * sum(per_token)), est
    loss, _, m = GRPO(kl_coef=0.1, kl_in_reward=True).loss(logp, old, adv, mask, ref)
    assert float(loss) == 0.0 and "kl" not in m  # in the reward, not in the loss


def test_adaptive_kl_coefficient_moves_towards_the_target_by_at_most_20_percent():
    from rlinf_lightning.algorithms.policy_gradient import adapt_kl_coef

    assert adapt_kl_coef(0.1, 0.2, 0.1, 100, 50) == pytest.approx(0.1 * (1 + 0.2 * 0.5))  # error capped
    assert adapt_kl_coef(0.1, 0.09, 0.1, 100, 100) == pytest.approx(0.1 * (1 - 0.1))


def test_entropy_bonus_subtracts_the_weighted_entropy():
    logp, mask = torch.zeros(1, 2), torch.tensor([[1.0, 0.0]])
    entropy = torch.tensor([[2.0, 50.0]])  # the masked 50 must not count
    loss, count, _ = GRPO(entropy_coef=0.1).loss(logp, logp, torch.zeros(1), mask, entropy=entropy)
    assert float(loss) == pytest.approx(-0.2) and float(count) == 1.0
    with pytest.raises(ValueError, match="entropy"):
        GRPO(entropy_coef=0.1).loss(logp, logp, torch.zeros(1), mask)


def test_dr_grpo_sums_tokens_over_the_constant_horizon():
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 9.0]])
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    s, c = aggregate(v, m, "seq-mean-token-sum-norm", horizon=10)
    assert (float(s), float(c)) == pytest.approx((0.6 + 0.4, 2.0))
    with pytest.raises(ValueError, match="horizon"):
        aggregate(v, m, "seq-mean-token-sum-norm")


def test_masked_tokens_change_no_loss_and_no_gradient():
    """Garbage in the padding (log-probs, advantages) must not reach the loss of any preset."""
    from rlinf_lightning.algorithms import PRESETS

    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    for name, preset in PRESETS.items():
        algo = preset()
        clean = torch.tensor([[-0.5, -0.7, 0.0, 0.0]], requires_grad=True)
        noisy = torch.tensor([[-0.5, -0.7, -9.0, 3.0]], requires_grad=True)
        old = torch.tensor([[-0.4, -0.8, 0.0, 0.0]])
        ref = torch.tensor([[-0.6, -0.6, 0.0, 0.0]])
        kw = dict(rollout_logprobs=old, horizon=4)
        a, _, _ = algo.loss(clean, old, torch.tensor([[1.0, 1.0, 0.0, 0.0]]), mask, ref, **kw)
        b, _, _ = algo.loss(noisy, old, torch.tensor([[1.0, 1.0, 5.0, -5.0]]), mask, ref, **kw)
        assert float(a.detach()) == pytest.approx(float(b.detach())), name
        (ga,), (gb,) = torch.autograd.grad(a, clean), torch.autograd.grad(b, noisy)
        torch.testing.assert_close(ga[:, :2], gb[:, :2], msg=name)
        assert gb[:, 2:].abs().sum() == 0, name


# -- presets, options and the contract ---------------------------------------------------------------


def test_every_preset_is_registered_with_its_papers_defaults():
    from rlinf_lightning.algorithms import PRESETS

    assert set(PRESETS) <= set(ALGORITHMS)
    dapo, dr, gspo = ALGORITHMS.resolve("dapo"), ALGORITHMS.resolve("dr_grpo"), ALGORITHMS.resolve("gspo")
    assert (dapo.clip_eps, dapo.clip_eps_high, dapo.loss_agg) == (0.2, 0.28, "token-mean")
    assert dapo.overlong_buffer > 0 and dapo.max_sampling_rounds > 0
    assert (dr.scale_std, dr.loss_agg) == (False, "seq-mean-token-sum-norm")
    assert (gspo.policy_loss, gspo.clip_eps, gspo.clip_eps_high) == ("gspo", 3e-4, 4e-4)
    assert ALGORITHMS.resolve("rloo").advantage_estimator == "rloo"
    assert ALGORITHMS.resolve("reinforce_plus_plus").norm_adv
    assert ALGORITHMS.resolve("cispo").policy_loss == "cispo"


def test_what_each_algorithm_reads_is_the_union_of_its_parts():
    from rlinf_lightning.algorithms import PPO

    assert GRPO().reads == {"rewards", "group_ids", "old_logprobs", "response_mask"}
    assert "ref_logprobs" in GRPO(kl_coef=0.1).reads
    assert "token_rewards" in ALGORITHMS.resolve("reinforce_plus_plus").reads
    assert "values" in PPO().reads and "values" not in GRPO().reads


def test_token_gae_hand_computed_ends_each_response_at_its_last_token():
    """Token-level GAE (gamma 0.9, lambda 0.8): the outcome on the last response token, nothing
    bootstrapped after it, and padding (rewards, values) that changes nothing."""
    from rlinf_lightning.algorithms import ADVANTAGE_ESTIMATORS, PPO
    from rlinf_lightning.algorithms.advantages import token_gae

    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 7.0, 7.0]])  # row 1: junk in padding
    values = torch.tensor([[0.5, 0.6, 0.7, 9.0], [0.2, 5.0, 5.0, 5.0]])
    adv, ret = token_gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # row 0: d2 = 1 - 0.7 = 0.3 (terminal); d1 = 0.9 * 0.7 - 0.6 = 0.03, A1 = 0.03 + 0.72 * 0.3
    # = 0.246; d0 = 0.9 * 0.6 - 0.5 = 0.04, A0 = 0.04 + 0.72 * 0.246 = 0.21712; row 1: A0 = -0.2
    expected = torch.tensor([[0.21712, 0.246, 0.3, 0.0], [-0.2, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, (expected + values) * mask)
    inputs = {"token_rewards": rewards, "values": values, "response_mask": mask}
    config = PPO(gamma=0.9, gae_lambda=0.8).on_tokens()
    torch.testing.assert_close(ADVANTAGE_ESTIMATORS.get("gae")(inputs, config), expected)


def test_critic_value_loss_hand_computed_clips_around_the_old_values_and_skips_masked_tokens():
    """``0.5 x max((V - R)^2, (V_old + clip(V - V_old) - R)^2)`` per response token, times vf_coef,
    summed over unmasked tokens and counted per token."""
    from rlinf_lightning.workflows.critic import ValueLoss

    class FixedValues:  # the loss's input: what a critic's forward returned
        def forward_values(self, mb):
            return torch.tensor([[1.0, 0.0, 3.0]])

    mb = {
        "values": torch.tensor([[0.5, 0.5, 0.0]]),
        "returns": torch.tensor([[0.8, 0.1, 100.0]]),
        "response_mask": torch.tensor([[1.0, 1.0, 0.0]]),
    }
    loss_sum, count, metrics = ValueLoss(value_clip=0.2, vf_coef=0.5)(FixedValues(), mb)
    # token 0: (1 - 0.8)^2 = 0.04 beats the clipped (0.7 - 0.8)^2 = 0.01 -> 0.02
    # token 1: (0 - 0.1)^2 = 0.01 loses to the clipped (0.3 - 0.1)^2 = 0.04 -> 0.02; token 2 masked
    assert float(loss_sum) == pytest.approx(0.5 * (0.02 + 0.02)) and float(count) == 2.0
    assert float(metrics["value_clip_frac"]) == pytest.approx(0.5)
    unclipped = ValueLoss(value_clip=None, vf_coef=1.0)(FixedValues(), mb)[0]
    assert float(unclipped) == pytest.approx(0.02 + 0.005)


def test_ppo_takes_a_ratio_per_entry_when_the_log_probs_factorise():
    """``[B, N]`` log-probs (π0's per-entry ones): each entry's ratio is clipped on its own and the
    sample's loss is their mean, so an entry far outside the trust region stops its own gradient
    only; with one entry it is the per-sample loss."""
    from rlinf_lightning.algorithms import PPO

    algo = PPO(clip_eps=0.2, value_clip=None, vf_coef=0.0, ent_coef=0.0)
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.0, 1.0, 0.05], [0.0, 0.0, 0.0]], requires_grad=True)  # entry 1 way out
    adv, zeros = torch.tensor([1.0, -1.0]), torch.zeros(2)
    loss, count, m = algo.loss(logp, old, adv, zeros, zeros, zeros, zeros)
    loss.backward()
    assert float(count) == 2.0 and float(m["clip_frac"]) == pytest.approx(1 / 6)
    assert logp.grad[0, 1] == 0 and logp.grad[0, 0] < 0 and logp.grad[0, 2] < 0  # the others still move
    assert torch.allclose(logp.grad[1], torch.full((3,), 1 / 3))
    one = algo.loss(logp.detach()[:, :1], old[:, :1], adv, zeros, zeros, zeros, zeros)[0]
    assert torch.isclose(one, algo.loss(logp.detach()[:, 0], old[:, 0], adv, zeros, zeros, zeros, zeros)[0])
