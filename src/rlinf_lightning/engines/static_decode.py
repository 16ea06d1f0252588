"""The decode step on a static KV cache, captured as a CUDA graph (gpt-fast's recipe).

On a GPU a small model's decode is bound by kernel launches (measured on an H200: plain
``generate`` spends ~19 ms per step launching a few thousand kernels). A static cache gives every
step the same shapes, so the step, our own function around the model, compiles once with
``torch.compile(mode="reduce-overhead")`` and each later token replays one CUDA graph. The logits a
replay returns live in the graph's memory until the next replay; the loop samples from them before
it steps again, so nothing reads an overwritten output (what broke transformers' own static cache
under reduce-overhead: it handed graph outputs back to the caller across replays).

Shapes: the cache length (the prompt, the new tokens and ``WARMUP_STEPS``) is rounded up to
``CACHE_BUCKET`` tokens, so rollouts whose prompts differ by a few tokens replay the same graph; the
rows of a micro-batch are fixed by the plan.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

#: the static cache's length is a multiple of this many tokens (fewer distinct graphs)
CACHE_BUCKET = 64
#: steps run to compile, warm up and record a new shape's graph (cudagraph trees record on the
#: second call and replay from the third); the cache has room for them past the decode's tokens
WARMUP_STEPS = 3


def cudagraph_skips() -> int:
    """How many times torch chose not to capture a compiled function as a CUDA graph in this
    process (a CPU tensor in it, an input mutated outside the graph, too many re-recordings; each
    skip logs its reason under ``TORCH_LOGS=perf_hints``). The step then still runs, compiled but
    launch-bound: only this counter tells."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_skips"]


class StaticDecoder:
    """Prefill and a captured decode step on a ``transformers`` static cache.

    Args:
        model: a causal LM (eval mode, no gradients).
        compile: capture the step (``torch.compile(mode="reduce-overhead")``); ``False`` runs the
            same static-cache step eagerly (what the CPU tests check against the dynamic cache).
    """

    def __init__(self, model: torch.nn.Module, compile: bool = True) -> None:
        self.model = model
        self.compile = compile
        self.failed = False
        self.skipped = 0  # CUDA-graph skips (:func:`cudagraph_skips`) while recording a step
        self.prefill_logits: torch.Tensor | None = None
        self._cache = None
        self._shape: tuple[int, int] | None = None
        captured = torch.compile(self._eager_step, mode="reduce-overhead", dynamic=False)
        self._step = captured if compile else None

    def release(self) -> None:
        """Drop the cache (device memory) while the engine is offloaded; the next rollout makes one."""
        self._cache, self._shape, self.prefill_logits = None, None, None

    def prepare(
        self, ids: torch.Tensor, full_mask: torch.Tensor, pos: torch.Tensor
    ) -> Callable[[torch.Tensor, int, torch.Tensor], torch.Tensor] | None:
        """Prefill ``ids`` into the static cache and warm the captured step; the step function
        ``(token, t, position_ids) -> logits`` of decode step ``t``, or ``None`` (with one warning)
        where the static path fails, so the caller decodes eagerly instead."""
        if self.failed:
            return None
        try:
            return self._prepare(ids, full_mask, pos)
        except Exception as err:  # noqa: BLE001  any failure to compile or capture: decode eagerly
            self.failed = True
            self.release()
            warnings.warn(
                f"rollout engine 'hf': the CUDA-graph decode step failed ({type(err).__name__}: {err}); "
                "decoding eagerly from now on (task.rollout_engine_options.cuda_graph=false silences this)",
                stacklevel=3,
            )
            return None

    def _prepare(self, ids, full_mask, pos):
        from transformers import StaticCache

        rows, width = ids.shape
        length = -(-(full_mask.shape[1] + WARMUP_STEPS) // CACHE_BUCKET) * CACHE_BUCKET
        mask = full_mask.new_zeros(rows, length)
        mask[:, : full_mask.shape[1]] = full_mask
        cache_position = torch.arange(width, device=ids.device)
        if self._shape != (rows, length):
            self._cache = StaticCache(config=self.model.config, max_cache_len=length)
            self._shape = (rows, length)
            if self._step is not None:
                skips = cudagraph_skips()
                self._record(ids, mask, pos, cache_position)
                self._check_captured(ids.device, cudagraph_skips() - skips)
        self._cache.reset()
        self.prefill_logits = self._prefill(ids, mask, pos, cache_position)
        step = self._step or self._eager_step

        def decode(token: torch.Tensor, t: int, position_ids: torch.Tensor) -> torch.Tensor:
            if self._step is not None:
                torch.compiler.cudagraph_mark_step_begin()
            return step(token, position_ids, cache_position[-1:] + 1 + t, mask)

        return decode

    def _record(self, ids, mask, pos, cache_position) -> None:
        """Compile, warm up and record the step of a new cache shape. The cache is allocated by an
        eager prefill first (its tensors then have static addresses, which a graph needs); the
        warm-up steps write past the prompt, so the caller resets the cache and prefills again
        (whether a cache writes at ``cache_position`` or after its own count of written tokens, as
        transformers 5.19's ``StaticLayer`` does, the decode then starts right after the prompt)."""
        self._prefill(ids, mask, pos, cache_position)
        token = ids[:, -1].contiguous()  # as the sampled tokens are (a strided one compiles apart)
        for i in range(WARMUP_STEPS):
            torch.compiler.cudagraph_mark_step_begin()
            self._step(token, pos[:, -1:] + 1 + i, cache_position[-1:] + 1 + i, mask)

    def _check_captured(self, device: torch.device, skips: int) -> None:
        """Warn once where torch skipped the graph of a step it recorded on a GPU (after an offload
        a recording is a re-recording: torch 2.11 stops capturing a step after 128 of them)."""
        if device.type != "cuda" or not skips:
            return
        if not self.skipped:
            warnings.warn(
                "rollout engine 'hf': torch did not capture the decode step as a CUDA graph; it runs "
                "compiled without one, bound by kernel launches (TORCH_LOGS=perf_hints says why)",
                stacklevel=4,
            )
        self.skipped += skips

    def _prefill(self, ids, mask, pos, cache_position) -> torch.Tensor:
        """The prompts through the model into the static cache: the last position's logits."""
        res = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            cache_position=cache_position,
            past_key_values=self._cache,
            use_cache=True,
        )
        return res.logits[:, -1].clone()

    def _eager_step(self, token, position_ids, cache_position, mask):
        res = self.model(
            input_ids=token[:, None],
            attention_mask=mask,
            position_ids=position_ids,
            cache_position=cache_position,
            past_key_values=self._cache,
            use_cache=True,
        )
        return res.logits[:, -1]
