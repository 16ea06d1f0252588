"""The reasoning-RL macro flow (math GRPO) as stages:

    prompts -> rollout -> reward -> advantage -> inference -> actor  (stream)
    actor ==weights==> rollout                                        (sync, once per iteration)

Each stage reads micro-batches of whole prompt groups, so every stage (the group-normalising
advantage included) can work on a micro-batch as soon as it arrives, on whichever replica of its
group took it. The actor trains and is checkpointed (role ``train``); the rollout evaluates (role
``evaluate``). Each stage's ``cost_hint`` is its share of an iteration on the tiny math workload
(its ``time/<stage>`` metric relative to the rollout's).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from tensordict import TensorDict

from rlinf_lightning.algorithms.advantages import groups_with_signal
from rlinf_lightning.engines.offload import Offloader
from rlinf_lightning.engines.rollout import ROLLOUT_ENGINES, Completion, SamplingParams
from rlinf_lightning.engines.train import TrainSpec
from rlinf_lightning.evaluation import EVAL_BATCH_SIZE, greedy_accuracy
from rlinf_lightning.flow.memory import dtype_bytes, weights_part
from rlinf_lightning.flow.metrics import Metrics
from rlinf_lightning.flow.stage import MemoryPart, Stage, StageContext
from rlinf_lightning.flow.workflow import Workflow
from rlinf_lightning.policies.lm import LMPolicy
from rlinf_lightning.policies.lora import lora_of
from rlinf_lightning.prompts import PromptFormat
from rlinf_lightning.rewards import RewardInput, close_judges, load_reward, score
from rlinf_lightning.workflows.padding import micro_batches
from rlinf_lightning.workflows.training import TrainStage


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


class RolloutStage(Stage):
    """Generates ``group_size`` completions per prompt with the chosen rollout engine; prompts are
    laid out by the task's :class:`PromptFormat` (template, then the chat template if any).

    ``max_prompt_tokens`` (the task's longest prompt) and ``eval_prompts`` (how many it evaluates
    on) only size the memory estimate.
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
    ) -> None:
        self.policy, self.engine_name, self.sampling = policy, engine, sampling
        self.engine_options = dict(engine_options or {})
        self.group_size, self.seed = group_size, seed
        self.prompt_format = prompt_format or PromptFormat()
        self.dtype = dtype or policy.dtype
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
        size = dtype_bytes(self.dtype)
        rows = max(micro_batch, min(self.eval_prompts, EVAL_BATCH_SIZE))
        tokens = (self.max_prompt_tokens or 0) + self.sampling.max_new_tokens
        kv = rows * tokens * shape.layers * 2 * shape.kv_heads * shape.head_dim * size
        fix = None if size <= 2 else "task.rollout_dtype=bfloat16 (half the rollout's memory)"
        return [
            weights_part(shape.parameters, self.dtype, fix=fix),
            MemoryPart(
                kv,
                f"KV cache ({rows} rows x {tokens} tokens x {shape.layers} layers x 2 x "
                f"{shape.kv_heads} KV heads x {shape.head_dim} x {size} bytes)",
            ),
        ]

    def setup(self, ctx: StageContext) -> None:
        self.tokenizer = self.policy.load_tokenizer()
        self.engine = ROLLOUT_ENGINES.get(self.engine_name)(
            self.policy.model_path, device=ctx.device, dtype=self.dtype, **self.engine_options
        )
        self.metrics = Metrics()

    def onload(self) -> None:
        self.engine.onload()

    def offload(self) -> None:
        self.engine.offload()

    def _generate(self, prompts: list[str], groups: list[int], n: int, params: SamplingParams):
        prompt_ids = self.prompt_format.encode(self.tokenizer, prompts)
        completions = self.engine.generate(
            prompt_ids, groups, n, params, self.seed, eos_token_id=self.tokenizer.eos_token_id
        )
        return prompt_ids, completions

    def process(self, batch: TensorDict) -> TensorDict:
        groups = batch["group_id"].tolist()
        prompt_ids, completions = self._generate(
            list(batch["prompt"]), groups, self.group_size, self.sampling
        )
        tensors = pack_samples(prompt_ids, completions, self.tokenizer.pad_token_id)
        n = self.group_size
        texts = [
            self.tokenizer.decode(c.token_ids, skip_special_tokens=True) for cs in completions for c in cs
        ]
        out = TensorDict(
            {
                **tensors,
                "group_id": torch.tensor(groups).repeat_interleave(n),
                "completion": texts,
                "answer": [a for a in batch["answer"] for _ in range(n)],
                "prompt": [p for p in batch["prompt"] for _ in range(n)],
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

    def process(self, batch: TensorDict) -> TensorDict:
        inputs = RewardInput(
            list(batch["completion"]),
            list(batch["answer"]),
            list(batch["prompt"]),
            batch["response_mask"].sum(-1),
            self.metrics,
        )
        correct = score(self.correct_fn, inputs)
        reward = correct.clone()
        if self.format_fn is not None:
            fmt = score(self.format_fn, inputs)
            reward += self.format_weight * fmt
            self.metrics.mean("format", float(fmt.mean()), len(fmt))
        batch["reward"] = reward
        batch["correct"] = correct
        self.metrics.distribution("reward", reward)
        self.metrics.mean("accuracy", float(correct.mean()), len(correct))
        return batch

    def end_iteration(self) -> Metrics:
        return self.metrics.take()


class AdvantageStage(Stage):
    """Turns rewards into advantages with the algorithm's estimator (group-normalised for GRPO)."""

    name = "advantage"
    cost_hint = 0.01
    in_keys = ("reward", "group_id")
    out_keys = ("advantage",)

    def __init__(self, algorithm: Any) -> None:
        self.algorithm = algorithm

    def setup(self, ctx: StageContext) -> None:
        self.metrics = Metrics()

    def memory(self, device: str, replicas: int, micro_batch: int) -> list[MemoryPart]:
        return []  # a few numbers per sample

    def process(self, batch: TensorDict) -> TensorDict:
        batch["advantage"] = self.algorithm.compute_advantages(batch["reward"], batch["group_id"])
        groups_with_signal(batch["advantage"], batch["group_id"], self.metrics)
        return batch

    def end_iteration(self) -> Metrics:
        return self.metrics.take()


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
    distributed train engine can run it on its shard."""

    def __init__(self, algorithm: Any, temperature: float) -> None:
        self.algorithm, self.temperature = algorithm, temperature

    def __call__(self, policy: LMPolicy, mb: TensorDict):
        logp = policy.forward_logprobs(mb, self.temperature)
        return self.algorithm.loss(
            logp, mb["rollout_logprobs"], mb["advantage"], mb["response_mask"], mb.get("ref_logprobs", None)
        )


class ActorStage(TrainStage):
    """Accumulates the policy-loss gradient over micro-batches; one optimizer step per iteration.

    Every replica of the group hosting it is a rank of its train engine (``train.engine``).
    """

    name = "actor"
    cost_hint = 1.0
    in_keys = ("input_ids", "attention_mask", "response_mask", "rollout_logprobs", "advantage")

    def __init__(
        self,
        policy: LMPolicy,
        algorithm: Any,
        train: TrainSpec,
        temperature: float,
        train_micro_batch_size: int | None,
        train_max_tokens: int | None = None,
    ) -> None:
        super().__init__(policy, train)
        self.algorithm, self.temperature = algorithm, temperature
        self.train_micro_batch_size, self.train_max_tokens = train_micro_batch_size, train_max_tokens

    def setup(self, ctx: StageContext) -> None:
        super().setup(ctx)
        self.loss = PolicyLoss(self.algorithm, self.temperature)
        self.metrics = Metrics()

    def process(self, batch: TensorDict) -> None:
        for chunk in micro_batches(batch, self.train_micro_batch_size, self.train_max_tokens):
            for k, v in self.engine.accumulate(chunk, self.loss).items():
                self.metrics.mean(k, v, len(chunk))
        return None

    def end_iteration(self) -> Metrics:
        return self.metrics.take().merge(self.engine.step())


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
    train_micro_batch_size: int | None,
    train_max_tokens_per_micro_batch: int | None = None,
    reward: str,
    format_reward: str | None,
    format_weight: float,
    seed: int,
    prompt_format: PromptFormat | None = None,
    max_prompt_tokens: int | None = None,
    eval_prompts: int = 0,
) -> Workflow:
    temperature = sampling.temperature if sampling.temperature > 0 else 1.0
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
            ),
            RewardStage(reward, format_reward, format_weight),
            AdvantageStage(algorithm),
            InferenceStage(policy, algorithm, temperature),
            ActorStage(
                policy,
                algorithm,
                train,
                temperature,
                train_micro_batch_size,
                train_max_tokens_per_micro_batch,
            ),
        )
        .sync("actor", "rollout", "weights")
        .role("train", "actor")
        .role("evaluate", "rollout")
    )
