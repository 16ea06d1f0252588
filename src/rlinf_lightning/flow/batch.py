"""What a batch is: its shape (:class:`BatchShape`: how many samples an iteration has and what the
indivisible unit of a micro-batch is; a task states it, a strategy cuts it into micro-batches) and
the layout of a reasoning sample, declared once here for every stage that reads it.

A reasoning sample is one row of ``[prompt | response]``:

* ``input_ids [B, P + R]``: the prompt left-padded to ``P``, then the response span right-padded to
  ``R``. The span is everything after the prompt: the tokens the policy generated and, in a
  multi-turn rollout with tools, the environment's replies between its turns.
* ``attention_mask [B, P + R]``: 1 on the prompt and on the whole response span (replies
  included: they are context), 0 on padding. The span's length is its sum over the last ``R``
  columns (:func:`span_lengths`).
* ``response_mask [B, R]`` (:data:`LOSS_MASK`): 1 on the tokens the policy generated, 0 on tool
  replies and padding. The loss, the KL, the advantages and every token count use it, so a reply
  gets no gradient and is not counted. With tools it has holes: it is **not** a prefix of the span,
  so its sum is the generated tokens, not the span's length, and its last 1 is the last generated
  token (:func:`last_loss_token`); per-token recursions (returns, GAE) run over the generated
  tokens only (:func:`compact` / :func:`expand`), a reply being part of the transition between two
  of them.
* ``rollout_logprobs [B, R]``: the behaviour log-prob of each generated token (0 elsewhere).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: the batch key of the loss mask (see the module docstring)
LOSS_MASK = "response_mask"


#: the widths (tokens per row) a model's forwards run at are multiples of this (the default of
#: ``LMPolicy.pad_to_multiple_of`` and of the hf rollout engine's option of that name): on CPU a
#: bf16 matmul keeps compiled kernels for every shape it meets, for the process's life, so a run
#: whose micro-batches take every width up to its longest would grow in memory for as long as it
#: meets new ones (docs/benchmarks.md has the figures); at most ``multiple - 1`` masked columns per
#: forward keep that to a few shapes.
PAD_TO_MULTIPLE_OF = 8


def padded_width(width: int, multiple: int | None) -> int:
    """``width`` rounded up to a multiple of ``multiple`` (unchanged for ``None``)."""
    return width + (-width % multiple if multiple else 0)


def multiple_problems(multiple: object) -> list[tuple[str, str]]:
    """The one check of a ``pad_to_multiple_of`` option, as ``(key, problem)`` pairs."""
    if multiple is None or (isinstance(multiple, int) and not isinstance(multiple, bool) and multiple >= 1):
        return []
    return [("pad_to_multiple_of", f"must be an integer >= 1 or null, got {multiple!r}")]


def left_padded_to_multiple(
    ids: torch.Tensor, mask: torch.Tensor, multiple: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids`` and ``mask`` ``[B, T]`` with masked columns added on the left up to a multiple of
    ``multiple`` columns (the prompts' side, already left-padded: the response stays last, and
    positions come from the mask, so every real token's output is unchanged)."""
    extra = padded_width(ids.shape[-1], multiple) - ids.shape[-1]
    if not extra:
        return ids, mask
    return (
        torch.nn.functional.pad(ids, (extra, 0), value=0),  # any id: a masked key, an unread query
        torch.nn.functional.pad(mask, (extra, 0), value=0),
    )


def span_lengths(attention_mask: torch.Tensor, response_width: int) -> torch.Tensor:
    """Tokens of each row's response span (generated tokens and tool replies): ``[B]``."""
    return attention_mask[:, attention_mask.shape[-1] - response_width :].sum(-1)


def last_loss_token(mask: torch.Tensor) -> torch.Tensor:
    """The column of each row's last generated token (0 for a row without one): ``[B]`` long."""
    columns = torch.arange(1, mask.shape[-1] + 1, device=mask.device)
    return ((mask > 0) * columns).amax(-1).sub(1).clamp_min(0)


def compact(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Move each row's generated tokens (``mask`` 1) to its front, in order: ``(values, mask,
    order)`` with the returned mask a prefix; :func:`expand` with ``order`` puts them back."""
    order = torch.argsort((mask <= 0).to(torch.int8), dim=-1, stable=True)
    return values.gather(-1, order), mask.gather(-1, order), order


def expand(values: torch.Tensor, mask: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Undo :func:`compact`: ``values`` back at their columns, zero where ``mask`` is 0."""
    return torch.zeros_like(values).scatter(-1, order, values) * (mask > 0).to(values.dtype)


@dataclass
class BatchShape:
    """Samples per iteration, samples per prompt group, and the requested micro-batch (or None)."""

    rollout_batch_size: int
    group_size: int
    micro_batch_size: int | None = None

    def micro_batch_for(self, parts: int) -> int:
        """The requested micro-batch, or the largest one of whole groups that cuts the batch into
        at least ``parts`` equal pieces."""
        if self.micro_batch_size:
            return self.micro_batch_size
        groups = self.rollout_batch_size // self.group_size
        for per in range(max(1, groups // parts), 0, -1):
            if groups % per == 0:
                return per * self.group_size
        return self.group_size
