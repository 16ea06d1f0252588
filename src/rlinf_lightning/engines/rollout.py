"""Rollout engines: generate n completions per prompt with the sampled tokens' log-probs.

Built-in: ``hf``, a KV-cached sampling loop over a ``transformers`` model. Plugins (e.g. ``vllm``)
register more engines in :data:`ROLLOUT_ENGINES` with the same interface.

Sampling is reproducible per prompt, not per batch: sample ``j`` of prompt group ``g`` draws its
noise from a counter-based stream keyed by ``(seed, g, j)`` (``engines.sampling``). So the
completions do not depend on how prompts were grouped into micro-batches, which is what lets
different execution plans produce the same samples.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from rlinf_lightning.engines.offload import Offloader
from rlinf_lightning.engines.sampling import (
    counter_uniforms,
    row_keys,
    sample_next,
    stop_string_end,
    stop_token_ids,
)
from rlinf_lightning.engines.static_decode import StaticDecoder
from rlinf_lightning.flow.batch import PAD_TO_MULTIPLE_OF, multiple_problems, padded_width
from rlinf_lightning.registry import Registry
from rlinf_lightning.seeds import row_seed

#: decode steps between checks that every row has stopped (each check syncs the host with the device)
STOP_CHECK_EVERY = 8


@dataclass(frozen=True)
class SamplingParams:
    """How completions are drawn. ``temperature=0`` is greedy (used for evaluation).

    Args:
        temperature: logits are divided by it before sampling (and the sampled tokens' log-probs
            are taken under that distribution); ``0`` is greedy (evaluation only: RL sampling
            needs ``task.sampling.temperature > 0``).
        top_p: nucleus sampling: sample from the smallest set of tokens whose probability reaches it
            (``1.0``: all tokens).
        top_k: sample from the ``top_k`` most likely tokens (``-1``: no limit).
        max_new_tokens: longest completion, in tokens.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 16


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # log-prob of each sampled token under softmax(logits / temperature)
    #: 1 where the policy generated the token, 0 on a tool reply (``None``: all generated)
    mask: list[int] | None = None
    #: the sample's environment's ``reward``, in place of the task's (``None``: the task's)
    reward: float | None = None


class RolloutEngine(ABC):
    """Interface every rollout engine implements.

    Args:
        model_path: a ``from_pretrained`` directory (weights, config, tokenizer).
        device: ``"cpu"`` or ``"cuda[:i]"``.
        dtype: parameter dtype name (``float32``; ``bfloat16`` on GPU).
    """

    def __init__(self, model_path: str, *, device: str = "cpu", dtype: str = "float32") -> None:
        self.model_path = model_path
        self.device = device
        self.dtype = dtype

    @abstractmethod
    def generate(
        self,
        prompt_ids: list[list[int]],
        groups: list[int],
        n: int,
        params: SamplingParams,
        seed: int,
        eos_token_id: int | Sequence[int],
        stop: Sequence[str] = (),
    ) -> list[list[Completion]]:
        """``n`` completions per prompt; ``groups[i]`` names prompt ``i`` for per-sample seeding.

        A completion ends at (and includes) ``eos_token_id``, or any of a list of stop ids;
        ``-1`` never stops early: every completion has ``max_new_tokens`` tokens. With ``stop``
        (strings: a tool call's closing tag), it also ends at (and includes) the token with which
        its decoded text first contains one of them (``sampling.stop_string_end``), whatever
        the tokenizer merged the string with.
        """

    @abstractmethod
    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, partial: bool = False
    ) -> None:
        """Load new weights (HF parameter names) into the running engine, in place. Every weight,
        or with ``partial`` only those that changed (a LoRA actor's merged layers: the others keep
        the base's values the engine loaded from ``model_path``)."""

    def onload(self) -> None:
        """Re-acquire device memory (weights, cache) before generating."""

    def offload(self) -> None:
        """Release device memory while other stages use the device."""

    @classmethod
    def option_problems(cls, options: dict[str, Any]) -> list[tuple[str, str]]:
        """``(option, problem)`` for each value of ``options`` this engine would refuse, found
        before any engine is built (the names are checked against the constructor already)."""
        return []


ROLLOUT_ENGINES: Registry[type[RolloutEngine]] = Registry("rollout engine")


def engine_option_problems(name: str, options: dict[str, Any]) -> list[tuple[str, str]]:
    """``(option, problem)`` for each of ``options`` that the rollout engine registered as ``name``
    does not take as a keyword (its options are its constructor's keyword-only arguments besides
    ``device`` and ``dtype``), found before any engine is built."""
    params = inspect.signature(ROLLOUT_ENGINES.get(name)).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return []
    taken = [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY and n not in ("device", "dtype")]
    unknown = [
        (key, f"not an option of rollout engine {name!r}; it takes: {', '.join(taken) or 'none'}")
        for key in options
        if key not in taken
    ]
    return unknown or ROLLOUT_ENGINES.get(name).option_problems(options)


def after_stop(tokens: torch.Tensor, logps: torch.Tensor, stop: torch.Tensor, pad: int):
    """``pad`` tokens and log-prob ``0`` after each row's first stop token (on the host)."""
    hit = torch.isin(tokens, stop).long()
    past = (hit.cumsum(1) - hit) > 0
    return tokens.masked_fill(past, pad).cpu(), logps.masked_fill(past, 0.0).cpu()


@ROLLOUT_ENGINES.register("hf")
class HFRolloutEngine(RolloutEngine):
    """A ``transformers`` model with our own decode loop (gpt-fast's split: :meth:`_prefill`, one
    :meth:`_decode_step`, the loop in :meth:`_decode`).

    No per-row or per-token host work: the noise of every row comes from one counter-based draw
    (``engines.sampling``), and finished rows are checked every ``STOP_CHECK_EVERY`` tokens. On
    CUDA the decode step runs on a static KV cache, compiled and captured as a CUDA graph
    (``engines.static_decode``; an offload drops it); where that fails the engine warns once and
    decodes eagerly. Elsewhere (CPU) it decodes eagerly on the dynamic cache.

    Args:
        cuda_graph: on CUDA, capture the decode step as a CUDA graph (``False``: always eager).
        pad_to_multiple_of: the prompts are left-padded to a width that is a multiple of this
            (``None``: to the longest prompt), so the prefill meets few shapes: on CPU a bf16
            matmul keeps compiled kernels for each one (``LMPolicy``'s option of the same name).
    """

    def __init__(
        self,
        model_path: str,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        cuda_graph: bool = True,
        pad_to_multiple_of: int | None = PAD_TO_MULTIPLE_OF,
    ) -> None:
        super().__init__(model_path, device=device, dtype=dtype)
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
        self.model.to(device).eval()
        self.model.requires_grad_(False)
        self._offloader = Offloader(device)
        on_cuda = torch.device(device).type == "cuda"
        self.graphs = StaticDecoder(self.model) if cuda_graph and on_cuda else None
        self.pad_to_multiple_of = pad_to_multiple_of

    @classmethod
    def option_problems(cls, options: dict[str, Any]) -> list[tuple[str, str]]:
        return multiple_problems(options.get("pad_to_multiple_of"))

    def onload(self) -> None:
        self._offloader.onload(self.model)

    def offload(self) -> None:
        if self.graphs is not None:  # first: the offload's empty_cache then frees their memory too
            self.graphs.release()  # its static cache and CUDA graph hold device memory
        self._offloader.offload(self.model)

    @cached_property
    def tokenizer(self) -> Any:
        """The model directory's tokenizer, loaded when stop strings are first matched."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model_path)

    @torch.no_grad()
    def generate(self, prompt_ids, groups, n, params, seed, eos_token_id, stop=()):
        stops = stop_token_ids(eos_token_id)
        pad = self.model.config.pad_token_id
        pad = pad if pad is not None else (stops[0] if stops else 0)
        rows = [(p, g, j) for p, g in zip(prompt_ids, groups) for j in range(n)]
        width = padded_width(max(len(p) for p, _, _ in rows), self.pad_to_multiple_of)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (p, _, _) in enumerate(rows):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        keys = row_keys([row_seed(seed, g, j) for _, g, j in rows], self.device)
        tokens, logps = self._decode(
            ids.to(self.device), mask.to(self.device), keys, params, stops, pad, tuple(stop)
        )
        out: list[list[Completion]] = []
        for i in range(len(rows)):
            toks, lps = [], []
            for t, lp in zip(tokens[i].tolist(), logps[i].tolist()):
                toks.append(t)
                lps.append(lp)
                if t in stops:
                    break
            if (end := stop_string_end(self.tokenizer, toks, stop) if stop else None) is not None:
                toks, lps = toks[:end], lps[:end]
            if i % n == 0:
                out.append([])
            out[-1].append(Completion(toks, lps))
        return out

    def _prefill(self, ids, mask, pos):
        """The prompts' forward: the logits of their last position and the KV cache."""
        res = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        return res.logits[:, -1], res.past_key_values

    def _decode_step(self, token, mask, pos, past):
        """One token per row through the model on the cache ``past``: the next logits."""
        res = self.model(
            input_ids=token[:, None], attention_mask=mask, position_ids=pos, past_key_values=past
        )
        return res.logits[:, -1]

    def _decode(self, ids, mask, keys, params, stops, pad, stop_strings=()):
        """Up to ``max_new_tokens`` per row: ``[B, T]`` tokens (``pad`` after a stop token) and
        log-probs; a row whose text contains one of ``stop_strings`` also counts as done (the
        caller cuts it there)."""
        rows, width, steps = ids.shape[0], ids.shape[1], params.max_new_tokens
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        full_mask = torch.cat([mask, mask.new_ones(rows, steps)], dim=-1)  # sliced, never grown
        stop = torch.tensor(stops or [-1], device=ids.device)
        step_fn = None if self.graphs is None else self.graphs.prepare(ids, full_mask, pos)
        if step_fn is None:
            logits, past = self._prefill(ids, mask, pos)
            step_fn = lambda token, t, pos: self._decode_step(token, full_mask[:, : width + t + 1], pos, past)  # noqa: E731
        else:
            logits = self.graphs.prefill_logits
        pos = pos[:, -1:]
        done = torch.zeros(rows, dtype=torch.bool, device=ids.device)
        tokens, logps = [], []
        for t in range(steps):
            nxt, logp = sample_next(
                logits, counter_uniforms(keys, t), params.temperature, params.top_k, params.top_p
            )
            tokens.append(nxt)
            logps.append(logp)
            if t + 1 == steps:
                break
            if (t + 1) % STOP_CHECK_EVERY == 0:  # the host waits for the device only here
                done |= torch.isin(torch.stack(tokens[-STOP_CHECK_EVERY:], 1), stop).any(1)
                if stop_strings:
                    done |= self._stopped_on_text(tokens, done, stop_strings)
                if bool(done.all()):
                    break
            pos = pos + 1
            logits = step_fn(nxt, t, pos)
        return after_stop(torch.stack(tokens, 1), torch.stack(logps, 1), stop, pad)

    def _stopped_on_text(self, tokens: list[torch.Tensor], done: torch.Tensor, stops: tuple[str, ...]):
        """The rows not yet done whose text so far contains one of ``stops`` (decoded on the host)."""
        rows = torch.stack(tokens, 1).tolist()
        hit = [
            not d and any(s in self.tokenizer.decode(r, skip_special_tokens=True) for s in stops)
            for r, d in zip(rows, done.tolist())
        ]
        return torch.tensor(hit, device=done.device)

    def update_weights(self, named_tensors, *, partial=False):
        params = dict(self.model.named_parameters())  # a tied lm_head is the embedding, listed once
        updated = set()
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name in params:
                    params[name].copy_(tensor.to(params[name].device, params[name].dtype))
                    updated.add(name)
                elif not name.endswith("lm_head.weight"):  # tied to the embedding in small models
                    raise KeyError(f"rollout engine has no parameter {name!r}")
        if not partial and (missing := sorted(set(params) - updated)):
            raise RuntimeError(
                f"weight sync left {len(missing)} rollout parameter(s) with their old values: "
                f"{', '.join(missing[:5])}; the actor's state dict must name every parameter"
            )
