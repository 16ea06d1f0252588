"""Our actor step against a plain ``transformers`` forward and backward of the same batch, in one
process, the rounds interleaved: a ratio that stays meaningful on a loaded machine, where the
seconds themselves are not (``real_model.py``'s ``actor`` section)."""

from __future__ import annotations

import statistics
import time

import torch
from gpu_common import rollout_batch


def actor_vs_hf(model: str, completions: int, new_tokens: int, lr: float, micro_batch: int | None,
                precision: str, rounds: int) -> dict:  # fmt: skip
    """Seconds of our ``ActorStage`` step (GRPO, the ``single`` engine in ``precision``, the
    recipe's micro-batches) and of a plain step on the same rollout-shaped batch (``completions``
    samples of prompts of 24-64 tokens and responses of half to all of ``new_tokens``; ``precision``
    as ``trainer.precision`` on a CPU): the whole
    logits, the response tokens' mean log-prob as the loss, backward, then (``hf_step``) the
    gradient clipped and a fused AdamW step, as ours does. Each side's median over ``rounds``
    after one warm-up step."""
    from transformers import AutoModelForCausalLM

    from rlinf_lightning.algorithms import GRPO
    from rlinf_lightning.engines.precision import autocast, resolve_precision
    from rlinf_lightning.engines.train import TrainSpec
    from rlinf_lightning.flow.stage import StageContext
    from rlinf_lightning.policies import LMPolicy
    from rlinf_lightning.workflows.reasoning.actor import ActorStage

    precision = resolve_precision(precision, "cpu")
    stage = ActorStage(LMPolicy(model, lr=lr), GRPO(), TrainSpec("single", {}, precision), 1.0, micro_batch,
                       rollout_dtype="auto")  # fmt: skip
    stage.setup(StageContext(device="cpu", num_threads=torch.get_num_threads()))
    plain = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(plain.parameters(), lr=lr, fused=True)
    batch = rollout_batch(completions, plain.config.vocab_size, new_tokens)

    def ours() -> float:
        t = time.perf_counter()
        stage.begin_iteration(1)
        stage.process(batch)
        stage.end_iteration().compute()
        return time.perf_counter() - t

    def hf(with_step: bool) -> float:
        t = time.perf_counter()
        ids, mask, response = batch["input_ids"], batch["attention_mask"], batch["response_mask"]
        r = response.shape[-1]
        with autocast(precision, "cpu"):
            logits = plain(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, -r - 1 : -1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, -r:, None]).squeeze(-1)
        (-(logp * response).sum() / response.sum()).backward()
        if with_step:
            torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - t

    sides = {"ours": ours, "hf_fwd_bwd": lambda: hf(False), "hf_step": lambda: hf(True)}
    times: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(rounds + 1):
        for name, fn in sides.items():
            seconds = fn()
            if i:  # the first round warms up
                times[name].append(seconds)
    median = {name: statistics.median(ts) for name, ts in times.items()}
    return {
        "completions": completions,
        "tokens": int(batch["attention_mask"].sum()),
        "precision": precision,
        "threads": torch.get_num_threads(),
        **{f"{name}_s": round(s, 3) for name, s in median.items()},
        "ours_over_hf_fwd_bwd": round(median["ours"] / median["hf_fwd_bwd"], 3),
        "ours_over_hf_step": round(median["ours"] / median["hf_step"], 3),
    }
