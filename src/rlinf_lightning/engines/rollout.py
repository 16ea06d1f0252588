"""Rollout engines: generate n completions per prompt with the sampled tokens' log-probs.

Built-in: ``hf``, a KV-cached sampling loop over a ``transformers`` model. Plugins (e.g. ``vllm``)
register more engines in :data:`ROLLOUT_ENGINES` with the same interface.

Sampling is reproducible per prompt, not per batch: sample ``j`` of prompt group ``g`` draws its
noise from its own generator seeded by ``(seed, g, j)``. So the completions do not depend on how
prompts were grouped into micro-batches, which is what lets different execution plans produce the
same samples.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from rlinf_lightning.engines.offload import Offloader
from rlinf_lightning.registry import Registry
from rlinf_lightning.seeds import row_seed


@dataclass
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
        eos_token_id: int | list[int],
    ) -> list[list[Completion]]:
        """``n`` completions per prompt; ``groups[i]`` names prompt ``i`` for per-sample seeding.

        A completion ends with the first token in ``eos_token_id`` (one id or several: the end of
        a tool call stops a turn too), kept as its last token. ``-1`` never stops early: every
        completion has ``max_new_tokens`` tokens.
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


ROLLOUT_ENGINES: Registry[type[RolloutEngine]] = Registry("rollout engine")


def engine_option_problems(name: str, options: dict[str, Any]) -> list[tuple[str, str]]:
    """``(option, problem)`` for each of ``options`` that the rollout engine registered as ``name``
    does not take as a keyword (its options are its constructor's keyword-only arguments besides
    ``device`` and ``dtype``), found before any engine is built."""
    params = inspect.signature(ROLLOUT_ENGINES.get(name)).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return []
    taken = [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY and n not in ("device", "dtype")]
    return [
        (key, f"not an option of rollout engine {name!r}; it takes: {', '.join(taken) or 'none'}")
        for key in options
        if key not in taken
    ]


def top_k_top_p_filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask logits outside the top-k and the top-p nucleus with -inf (rows independent)."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > top_p  # keep the token that crosses top_p
        logits = logits.masked_fill(drop.scatter(-1, idx, drop), float("-inf"))
    return logits


@ROLLOUT_ENGINES.register("hf")
class HFRolloutEngine(RolloutEngine):
    """``transformers`` model with a KV-cached sampling loop (the CPU-friendly fallback)."""

    def __init__(self, model_path: str, *, device: str = "cpu", dtype: str = "float32") -> None:
        super().__init__(model_path, device=device, dtype=dtype)
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
        self.model.to(device).eval()
        self.model.requires_grad_(False)
        self._offloader = Offloader(device)

    def onload(self) -> None:
        self._offloader.onload(self.model)

    def offload(self) -> None:
        self._offloader.offload(self.model)

    @torch.no_grad()
    def generate(self, prompt_ids, groups, n, params, seed, eos_token_id):
        stops = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        pad = self.model.config.pad_token_id if self.model.config.pad_token_id is not None else stops[0]
        rows = [(p, g, j) for p, g in zip(prompt_ids, groups) for j in range(n)]
        width = max(len(p) for p, _, _ in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (p, _, _) in enumerate(rows):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        # one generator per row, on the engine's device: a row's samples depend only on its seed,
        # wherever it is batched, and on a GPU the noise is drawn there (drawing a vocabulary of
        # noise per row on the host and copying it over bounded the GPU rollout by the CPU)
        gens = [torch.Generator(self.device).manual_seed(row_seed(seed, g, j)) for _, g, j in rows]
        tokens, logps = self._sample(
            ids.to(self.device),
            mask.to(self.device),
            gens,
            params,
            torch.tensor(stops, device=self.device),
            pad,
        )
        out: list[list[Completion]] = []
        for i in range(len(rows)):
            toks, lps = [], []
            for t, lp in zip(tokens[i].tolist(), logps[i].tolist()):
                toks.append(t)
                lps.append(lp)
                if t in stops:
                    break
            if i % n == 0:
                out.append([])
            out[-1].append(Completion(toks, lps))
        return out

    def _sample(self, ids, mask, gens, params, stops, pad):
        greedy = params.temperature <= 0
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        res = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        past, logits = res.past_key_values, res.logits[:, -1]
        pos = pos[:, -1:]
        done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
        tokens, logps = [], []
        for _ in range(params.max_new_tokens):
            scaled = logits.float() if greedy else logits.float() / params.temperature
            logp = torch.log_softmax(scaled, dim=-1)
            if greedy:
                nxt = scaled.argmax(-1)
            else:
                noise = torch.stack(
                    [torch.rand(scaled.shape[-1], generator=g, device=g.device) for g in gens]
                )
                gumbel = -torch.log(-torch.log(noise.clamp_min(1e-20)))  # Gumbel-max = exact sampling
                nxt = (top_k_top_p_filter(scaled, params.top_k, params.top_p) + gumbel).argmax(-1)
            tokens.append(torch.where(done, pad, nxt))
            logps.append(torch.where(done, 0.0, logp.gather(-1, nxt[:, None]).squeeze(-1)))
            done = done | torch.isin(nxt, stops)
            if bool(done.all()):
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
            pos = pos + 1
            res = self.model(
                input_ids=nxt[:, None],
                attention_mask=mask,
                position_ids=pos,
                past_key_values=past,
                use_cache=True,
            )
            past, logits = res.past_key_values, res.logits[:, -1]
        return torch.stack(tokens, 1).cpu(), torch.stack(logps, 1).cpu()

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
