"""The advantage stage: group-normalised (or other registered) advantages, with the KL penalty
in the reward where the algorithm puts it there."""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from rlinf_lightning.algorithms.advantages import groups_with_signal
from rlinf_lightning.algorithms.losses import kl_penalty
from rlinf_lightning.algorithms.policy_gradient import adapt_kl_coef
from rlinf_lightning.flow.batch import LOSS_MASK
from rlinf_lightning.flow.metrics import Metrics
from rlinf_lightning.flow.stage import MemoryPart, Stage, StageContext
from rlinf_lightning.workflows.finite import check_finite


class AdvantageStage(Stage):
    """Turns rewards into advantages with the algorithm's estimator, on micro-batches of whole
    groups: adds DAPO's overlong penalty to the rewards and, when the KL is in the reward, a
    per-token KL penalty (then it runs after the inference stage, which computes the reference
    log-probs). Emits one advantage per response token."""

    name = "advantage"
    cost_hint = 0.01
    out_keys = ("advantage",)
    iteration = 0  # the one running (begin_iteration), for the non-finite guard's message

    def __init__(self, algorithm: Any, horizon: int) -> None:
        self.algorithm, self.horizon = algorithm, horizon
        self.kl_in_reward = algorithm.needs_reference and algorithm.kl_in_reward
        self.in_keys = ("reward", "group_id", LOSS_MASK) + (
            ("rollout_logprobs", "ref_logprobs") if self.kl_in_reward else ()
        )
        if "values" in algorithm.reads:  # written by the critic stage that hosts this one
            self.in_keys += ("values",)
        self.adaptive_kl = self.kl_in_reward and algorithm.kl_target is not None

    def setup(self, ctx: StageContext) -> None:
        self.ctx, self.metrics = ctx, Metrics()
        self.kl_coef = self.algorithm.kl_coef
        self.kl_seen = torch.zeros(2, dtype=torch.float64)  # sum of per-token KL, tokens

    def memory(self, device: str, replicas: int, micro_batch: int) -> list[MemoryPart]:
        return []  # a few numbers per sample

    def begin_iteration(self, iteration: int) -> None:
        self.iteration = iteration

    def process(self, batch: TensorDict) -> TensorDict:
        alg, mask = self.algorithm, batch[LOSS_MASK]
        rewards = batch["reward"]
        check_finite(self.name, self.iteration, "rewards", rewards)
        if alg.overlong_buffer > 0:
            penalty = alg.overlong_penalty_of(mask.sum(-1), self.horizon)
            rewards = rewards + penalty
            self.metrics.mean("overlong_penalty", float(penalty.mean()), len(penalty))
        kl = None
        if self.kl_in_reward:
            kl = kl_penalty(batch["rollout_logprobs"], batch["ref_logprobs"], alg.kl_estimator) * mask
            self.kl_seen += torch.tensor([float(kl.sum()), float(mask.sum())], dtype=torch.float64)
        token_rewards = alg.token_rewards(rewards, mask, kl, self.kl_coef)
        inputs = {
            "rewards": token_rewards.sum(-1) if kl is not None else rewards,
            "group_ids": batch["group_id"],
            LOSS_MASK: mask,
            "token_rewards": token_rewards,
        }
        if "values" in batch.keys():
            inputs["values"] = batch["values"]
        adv = alg.compute_advantages(inputs)
        adv = adv[:, None].expand(mask.shape) if adv.dim() == 1 else adv
        batch["advantage"] = (adv * mask).float()
        check_finite(self.name, self.iteration, "advantages", batch["advantage"])
        groups_with_signal(batch["advantage"], batch["group_id"], self.metrics)
        return batch

    def end_iteration(self) -> Metrics:
        if self.kl_in_reward:
            self.kl_coef = adapted_kl_coef(self.ctx, self.algorithm, self.kl_coef, self.kl_seen)
            self.metrics.mean("kl_coef", self.kl_coef)
            self.kl_seen.zero_()
        return self.metrics.take()

    def extra_state(self) -> dict[str, Any]:
        """The adaptive KL coefficient of a KL in the reward."""
        return {"kl_coef": self.kl_coef} if self.adaptive_kl else {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.kl_coef = float(state["kl_coef"])


def adapted_kl_coef(ctx: StageContext, algorithm: Any, coef: float, seen: torch.Tensor) -> float:
    """The KL coefficient for the next iteration: ``coef`` unless ``kl_target`` is set, then
    adapted to the mean per-token KL ``seen`` (``[sum, tokens]``, summed over the replicas so every
    replica, and every plan, gets the same coefficient)."""
    if algorithm.kl_target is None:
        return coef
    total = seen.clone()
    ctx.all_reduce([total])
    kl_sum, tokens = total.tolist()
    if tokens == 0:
        return coef
    return adapt_kl_coef(coef, kl_sum / tokens, algorithm.kl_target, algorithm.kl_horizon, int(tokens))
