"""Held-out evaluation: greedy decoding, fraction of answers a reward judges correct."""

from __future__ import annotations

from typing import Any

from rlinf_lightning.engines.rollout import RolloutEngine, SamplingParams
from rlinf_lightning.engines.sampling import end_token_ids
from rlinf_lightning.prompts import RAW, PromptFormat
from rlinf_lightning.rewards import RewardInput, load_reward, score

EVAL_BATCH_SIZE = 256  # prompts generated at once when evaluating


def greedy_accuracy(
    engine: RolloutEngine,
    tokenizer: Any,
    prompts: list[str],
    answers: list[str],
    reward: str = "math_verify",
    max_new_tokens: int = 16,
    batch_size: int = EVAL_BATCH_SIZE,
    prompt_format: PromptFormat = RAW,
) -> float:
    """Fraction of ``prompts`` whose greedy completion ``reward`` judges equal to the answer;
    ``prompt_format`` lays the prompts out as the policy was trained on them."""
    judge = load_reward(reward)
    judge.setup()
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    correct, ends = 0.0, end_token_ids(tokenizer)
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        ids = prompt_format.encode(tokenizer, chunk)
        outs = engine.generate(ids, list(range(i, i + len(chunk))), 1, params, 0, ends)
        texts = [tokenizer.decode(cs[0].token_ids, skip_special_tokens=True) for cs in outs]
        correct += float(score(judge, RewardInput(texts, answers[i : i + batch_size], chunk)).sum())
    return correct / max(1, len(prompts))
