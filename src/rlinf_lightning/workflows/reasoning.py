"""The reasoning-RL macro flow (math GRPO) as stages:

    prompts -> rollout -> reward -> advantage -> inference -> actor  (stream)
    actor ==weights==> rollout                                        (sync, once per iteration)

With a critic (``task.critic``, for PPO), the critic stage takes the advantage stage's place: it
estimates each token's value, computes the advantages from them (GAE) and trains the value model
on its own optimizer (``workflows/critic.py``). A KL in the reward puts the inference stage first.

Each stage reads micro-batches of whole prompt groups, so every stage (the group-normalising
advantage included) can work on a micro-batch as soon as it arrives, on whichever replica of its
group took it. The actor trains and is checkpointed (role ``train``); the rollout evaluates (role
``evaluate``). Each stage's ``cost_hint`` is its share of an iteration on the tiny math workload
(its ``time/<stage>`` metric relative to the rollout's).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict

from rlinf_lightning.algorithms.advantages import groups_with_signal
from rlinf_lightning.algorithms.contract import unserved
from rlinf_lightning.algorithms.losses import kl_penalty
from rlinf_lightning.algorithms.policy_gradient import adapt_kl_coef
from rlinf_lightning.engines.offload import Offloader
from rlinf_lightning.engines.precision import AUTO_ROLLOUT_DTYPE, resolve_rollout_dtype
from rlinf_lightning.engines.rollout import ROLLOUT_ENGINES, Completion, SamplingParams
from rlinf_lightning.engines.train import TrainSpec
from rlinf_lightning.errors import ConfigError
from rlinf_lightning.evaluation import EVAL_BATCH_SIZE, greedy_accuracy
from rlinf_lightning.flow.memory import dtype_bytes, weights_part
from rlinf_lightning.flow.metrics import Metrics
from rlinf_lightning.flow.stage import MemoryPart, Stage, StageContext
from rlinf_lightning.flow.workflow import Workflow
from rlinf_lightning.policies.lm import LMPolicy
from rlinf_lightning.policies.lora import lora_of
from rlinf_lightning.policies.value import ValueModel
from rlinf_lightning.prompts import PromptFormat
from rlinf_lightning.rewards import RewardInput, close_judges, load_reward, score
from rlinf_lightning.seeds import row_seed
from rlinf_lightning.workflows.mini_batches import mini_batch_steps
from rlinf_lightning.workflows.padding import micro_batches
from rlinf_lightning.workflows.training import TrainStage, policy_dtype


def pack_samples(
    prompt_ids: list[list[int]], completions: list[list[Completion]], pad_id: int
) -> dict[str, torch.Tensor]:
    """Left-pad prompts, right-pad responses: ``input_ids = [prompt | response]`` per sample."""
    rows = [(p, c) for p, cs in zip(prompt_ids, completions) for c in cs]
    P = max(len(p) for p, _ in rows)
    R = max(1, max(len(c.token_ids) for _, c in rows))
    ids = torch.full((len(rows), P + R), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), P + R), dtype=torch.long)
    resp_mask = torch.zeros((len(rows), R), dtype=torch.float32)
    logps = torch.zeros((len(rows), R), dtype=torch.float32)
    for i, (p, c) in enumerate(rows):
        n = len(c.token_ids)
        ids[i, P - len(p) : P] = torch.tensor(p)
        attn[i, P - len(p) : P + n] = 1
        if n:
            ids[i, P : P + n] = torch.tensor(c.token_ids)
            resp_mask[i, :n] = 1
            logps[i, :n] = torch.tensor(c.logprobs)
    return {"input_ids": ids, "attention_mask": attn, "response_mask": resp_mask, "rollout_logprobs": logps}


@dataclass
class DynamicSampling:
    """DAPO's dynamic sampling, done per prompt slot so that every plan samples the same batch: a
    slot whose group's rewards (``scorer``'s) are all equal gets the next prompt of its own reserve
    stream (``problems``, drawn by a hash of the seed, the slot and the round) and a fresh group,
    up to ``rounds`` times; a slot still without signal then is kept (counted as unfilled)."""

    rounds: int
    scorer: RewardStage
    problems: list[tuple[str, str]]  # (prompt, answer) of the training set

    def reserve(self, seed: int, slot: int, round_: int) -> tuple[str, str]:
        return self.problems[row_seed(seed + RESERVE_SEED, slot, round_) % len(self.problems)]


#: the truncated-importance-sampling cap a bf16 rollout chosen by ``rollout_dtype: auto`` turns on
#: (Yao et al., 2025, use 2)
AUTO_TIS_CAP = 2.0
#: mixed into the seed of the reserve prompts and their samples (kept apart from the main stream)
RESERVE_SEED = 104729
#: the group id a slot's ``k``-th replacement is sampled under: ``slot + (k + 1) * RESERVE_GROUP_STRIDE``
RESERVE_GROUP_STRIDE = 1 << 32


class RolloutStage(Stage):
    """Generates ``group_size`` completions per prompt with the chosen rollout engine; prompts are
    laid out by the task's :class:`PromptFormat` (template, then the chat template if any). With
    ``dynamic_sampling``, groups without signal are replaced (:class:`DynamicSampling`).

    ``dtype`` is ``task.rollout_dtype``: ``auto`` follows the actor's ``precision`` on this
    stage's device (``engines.precision.resolve_rollout_dtype``). ``max_prompt_tokens`` (the task's
    longest prompt) and ``eval_prompts`` (how many it evaluates on) only size the memory estimate.
    """

    name = "rollout"
    cost_hint = 1.0
    in_keys = ("prompt", "answer", "group_id")
    out_keys = (
        "input_ids",
        "attention_mask",
        "response_mask",
        "rollout_logprobs",
        "group_id",
        "completion",
        "answer",
        "prompt",
        "policy_version",
    )

    def __init__(
        self,
        policy: LMPolicy,
        engine: str,
        sampling: SamplingParams,
        group_size: int,
        seed: int,
        prompt_format: PromptFormat | None = None,
        dtype: str | None = None,
        max_prompt_tokens: int | None = None,
        eval_prompts: int = 0,
        engine_options: dict[str, Any] | None = None,
        dynamic_sampling: DynamicSampling | None = None,
        precision: str = "32-true",
    ) -> None:
        self.policy, self.engine_name, self.sampling = policy, engine, sampling
        self.dynamic_sampling = dynamic_sampling
        self.engine_options = dict(engine_options or {})
        self.group_size, self.seed = group_size, seed
        self.prompt_format = prompt_format or PromptFormat()
        self.dtype_setting, self.precision = dtype, precision
        self.max_prompt_tokens, self.eval_prompts = max_prompt_tokens, eval_prompts

    def memory(self, device: str, replicas: int, micro_batch: int) -> list[MemoryPart] | None:
        """The weights in the rollout dtype, and the KV cache of the largest batch it generates:
        ``rows x (longest prompt + max_new_tokens) x layers x 2 (keys, values) x KV heads x head
        dim x dtype bytes``, rows being the larger of a micro-batch's samples and an evaluation
        batch. Not counted: the logits and sampling buffers of a step, and what an engine reserves
        beyond this (vLLM takes ``gpu_memory_utilization`` of the device)."""
        architecture = getattr(self.policy, "architecture", None)  # an LMPolicy's; unknown otherwise
        shape = architecture() if architecture is not None else None
        if shape is None:
            return None
        dtype = self.dtype(device)
        size = dtype_bytes(dtype)
        rows = max(micro_batch, min(self.eval_prompts, EVAL_BATCH_SIZE))
        tokens = (self.max_prompt_tokens or 0) + self.sampling.max_new_tokens
        kv = rows * tokens * shape.layers * 2 * shape.kv_heads * shape.head_dim * size
        fix = None if size <= 2 else "task.rollout_dtype=bfloat16 (half the rollout's memory)"
        return [
            weights_part(shape.parameters, dtype, fix=fix),
            MemoryPart(
                kv,
                f"KV cache ({rows} rows x {tokens} tokens x {shape.layers} layers x 2 x "
                f"{shape.kv_heads} KV heads x {shape.head_dim} x {size} bytes)",
            ),
        ]

    def dtype(self, device: str) -> str:
        """The engine's dtype on ``device``."""
        return resolve_rollout_dtype(self.dtype_setting, self.precision, device, self.policy.dtype)

    def setup(self, ctx: StageContext) -> None:
        self.tokenizer = self.policy.load_tokenizer()
        self.engine = ROLLOUT_ENGINES.get(self.engine_name)(
            self.policy.model_path, device=ctx.device, dtype=self.dtype(ctx.device), **self.engine_options
        )
        self.metrics = Metrics()
        if self.dynamic_sampling is not None:
            self.dynamic_sampling.scorer.setup(ctx)

    def onload(self) -> None:
        self.engine.onload()

    def offload(self) -> None:
        self.engine.offload()

    def teardown(self) -> None:
        if self.dynamic_sampling is not None:  # its scorer's judge process, if any
            self.dynamic_sampling.scorer.teardown()

    def _generate(self, prompts: list[str], groups: list[int], n: int, params: SamplingParams):
        prompt_ids = self.prompt_format.encode(self.tokenizer, prompts)
        completions = self.engine.generate(
            prompt_ids, groups, n, params, self.seed, eos_token_id=self.tokenizer.eos_token_id
        )
        return prompt_ids, completions

    def _texts(self, completions: list[list[Completion]]) -> list[str]:
        return [
            self.tokenizer.decode(c.token_ids, skip_special_tokens=True) for cs in completions for c in cs
        ]

    def _resample(
        self, prompts: list[str], answers: list[str], groups: list[int], prompt_ids: list, completions: list
    ) -> None:
        """Replace, in place, the slots whose group's rewards are all equal (dynamic sampling)."""
        ds, n = self.dynamic_sampling, self.group_size
        for round_ in range(ds.rounds + 1):
            reward, _ = ds.scorer.score(
                RewardInput(self._texts(completions), [a for a in answers for _ in range(n)])
            )
            flat = reward.view(len(prompts), n)
            todo = [i for i in range(len(prompts)) if bool((flat[i] == flat[i, 0]).all())]
            if not todo or round_ == ds.rounds:
                self.metrics.sum("unfilled_groups", len(todo))
                return
            self.metrics.sum("resampled_groups", len(todo))
            for i in todo:
                prompts[i], answers[i] = ds.reserve(self.seed, groups[i], round_)
            ids, comps = self._generate(
                [prompts[i] for i in todo],
                [groups[i] + (round_ + 1) * RESERVE_GROUP_STRIDE for i in todo],
                n,
                self.sampling,
            )
            for j, i in enumerate(todo):
                prompt_ids[i], completions[i] = ids[j], comps[j]

    def process(self, batch: TensorDict) -> TensorDict:
        groups = batch["group_id"].tolist()
        prompts, answers = list(batch["prompt"]), list(batch["answer"])
        prompt_ids, completions = self._generate(prompts, groups, self.group_size, self.sampling)
        if self.dynamic_sampling is not None:
            self._resample(prompts, answers, groups, prompt_ids, completions)
        tensors = pack_samples(prompt_ids, completions, self.tokenizer.pad_token_id)
        n = self.group_size
        texts = self._texts(completions)
        out = TensorDict(
            {
                **tensors,
                "group_id": torch.tensor(groups).repeat_interleave(n),
                "completion": texts,
                "answer": [a for a in answers for _ in range(n)],
                "prompt": [p for p in prompts for _ in range(n)],
                "policy_version": torch.full((len(texts),), self.policy_version),
            },
            batch_size=[len(texts)],
        )
        lengths = tensors["response_mask"].sum(-1)
        self.metrics.distribution("response_length", lengths)
        self.metrics.distribution("prompt_length", [len(p) for p in prompt_ids])
        self.metrics.sum("tokens_total", tensors["attention_mask"].sum())  # prompts + responses
        self.metrics.sum("response_tokens_total", lengths.sum())
        # clipped: stopped by max_new_tokens rather than by the end-of-sequence token
        eos = self.tokenizer.eos_token_id
        clipped = [
            len(c.token_ids) >= self.sampling.max_new_tokens and c.token_ids[-1] != eos
            for cs in completions
            for c in cs
        ]
        self.metrics.mean("clipped_ratio", sum(clipped) / len(clipped), len(clipped))
        return out

    def end_iteration(self) -> Metrics:
        return self.metrics.take()

    def apply_sync(self, source: str, state: TensorDict) -> None:
        # a LoRA actor sends only the merged layers that changed (see policies.lora)
        self.engine.update_weights(state.items(), partial=lora_of(self.policy) is not None)

    def evaluate(self, prompts: list[str], answers: list[str], reward: str) -> float:
        """Greedy held-out accuracy with the live rollout engine (current weights)."""
        return greedy_accuracy(
            self.engine,
            self.tokenizer,
            prompts,
            answers,
            reward,
            self.sampling.max_new_tokens,
            prompt_format=self.prompt_format,
        )


class RewardStage(Stage):
    """Scores each completion: ``reward`` (correctness) plus ``format_weight`` x ``format_reward``
    (names in ``rewards.REWARDS``); logs what the rewards count (``timeouts``, ``unparsed_gold``)."""

    name = "reward"
    cost_hint = 0.15
    in_keys = ("completion", "answer", "prompt", "response_mask")
    out_keys = ("reward", "correct")

    def __init__(self, reward: str, format_reward: str | None = None, format_weight: float = 0.0) -> None:
        self.reward, self.format_reward, self.format_weight = reward, format_reward, format_weight

    def setup(self, ctx: StageContext) -> None:
        self.correct_fn = load_reward(self.reward)
        self.format_fn = load_reward(self.format_reward) if self.format_reward else None
        for fn in (self.correct_fn, self.format_fn):
            if fn is not None:  # one-time set-up paid here, not in an iteration
                fn.setup()
        self.metrics = Metrics()

    def memory(self, device: str, replicas: int, micro_batch: int) -> list[MemoryPart]:
        return []  # no model (a judge process, if any, lives outside the device's budget)

    def teardown(self) -> None:
        close_judges()

    def score(self, inputs: RewardInput) -> tuple[torch.Tensor, torch.Tensor]:
        """``(reward, correct)`` per completion of ``inputs``."""
        correct = score(self.correct_fn, inputs)
        reward = correct.clone()
        if self.format_fn is not None:
            fmt = score(self.format_fn, inputs)
            reward += self.format_weight * fmt
            inputs.metrics.mean("format", float(fmt.mean()), len(fmt))
        return reward, correct

    def process(self, batch: TensorDict) -> TensorDict:
        inputs = RewardInput(
            list(batch["completion"]),
            list(batch["answer"]),
            list(batch["prompt"]),
            batch["response_mask"].sum(-1),
            self.metrics,
        )
        reward, correct = self.score(inputs)
        batch["reward"] = reward
        batch["correct"] = correct
        self.metrics.distribution("reward", reward)
        self.metrics.mean("accuracy", float(correct.mean()), len(correct))
        return batch

    def end_iteration(self) -> Metrics:
        return self.metrics.take()


class AdvantageStage(Stage):
    """Turns rewards into advantages with the algorithm's estimator, on micro-batches of whole
    groups: adds DAPO's overlong penalty to the rewards and, when the KL is in the reward, a
    per-token KL penalty (then it runs after the inference stage, which computes the reference
    log-probs). Emits one advantage per response token."""

    name = "advantage"
    cost_hint = 0.01
    out_keys = ("advantage",)

    def __init__(self, algorithm: Any, horizon: int) -> None:
        self.algorithm, self.horizon = algorithm, horizon
        self.kl_in_reward = algorithm.needs_reference and getattr(algorithm, "kl_in_reward", False)
        self.in_keys = ("reward", "group_id", "response_mask") + (
            ("rollout_logprobs", "ref_logprobs") if self.kl_in_reward else ()
        )
        if "values" in algorithm.reads:  # written by the critic stage that hosts this one
            self.in_keys += ("values",)
        self.adaptive_kl = self.kl_in_reward and getattr(algorithm, "kl_target", None) is not None

    def setup(self, ctx: StageContext) -> None:
        self.ctx, self.metrics = ctx, Metrics()
        self.kl_coef = getattr(self.algorithm, "kl_coef", 0.0)
        self.kl_seen = torch.zeros(2, dtype=torch.float64)  # sum of per-token KL, tokens

    def memory(self, device: str, replicas: int, micro_batch: int) -> list[MemoryPart]:
        return []  # a few numbers per sample

    def process(self, batch: TensorDict) -> TensorDict:
        alg, mask = self.algorithm, batch["response_mask"]
        rewards = batch["reward"]
        if getattr(alg, "overlong_buffer", 0.0) > 0:
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
            "response_mask": mask,
            "token_rewards": token_rewards,
        }
        if "values" in batch.keys():
            inputs["values"] = batch["values"]
        adv = alg.compute_advantages(inputs)
        adv = adv[:, None].expand(mask.shape) if adv.dim() == 1 else adv
        batch["advantage"] = (adv * mask).float()
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
    if getattr(algorithm, "kl_target", None) is None:
        return coef
    total = seen.clone()
    ctx.all_reduce([total])
    kl_sum, tokens = total.tolist()
    if tokens == 0:
        return coef
    return adapt_kl_coef(coef, kl_sum / tokens, algorithm.kl_target, algorithm.kl_horizon, int(tokens))


class InferenceStage(Stage):
    """Reference-policy log-probs for the KL penalty; passes batches through when KL is off."""

    name = "inference"
    cost_hint = 0.3
    in_keys = ("input_ids", "attention_mask", "response_mask")
    out_keys = ("ref_logprobs",)

    def __init__(self, policy: LMPolicy, algorithm: Any, temperature: float) -> None:
        self.policy, self.algorithm, self.temperature = policy, algorithm, temperature

    def memory(self, device: str, replicas: int, micro_batch: int) -> list[MemoryPart] | None:
        """The reference weights in the policy's dtype (nothing when the algorithm has no KL term).
        Not counted: a forward's activations and logits."""
        if not self.algorithm.needs_reference:
            return []
        n = self.policy.parameter_count()
        return None if n is None else [weights_part(n, self.policy.dtype, "reference weights")]

    def setup(self, ctx: StageContext) -> None:
        self.ref, self.device = None, ctx.device
        if self.algorithm.needs_reference:
            self.ref = copy.deepcopy(self.policy)
            self.ref.configure_model()
            self.ref.to(ctx.device).eval().requires_grad_(False)
            self._offloader = Offloader(ctx.device)

    def onload(self) -> None:
        if self.ref is not None:
            self._offloader.onload(self.ref)

    def offload(self) -> None:
        if self.ref is not None:
            self._offloader.offload(self.ref)

    @torch.no_grad()
    def process(self, batch: TensorDict) -> TensorDict:
        if self.ref is not None:
            ref = self.ref.forward_logprobs(batch.to(self.device), self.temperature)
            batch["ref_logprobs"] = ref.cpu()  # channels carry host tensors
        return batch


class PolicyLoss:
    """``(policy, micro_batch) -> (loss_sum, count, metrics)``; picklable, so every rank of a
    distributed train engine can run it on its shard.

    The ratio's denominator is the behaviour policy's log-probs: ``old_logprobs`` when the actor
    took them before its first step (several updates per batch, or ``tis_cap``), else the
    rollout's. The proximal log-probs of an off-policy correction are the actor's before its
    first step: ``old_logprobs``, or, when it steps once, its log-probs now (it has not stepped
    yet). ``kl_coef`` is the KL coefficient of this iteration (adaptive ones change)."""

    def __init__(self, algorithm: Any, temperature: float, horizon: int | None = None) -> None:
        self.algorithm, self.temperature, self.horizon = algorithm, temperature, horizon
        self.kl_coef = getattr(algorithm, "kl_coef", 0.0)

    def __call__(self, policy: LMPolicy, mb: TensorDict):
        entropy = None
        if getattr(self.algorithm, "entropy_coef", 0.0) > 0:  # an entropy bonus: with its gradient
            logp, entropy = policy.forward_logprobs(mb, self.temperature, with_entropy=True)
        else:
            logp = policy.forward_logprobs(mb, self.temperature)
        if "old_logprobs" in mb.keys():
            old = mb["old_logprobs"]
        elif getattr(self.algorithm, "tis_cap", None) is not None:
            old = logp.detach()  # one step per batch: the actor's log-probs before it
        else:
            old = mb["rollout_logprobs"]
        return self.algorithm.loss(
            logp,
            old,
            mb["advantage"],
            mb["response_mask"],
            mb.get("ref_logprobs", None),
            rollout_logprobs=mb["rollout_logprobs"],
            proximal_logprobs=mb["old_logprobs"] if "old_logprobs" in mb.keys() else logp.detach(),
            entropy=entropy,
            kl_coef=self.kl_coef,
            horizon=self.horizon,
        )


def behaviour_logprobs(policy: LMPolicy, mb: TensorDict, temperature: float) -> torch.Tensor:
    """The actor's log-probs of a micro-batch's responses, no gradient (before its first step)."""
    return policy.forward_logprobs(mb, temperature)


class ActorStage(TrainStage):
    """Trains the policy on each rollout batch.

    One update per batch (``ppo_epochs = num_mini_batches = 1``, no whitening): the gradient is
    accumulated over micro-batches as they arrive and the optimizer steps once at the end of the
    iteration. Otherwise the batch is kept; at its end the advantages are whitened over all of it
    (``norm_adv``), the behaviour log-probs are taken before the first step, and ``ppo_epochs``
    passes of ``num_mini_batches`` optimizer steps run. A mini-batch is a set of whole prompt
    groups drawn by a permutation of the iteration's group positions seeded by iteration and
    epoch, and each step divides by its own mini-batch's count over every replica, so replicas of
    a data-parallel group take exactly the steps one replica would.

    Every replica of the group hosting it is a rank of its train engine (``train.engine``).

    With ``rollout_dtype`` ``auto`` and an algorithm whose ``tis_cap`` is unset (and that has no
    off-policy correction, which weights the same tokens), a rollout that resolves to a lower
    precision than the policy's weights (bf16 beside a float32 actor) turns on truncated
    importance sampling at :data:`AUTO_TIS_CAP`, correcting the log-prob mismatch the faster
    rollout brings; an explicit ``rollout_dtype`` leaves the algorithm as configured.
    """

    name = "actor"
    cost_hint = 1.0
    in_keys = (
        "input_ids",
        "attention_mask",
        "response_mask",
        "rollout_logprobs",
        "advantage",
        "group_id",
        "policy_version",
    )

    def __init__(
        self,
        policy: LMPolicy,
        algorithm: Any,
        train: TrainSpec,
        temperature: float,
        train_micro_batch_size: int | None,
        train_max_tokens: int | None = None,
        horizon: int = 1,
        prompts_per_iteration: int = 1,
        seed: int = 0,
        max_staleness: int = 0,
        rollout_dtype: str | None = None,
    ) -> None:
        super().__init__(policy, train, max_staleness)
        self.rollout_dtype = rollout_dtype
        self.algorithm, self.temperature = algorithm, temperature
        self.train_micro_batch_size, self.train_max_tokens = train_micro_batch_size, train_max_tokens
        self.horizon, self.prompts_per_iteration, self.seed = horizon, prompts_per_iteration, seed
        self.updates = getattr(algorithm, "updates_per_batch", 1)
        self.keeps_batch = self.updates > 1 or getattr(algorithm, "norm_adv", False)
        self.end_per_sample = self.keeps_batch  # then every pass runs at the end of the iteration
        self.adaptive_kl = (
            algorithm.needs_reference
            and not getattr(algorithm, "kl_in_reward", False)
            and getattr(algorithm, "kl_target", None) is not None
        )
        if algorithm.needs_reference:
            self.in_keys = (*self.in_keys, "ref_logprobs")

    def setup(self, ctx: StageContext) -> None:
        super().setup(ctx)
        alg = self.algorithm
        corrected = getattr(alg, "off_policy_correction", "none") != "none"  # weights the same tokens
        if self.rollout_dtype == AUTO_ROLLOUT_DTYPE and getattr(alg, "tis_cap", 0) is None and not corrected:
            policy = policy_dtype(self.policy)
            if resolve_rollout_dtype(self.rollout_dtype, self.precision, ctx.device, policy) != policy:
                self.algorithm = dataclasses.replace(self.algorithm, tis_cap=AUTO_TIS_CAP)
        self.loss = PolicyLoss(self.algorithm, self.temperature, self.horizon)
        self.metrics = Metrics()
        self.kl_seen = torch.zeros(2, dtype=torch.float64)  # KL x samples, samples (adaptive KL)

    def engine_info(self) -> dict[str, Any]:
        """The train engine's, and the truncated-importance-sampling cap in force (``None``: off)."""
        return {**super().engine_info(), "tis_cap": getattr(self.algorithm, "tis_cap", None)}

    def begin_iteration(self, iteration: int) -> None:
        super().begin_iteration(iteration)
        self.iteration, self.buffer = iteration, []
        self.warming_up = iteration <= getattr(self.algorithm, "critic_warmup", 0)

    def process(self, batch: TensorDict) -> None:
        self.check_staleness(self.iteration, batch["policy_version"], self.metrics)
        if self.warming_up:  # only the critic trains (PPO's critic_warmup)
            return None
        if self.adaptive_kl:  # KL(rollout policy || reference) per token, what the controller steers
            alg, mask = self.algorithm, batch["response_mask"]
            kl = kl_penalty(batch["rollout_logprobs"], batch["ref_logprobs"], alg.kl_estimator) * mask
            self.kl_seen += torch.tensor([float(kl.sum()), float(mask.sum())], dtype=torch.float64)
        if self.keeps_batch:
            self.buffer.append(batch)
            return None
        self._train_on(batch, self.metrics)
        return None

    def _train_on(self, batch: TensorDict, metrics: Metrics) -> None:
        for chunk in micro_batches(batch, self.train_micro_batch_size, self.train_max_tokens):
            for k, v in self.engine.accumulate(chunk, self.loss).items():
                metrics.mean(k, v, len(chunk))

    def end_iteration(self) -> Metrics:
        metrics = self.metrics.take()
        if self.warming_up:
            metrics.mean("warmup", 1.0)
            return metrics
        if self.keeps_batch:
            self._update_on_kept_batch(metrics)
        else:
            metrics.merge(self.engine.step())
        self._adapt_kl(metrics)
        return metrics

    def extra_state(self) -> dict[str, Any]:
        """The adaptive KL coefficient (the engine's state is the train role's checkpoint)."""
        return {"kl_coef": self.loss.kl_coef} if self.adaptive_kl else {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.loss.kl_coef = float(state["kl_coef"])

    def _adapt_kl(self, metrics: Metrics) -> None:
        if not self.adaptive_kl:
            return
        self.loss.kl_coef = adapted_kl_coef(self.ctx, self.algorithm, self.loss.kl_coef, self.kl_seen)
        metrics.mean("kl_coef", self.loss.kl_coef)
        self.kl_seen.zero_()

    def _whiten(self) -> None:
        """Advantages to zero mean and unit std over every response token of the rollout batch
        (the moments summed over the replicas)."""
        moments = torch.zeros(3, dtype=torch.float64)
        for b in self.buffer:
            adv, mask = b["advantage"].double(), b["response_mask"].double()
            moments += torch.stack([(adv * mask).sum(), (adv**2 * mask).sum(), mask.sum()])
        self.ctx.all_reduce([moments])
        total, squares, count = moments.tolist()
        mean = total / max(count, 1.0)
        std = max((squares / max(count, 1.0) - mean**2) * count / max(count - 1.0, 1.0), 0.0) ** 0.5
        for b in self.buffer:
            b["advantage"] = ((b["advantage"] - mean) / (std + 1e-8)) * b["response_mask"]

    def _update_on_kept_batch(self, metrics: Metrics) -> None:
        if getattr(self.algorithm, "norm_adv", False):
            self._whiten()
        if self.updates > 1 or getattr(self.algorithm, "tis_cap", None) is not None:
            for b in self.buffer:  # the behaviour policy: the actor before its first step
                b["row"] = torch.arange(len(b))
                chunks = micro_batches(b, self.train_micro_batch_size, self.train_max_tokens)
                b["old_logprobs"] = torch.zeros_like(b["rollout_logprobs"])
                for chunk, lp in zip(chunks, self.engine.forward_all(chunks, self._behaviour)):
                    b["old_logprobs"][chunk["row"], : lp.shape[-1]] = lp.to(b["old_logprobs"].device)
        steps = mini_batch_steps(
            self.buffer, self.algorithm, self.seed, self.iteration, self.prompts_per_iteration
        )
        for parts in steps:
            for part in parts:
                self._train_on(part, metrics)
            metrics.merge(self.engine.step())

    def _behaviour(self, policy: LMPolicy, mb: TensorDict) -> torch.Tensor:
        return behaviour_logprobs(policy, mb, self.temperature)


#: what the reasoning workflow gives an algorithm (``algorithms.contract``); an episode is one
#: response, ending at its last token (``response_mask``). With a critic (``task.critic``) it also
#: gives values (``CRITIC_PROVIDES``).
PROVIDES = frozenset(
    {"rewards", "group_ids", "response_mask", "dones", "token_rewards", "old_logprobs", "ref_logprobs",
     "proximal_logprobs"}
)  # fmt: skip
CRITIC_PROVIDES = PROVIDES | {"values"}
#: how to give the workflow a critic, for the refusal of an algorithm that reads values
CRITIC_FIX = "; configure a critic: task.critic: {} in YAML, or --task.critic.lr=1e-4 (policies.ValueModel)"


def reasoning_workflow(
    *,
    policy: LMPolicy,
    algorithm: Any,
    rollout: str,
    rollout_dtype: str | None = None,
    rollout_engine_options: dict[str, Any] | None = None,
    train: TrainSpec,
    sampling: SamplingParams,
    group_size: int,
    prompts_per_iteration: int,
    train_micro_batch_size: int | None,
    train_max_tokens_per_micro_batch: int | None = None,
    reward: str,
    format_reward: str | None,
    format_weight: float,
    seed: int,
    prompt_format: PromptFormat | None = None,
    max_prompt_tokens: int | None = None,
    eval_prompts: int = 0,
    train_problems: list[tuple[str, str]] | None = None,
    critic: ValueModel | None = None,
    max_staleness: int = 0,
) -> Workflow:
    """The stages for ``algorithm`` (``train_problems``: the reserve prompts of DAPO's dynamic
    sampling; ``critic``: the value model of an algorithm that reads values, whose stage then
    takes the advantage stage's place); raises :class:`ConfigError` when the algorithm reads an
    input this workflow does not provide (values without a critic), a critic is given to an
    algorithm that reads no values, or mini-batches cannot be cut from the batch."""
    given, name = algorithm, type(algorithm).__name__
    if hasattr(algorithm, "on_tokens"):  # e.g. PPO: its options as one step per token
        algorithm = algorithm.on_tokens()
    provides = PROVIDES if critic is None else CRITIC_PROVIDES
    problems = unserved(algorithm, name, provides, "reasoning", CRITIC_FIX if critic is None else "")
    if critic is not None and "values" not in algorithm.reads:
        problems.append(
            (
                "task.critic",
                f"{name} reads no values, so a critic would train for nothing; remove task.critic "
                "or use trainer.algorithm=ppo",
            )
        )
    if getattr(given, "target_kl", None) is not None:
        problems.append(("trainer.algorithm.target_kl", "stops env-step PPO early (embodied only); set null"))
    mini = getattr(algorithm, "num_mini_batches", 1)
    if prompts_per_iteration % mini:
        problems.append(
            (
                "trainer.algorithm.num_mini_batches",
                f"{mini} does not divide the {prompts_per_iteration} prompt groups of an iteration "
                "(task.rollout_batch_size / task.group_size); a mini-batch is whole groups",
            )
        )
    if problems:
        raise ConfigError(problems)
    temperature = sampling.temperature if sampling.temperature > 0 else 1.0
    horizon = sampling.max_new_tokens
    advantage = AdvantageStage(algorithm, horizon)
    if critic is not None:
        from rlinf_lightning.workflows.critic import CriticStage

        advantage = CriticStage(
            critic.for_policy(policy.model_path),
            advantage,
            train,
            critic.train_micro_batch_size or train_micro_batch_size,
            train_max_tokens_per_micro_batch,
            prompts_per_iteration,
            seed,
        )
    inference = InferenceStage(policy, algorithm, temperature)
    rounds = getattr(algorithm, "max_sampling_rounds", 0)
    dynamic = None
    if rounds and train_problems:
        dynamic = DynamicSampling(rounds, RewardStage(reward, format_reward, format_weight), train_problems)
    return (
        Workflow("reasoning")
        .chain(
            RolloutStage(
                policy,
                rollout,
                sampling,
                group_size,
                seed,
                prompt_format,
                rollout_dtype,
                max_prompt_tokens,
                eval_prompts,
                rollout_engine_options,
                dynamic,
                train.precision,
            ),
            RewardStage(reward, format_reward, format_weight),
            # a KL in the reward needs the reference log-probs before the advantages
            *((inference, advantage) if advantage.kl_in_reward else (advantage, inference)),
            ActorStage(
                policy,
                algorithm,
                train,
                temperature,
                train_micro_batch_size,
                train_max_tokens_per_micro_batch,
                horizon,
                prompts_per_iteration,
                seed,
                max_staleness,
                rollout_dtype,
            ),
        )
        .sync("actor", "rollout", "weights", staleness=max_staleness)
        .role("train", "actor")
        .role("evaluate", "rollout")
    )
