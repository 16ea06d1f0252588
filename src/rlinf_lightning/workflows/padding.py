"""Actor micro-batches that spend no compute on padding.

A rollout batch is laid out ``[prompt | response]`` with prompts left-padded to the longest prompt
and responses right-padded to the longest response of the whole batch (``pack_samples``). Two
steps take the padding out of the actor's forward and backward:

1. every micro-batch is trimmed to its own longest prompt and response (:func:`trim_padding`);
2. with a token budget, samples are sorted by length and cut greedily so that each micro-batch's
   padded size (rows x its longest row) stays within the budget (:func:`token_budget_split`):
   similar lengths share a micro-batch, so little padding is left to trim, and a micro-batch of
   short samples holds more of them.

The update is the same as over the padded batch: positions come from the attention mask, every
dropped column is padding, and the losses are sums divided once by the global count.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from rlinf_lightning.flow.batch import LOSS_MASK, span_lengths

RESPONSE_KEYS = (
    LOSS_MASK, "rollout_logprobs", "ref_logprobs", "old_logprobs", "advantage", "values", "returns",
)  # fmt: skip


def trim_padding(batch: TensorDict) -> TensorDict:
    """``batch`` without the prompt columns no row uses and the response columns after its longest
    response (at least one response column is kept)."""
    response = batch[LOSS_MASK].shape[-1]
    prompt_width = batch["input_ids"].shape[-1] - response
    prompt_used = int(batch["attention_mask"][:, :prompt_width].sum(-1).max())
    # the span, not the loss mask: a multi-turn response has tool replies (mask 0) inside it
    response_used = max(1, int(span_lengths(batch["attention_mask"], response).max()))
    if prompt_used == prompt_width and response_used == response:
        return batch
    columns = slice(prompt_width - prompt_used, prompt_width + response_used)
    out = {}
    for key, value in batch.items():
        if key in ("input_ids", "attention_mask"):
            out[key] = value[:, columns]
        elif key in RESPONSE_KEYS and value.dim() == 2:  # per token (an advantage may be per sample)
            out[key] = value[:, :response_used]
        else:
            out[key] = value
    return TensorDict(out, batch_size=batch.batch_size)


def token_budget_split(batch: TensorDict, max_tokens: int) -> list[TensorDict]:
    """Micro-batches of ``batch`` (sorted by length) whose padded size, rows x longest row, is at
    most ``max_tokens`` (a row longer than the budget goes alone); each trimmed."""
    lengths = batch["attention_mask"].sum(-1)
    order = torch.argsort(lengths, stable=True).tolist()
    groups: list[list[int]] = []
    longest = 0
    for i in order:
        n = int(lengths[i])
        if groups and (len(groups[-1]) + 1) * max(longest, n) <= max_tokens:
            groups[-1].append(i)
            longest = max(longest, n)
        else:
            groups.append([i])
            longest = n
    return [trim_padding(batch[torch.tensor(g)]) for g in groups]


def micro_batches(batch: TensorDict, max_samples: int | None, max_tokens: int | None) -> list[TensorDict]:
    """The actor's micro-batches of ``batch``: by a token budget when given, else by at most
    ``max_samples`` rows (``None``: the whole batch); padding trimmed either way."""
    if max_tokens:
        return token_budget_split(batch, max_tokens)
    return [trim_padding(chunk) for chunk in batch.split(max_samples or len(batch))]
