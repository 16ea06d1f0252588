"""The rollout stage: samples ``group_size`` completions per prompt with the chosen engine and packs
them into one padded batch; DAPO's dynamic sampling replaces groups without signal."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDict

from rlinf_lightning.engines.precision import resolve_rollout_dtype
from rlinf_lightning.engines.rollout import ROLLOUT_ENGINES, Completion, SamplingParams
from rlinf_lightning.engines.sampling import end_token_ids
from rlinf_lightning.evaluation import EVAL_BATCH_SIZE, greedy_accuracy
from rlinf_lightning.flow.batch import LOSS_MASK
from rlinf_lightning.flow.memory import dtype_bytes, weights_part
from rlinf_lightning.flow.metrics import Metrics
from rlinf_lightning.flow.stage import MemoryPart, Stage, StageContext
from rlinf_lightning.policies.lm import LMPolicy
from rlinf_lightning.policies.lora import lora_of
from rlinf_lightning.rewards import RewardInput
from rlinf_lightning.seeds import row_seed
from rlinf_lightning.tools.loop import final_turn
from rlinf_lightning.workflows.reasoning.reward import RewardStage
from rlinf_lightning.workflows.specs import RolloutSpec, RunSpec


def pack_samples(
    prompt_ids: list[list[int]], completions: list[list[Completion]], pad_id: int
) -> dict[str, torch.Tensor]:
    """Left-pad prompts, right-pad responses: ``input_ids = [prompt | response]`` per sample, in
    the layout of ``flow.batch`` (a completion's ``mask`` marks tool replies: loss mask 0)."""
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
            resp_mask[i, :n] = 1 if c.mask is None else torch.tensor(c.mask, dtype=torch.float32)
            logps[i, :n] = torch.tensor(c.logprobs)
    return {"input_ids": ids, "attention_mask": attn, LOSS_MASK: resp_mask, "rollout_logprobs": logps}


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


#: mixed into the seed of the reserve prompts and their samples (kept apart from the main stream)
RESERVE_SEED = 104729
#: the group id a slot's ``k``-th replacement is sampled under: ``slot + (k + 1) * RESERVE_GROUP_STRIDE``
RESERVE_GROUP_STRIDE = 1 << 32


class RolloutStage(Stage):
    """Generates ``group_size`` completions per prompt with the chosen rollout engine; prompts are
    laid out by the task's :class:`PromptFormat` (template, then the chat template if any). With
    ``dynamic_sampling``, groups without signal are replaced (:class:`DynamicSampling`).

    With ``turns`` (a :class:`~rlinf_lightning.tools.TurnLoop`), each sample is a multi-turn
    exchange with its environment (tool replies masked out of the loss); its ``completion`` is the
    final turn's text, the answer the reward reads.

    ``spec.dtype`` is ``task.rollout_dtype``: ``auto`` follows the actor's ``precision`` on this
    stage's device (``engines.precision.resolve_rollout_dtype``). ``spec.max_prompt_tokens`` (the
    task's longest prompt) and ``spec.eval_prompts`` (how many it evaluates on) only size the
    memory estimate.
    """

    name = "rollout"
    cost_hint = 1.0
    in_keys = ("prompt", "answer", "group_id")
    out_keys = (
        "input_ids",
        "attention_mask",
        LOSS_MASK,
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
        run: RunSpec,
        spec: RolloutSpec,
        dynamic_sampling: DynamicSampling | None = None,
    ) -> None:
        self.policy, self.spec, self.dynamic_sampling = policy, spec, dynamic_sampling
        self.seed, self.precision = run.seed, run.train.precision
        self.sampling, self.group_size, self.turns = spec.sampling, spec.group_size, spec.turns
        self.prompt_format = spec.prompt_format

    def memory(self, device: str, replicas: int, micro_batch: int) -> list[MemoryPart] | None:
        """The weights in the rollout dtype, and the KV cache of the largest batch it generates:
        ``rows x (longest prompt + max_new_tokens) x layers x 2 (keys, values) x KV heads x head
        dim x dtype bytes``, rows being the larger of a micro-batch's samples and an evaluation
        batch. Not counted: the logits and sampling buffers of a step, and what an engine reserves
        beyond this (vLLM takes ``gpu_memory_utilization`` of the device)."""
        shape = self.policy.architecture()
        if shape is None:
            return None
        dtype = self.dtype(device)
        size = dtype_bytes(dtype)
        rows = max(micro_batch, min(self.spec.eval_prompts, EVAL_BATCH_SIZE))
        tokens = (self.spec.max_prompt_tokens or 0) + self.spec.horizon
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

    def budget(self, micro_batch: int) -> tuple[str, tuple[str, ...]]:
        """The rows it generates at once and their length (the KV cache grows with both)."""
        return f"messages of {micro_batch} samples of up to {self.sampling.max_new_tokens} new tokens", (
            "trainer.micro_batch_size",
            "task.sampling.max_new_tokens",
            "task.rollout_engine_options",
        )

    def dtype(self, device: str) -> str:
        """The engine's dtype on ``device``."""
        return resolve_rollout_dtype(self.spec.dtype, self.precision, device, self.policy.dtype)

    def setup(self, ctx: StageContext) -> None:
        self.tokenizer = self.policy.load_tokenizer()
        self.end_ids = end_token_ids(self.tokenizer)
        engine, dtype = ROLLOUT_ENGINES.get(self.spec.engine), self.dtype(ctx.device)
        self.engine = engine(
            self.policy.model_path, device=ctx.device, dtype=dtype, **self.spec.engine_options
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

    def _generate(
        self, prompts: list[str], answers: list[str], groups: list[int], n: int, params: SamplingParams
    ):
        if self.turns is not None:
            return self.turns.generate(
                self.engine,
                self.tokenizer,
                self.prompt_format,
                prompts,
                groups,
                n,
                params,
                self.seed,
                self.metrics,
                answers,
            )
        prompt_ids = self.prompt_format.encode(self.tokenizer, prompts)
        completions = self.engine.generate(
            prompt_ids, groups, n, params, self.seed, eos_token_id=self.end_ids
        )
        return prompt_ids, completions

    def _texts(self, completions: list[list[Completion]]) -> list[str]:
        return [
            self.tokenizer.decode(final_turn(c), skip_special_tokens=True) for cs in completions for c in cs
        ]

    @staticmethod
    def _env_rewards(completions: list[list[Completion]]) -> torch.Tensor:
        """Each sample's environment reward, NaN where it has none (the task's reward then)."""
        return torch.tensor(
            [float("nan") if c.reward is None else c.reward for cs in completions for c in cs]
        )

    def _resample(
        self, prompts: list[str], answers: list[str], groups: list[int], prompt_ids: list, completions: list
    ) -> None:
        """Replace, in place, the slots whose group's rewards are all equal (dynamic sampling)."""
        ds, n = self.dynamic_sampling, self.group_size
        for round_ in range(ds.rounds + 1):
            reward, _ = ds.scorer.score(
                RewardInput(self._texts(completions), [a for a in answers for _ in range(n)])
            )
            env = self._env_rewards(completions)
            reward = torch.where(env.isnan(), reward, env)
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
                [answers[i] for i in todo],
                [groups[i] + (round_ + 1) * RESERVE_GROUP_STRIDE for i in todo],
                n,
                self.sampling,
            )
            for j, i in enumerate(todo):
                prompt_ids[i], completions[i] = ids[j], comps[j]

    def process(self, batch: TensorDict) -> TensorDict:
        groups = batch["group_id"].tolist()
        prompts, answers = list(batch["prompt"]), list(batch["answer"])
        prompt_ids, completions = self._generate(prompts, answers, groups, self.group_size, self.sampling)
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
                **({"env_reward": self._env_rewards(completions)} if self.turns is not None else {}),
            },
            batch_size=[len(texts)],
        )
        lengths = tensors[LOSS_MASK].sum(-1)  # generated tokens (tool replies not counted)
        self.metrics.distribution("response_length", lengths)
        self.metrics.distribution("prompt_length", [len(p) for p in prompt_ids])
        self.metrics.sum("tokens_total", tensors["attention_mask"].sum())  # prompts + responses
        self.metrics.sum("response_tokens_total", lengths.sum())
        # clipped: stopped by max_new_tokens rather than by the end-of-sequence token
        clipped = [  # with turns: any sample that did not end with an answer
            (self.turns is not None or len(c.token_ids) >= self.sampling.max_new_tokens)
            and (not c.token_ids or c.token_ids[-1] not in self.end_ids)
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
        if self.turns is not None:
            accuracy, _ = self.turns.evaluate(
                self.engine, self.tokenizer, self.prompt_format, prompts, answers, reward, self.sampling
            )
            return accuracy
        return greedy_accuracy(
            self.engine,
            self.tokenizer,
            prompts,
            answers,
            reward,
            self.sampling.max_new_tokens,
            prompt_format=self.prompt_format,
        )
