"""Sampling a next token for every row at once, from counter-based noise.

A row's noise is a pure function of ``(row key, step)``: a few integer hash operations on the row's
key (from ``seeds.row_seed(seed, group, sample)``) and the decode step, turned into one uniform per
row and step. So every row of a batch gets its own random stream in one vectorised op (no generator per
row, no per-row launch), and a row draws the same tokens whatever rows it is batched with.

The uniform picks the token by inverse-CDF over the (filtered) distribution: one uniform per row
instead of a vocabulary of Gumbel noise, and the top-k / top-p filters work in the sorted space
``topk`` or ``sort`` returns, so besides the logits' float32 copy only one vocabulary-sized
float32 tensor (the probabilities, cumulated in place) exists per step.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

_MASK32 = 0xFFFF_FFFF
# odd multipliers below 2**31: a 32-bit value times one stays below 2**63, so int64 never overflows
_MUL_A = 0x7FEB_352D
_MUL_B = 0x5BD1_E995
_STEP_MUL = 0x9E37_79B9  # 2**32 / golden ratio (odd): consecutive steps land far apart


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash (xor-shift-multiply) of int64 values in ``[0, 2**32)``."""
    x = x ^ (x >> 16)
    x = (x * _MUL_A) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL_B) & _MASK32
    return x ^ (x >> 16)


def row_keys(seeds: Sequence[int], device: str | torch.device) -> torch.Tensor:
    """``[B]`` int64: each row's 63-bit seed hashed to the 32-bit key of its stream (once per
    rollout, so a step hashes one number per row)."""
    seeds_t = torch.tensor([[s & _MASK32, (s >> 32) & _MASK32] for s in seeds], dtype=torch.long)
    return _mix32(seeds_t[:, 0] ^ _mix32(seeds_t[:, 1])).to(device)


def counter_uniforms(keys: torch.Tensor, step: int) -> torch.Tensor:
    """One uniform in ``(0, 1)`` per row of ``keys`` for decode step ``step``: SplitMix's recipe on
    32 bits, a Weyl sequence (the key plus ``step`` times an odd constant) through the avalanche
    hash, and its top 24 bits (float32's resolution). Pure per row: batching cannot change it."""
    h = _mix32((keys + (step * _STEP_MUL + 1)) & _MASK32)
    return ((h >> 8).float() + 0.5) * (1.0 / 2**24)


def sample_next(
    logits: torch.Tensor, uniforms: torch.Tensor, temperature: float, top_k: int = -1, top_p: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The next token of each row and its log-prob under ``softmax(logits / temperature)`` (the
    unfiltered distribution, which the actor recomputes). ``temperature <= 0`` is greedy.

    Sampling: ``top_k`` keeps the k most likely tokens, ``top_p`` then the smallest prefix of them
    (most likely first) whose renormalised probability reaches it (the token that crosses is kept);
    the token is where ``uniform x mass`` falls in the kept tokens' cumulative probabilities."""
    scaled = logits.float()
    if temperature > 0 and temperature != 1.0:
        scaled = scaled / temperature if scaled is logits else scaled.div_(temperature)
    lse = torch.logsumexp(scaled, dim=-1, keepdim=True)
    if temperature <= 0:
        token = scaled.argmax(-1)
    else:
        if top_k > 0 and top_k < scaled.shape[-1]:
            vals, idx = torch.topk(scaled, top_k, dim=-1)
        elif top_p < 1.0:
            vals, idx = torch.sort(scaled, dim=-1, descending=True)
        else:
            vals, idx = scaled, None
        norm = lse if vals is scaled else torch.logsumexp(vals, dim=-1, keepdim=True)
        probs = (vals - norm).exp_()
        if top_p < 1.0:
            cdf = probs.cumsum(-1)
            probs = probs.masked_fill_(cdf - probs > top_p, 0.0)
        cdf = probs.cumsum_(-1)
        pick = torch.searchsorted(cdf, uniforms[:, None] * cdf[:, -1:], right=True)
        pick = pick.clamp_max_(cdf.shape[-1] - 1)
        token = (pick if idx is None else idx.gather(-1, pick)).squeeze(-1)
    logp = scaled.gather(-1, token[:, None]).sub_(lse).squeeze(-1)
    return token, logp


def stop_token_ids(eos_token_id: int | Sequence[int] | None) -> list[int]:
    """The token ids that end a completion: ``eos_token_id`` itself, or each of a list; negative ids
    (``-1``: never stop early) and ``None`` (a tokenizer without one) are dropped."""
    ids = [eos_token_id] if isinstance(eos_token_id, int) or eos_token_id is None else list(eos_token_id)
    return [int(i) for i in ids if i is not None and i >= 0]


def end_token_ids(tokenizer: Any) -> list[int]:
    """The ids a completion ends at: the tokenizer's end-of-sequence token, then those of the
    ``generation_config.json`` in the directory it was loaded from (``model.generate`` and vLLM
    stop at those too: Qwen2.5-Instruct's ``<|endoftext|>`` beside ``<|im_end|>``, Llama 3.1's
    ``<|eom_id|>`` beside ``<|eot_id|>``)."""
    ids = stop_token_ids(tokenizer.eos_token_id)
    config = Path(getattr(tokenizer, "name_or_path", "") or ".") / "generation_config.json"
    if config.is_file():
        ids += [i for i in stop_token_ids(json.loads(config.read_text()).get("eos_token_id")) if i not in ids]
    return ids


def stop_string_end(tokenizer: Any, token_ids: Sequence[int], stops: Sequence[str]) -> int | None:
    """How many of ``token_ids`` a completion keeps when it ends on stop strings: up to and
    including the token with which its decoded text (special tokens skipped) first contains one of
    ``stops``; ``None`` when it never does. Matched on text, as vLLM and TRL match stop strings,
    because a BPE tokenizer merges a tag with its neighbours (SmolLM2 writes ``</calc>.`` as
    ``</``, ``calc``, ``>.``): no single token of a tag marks its end."""

    def stopped(k: int) -> bool:
        text = tokenizer.decode(list(token_ids[:k]), skip_special_tokens=True)
        return any(stop in text for stop in stops)

    if not stops or not stopped(len(token_ids)):
        return None
    low, high = 1, len(token_ids)  # the shortest prefix that contains a stop: prefixes only grow
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if stopped(mid) else (mid + 1, high)
    return low
