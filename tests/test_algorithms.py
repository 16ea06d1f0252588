import math

import pytest
import torch

from rlinf_lightning.algorithms import ALGORITHMS, GRPO
from rlinf_lightning.algorithms.advantages import group_normalized_advantages
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


def test_equal_rewards_give_zero_advantage_and_singletons_are_rejected():
    adv = group_normalized_advantages(torch.ones(4), torch.tensor([0, 0, 1, 1]))
    assert torch.equal(adv, torch.zeros(4))
    with pytest.raises(ValueError, match="at least 2"):
        group_normalized_advantages(torch.ones(3), torch.tensor([0, 0, 1]))


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
    loss, count, metrics = GRPO(tis_cap=2.0).loss(logp, rollout, adv, mask)
    weight = torch.exp(logp.detach() - rollout).clamp(max=2.0)
    expected = (-(torch.exp(logp - logp.detach()) * adv[:, None]) * weight).sum()
    assert torch.allclose(loss, expected) and count == 10
    assert metrics["tis_weight"] == pytest.approx(float(weight.mean()))
    assert weight.max() == 2.0 and weight.min() < 1.0  # capped above, and below 1 where pi_rollout > pi
    same = GRPO(tis_cap=2.0).loss(logp, logp.detach(), adv, mask)[0]
    assert torch.allclose(same, GRPO().loss(logp, logp.detach(), adv, mask)[0])


def test_an_estimator_and_a_loss_registered_by_name_are_what_grpo_computes():
    from rlinf_lightning.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSSES

    def leave_one_out(rewards, group_ids, config):
        _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
        sums = torch.zeros(len(counts), dtype=rewards.dtype).index_add_(0, inverse, rewards)
        n = counts[inverse].to(rewards.dtype)
        return rewards - (sums[inverse] - rewards) / (n - 1)

    def plain_pg(logprobs, old_logprobs, advantages, mask, config):
        return -advantages * logprobs, {"plain": torch.tensor(1.0)}

    ADVANTAGE_ESTIMATORS.register("test_rloo", leave_one_out)
    POLICY_LOSSES.register("test_plain_pg", plain_pg)
    alg = GRPO(advantage_estimator="test_rloo", policy_loss="test_plain_pg")
    adv = alg.compute_advantages(torch.tensor([1.0, 0.0, 0.0, 2.0]), torch.tensor([7, 7, 7, 9]))
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
