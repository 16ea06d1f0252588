"""The decode step on a static KV cache, captured as a CUDA graph.

On a GPU a small model's decode is bound by kernel launches (plain ``generate`` launches a few
thousand kernels a step; the time they take on an H200: docs/benchmarks.md). A static cache gives every
step the same shapes and addresses, so the step, our own function around the model compiled once
by Inductor (gpt-fast's fusion), is captured as one ``torch.cuda.CUDAGraph`` and each token
replays it: the step's inputs are copied into static buffers the graph reads, and the logits it
writes live in the graph's memory until the next replay; the loop samples from them before it
steps again, so nothing reads an overwritten output (what broke transformers' own static cache
under ``torch.compile(mode="reduce-overhead")``: it handed graph outputs back across replays).

We own the graph rather than leave it to ``reduce-overhead``'s cudagraph trees for its lifetime:
an offload frees the weights, so the onloaded ones have new addresses the old graph does not
read. :meth:`StaticDecoder.release` drops the cache and the graph (its memory pool with them) and
the next rollout captures one on the new addresses (as it does wherever it finds the weights
moved: a graph never replays onto freed memory). Cudagraph trees instead keep every recording
(one more per onload, each checked on every step) and stop capturing a step after a bounded
number of such re-recordings (the versions: docs/benchmarks.md).

Shapes: the cache length (the prompt, the new tokens and ``WARMUP_STEPS``) is rounded up to
``CACHE_BUCKET`` tokens, so rollouts whose prompts differ by a few tokens replay the same graph; the
rows of a micro-batch are fixed by the plan. A new shape drops the old graph and captures its own.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Callable

import torch

#: the static cache's length is a multiple of this many tokens (fewer distinct graphs)
CACHE_BUCKET = 64
#: steps run on a new shape before its capture (compiling, and warming cuBLAS and the allocator
#: up on a side stream, as a capture needs); the cache has room for them past the decode's tokens
WARMUP_STEPS = 3
#: cache shapes the step may compile for in one process: a long run meets a few length buckets
#: times a few row counts, past Dynamo's default of 8 per function, after which it would run a
#: new shape's step as eager Python
MAX_SHAPES = 64

log = logging.getLogger(__name__)


class StaticDecoder:
    """Prefill and a decode step on a ``transformers`` static cache, captured on CUDA.

    Args:
        model: a causal LM (eval mode, no gradients).
        compile: compile the step with Inductor (``torch.compile``); ``False`` runs the same
            static-cache step eagerly (what the CPU tests check against the dynamic cache). On CUDA
            either is captured as a CUDA graph; elsewhere it runs as it is.
    """

    def __init__(self, model: torch.nn.Module, compile: bool = True) -> None:
        self.model = model
        self.failed = False
        self.captures = 0  # CUDA graphs captured: one per new cache shape, again where weights moved
        self.prefill_logits: torch.Tensor | None = None
        self._step = torch.compile(self._eager_step, dynamic=False) if compile else self._eager_step
        self.release()

    def release(self) -> None:
        """Drop the cache and the graph (device memory) while the engine is offloaded; the next
        rollout makes and captures new ones on the weights' new addresses."""
        self._cache, self._shape, self.prefill_logits = None, None, None
        self._addresses: tuple[int, ...] = ()  # the weights' addresses the graph was captured on
        self._inputs: tuple[torch.Tensor, ...] | None = None  # the static step inputs a graph reads
        self._graph: torch.cuda.CUDAGraph | None = None
        self._logits: torch.Tensor | None = None  # the graph's output, rewritten by each replay

    def weight_addresses(self) -> tuple[int, ...]:
        """Where the model's parameters and buffers live: a graph reads them there, so weights
        moved by anything but an in-place copy (an offload without :meth:`release`, a swapped
        tensor) make the next rollout capture again rather than replay onto freed memory."""
        return tuple(t.data_ptr() for t in (*self.model.parameters(), *self.model.buffers()))

    def prepare(
        self, ids: torch.Tensor, full_mask: torch.Tensor, pos: torch.Tensor
    ) -> Callable[[torch.Tensor, int, torch.Tensor], torch.Tensor] | None:
        """Prefill ``ids`` into the static cache (capturing the step for a new shape); the step
        function ``(token, t, position_ids) -> logits`` of decode step ``t``, or ``None`` (with one
        warning) where the static path fails, so the caller decodes eagerly instead."""
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
        if self._shape != (rows, length) or self._addresses != self.weight_addresses():
            self.release()
            self._cache = StaticCache(config=self.model.config, max_cache_len=length)
            self._shape = (rows, length)
            # token, position ids, cache position, mask: the buffers every step reads
            self._inputs = (ids[:, -1].contiguous(), pos[:, -1:] + 1, cache_position[-1:] + 1, mask)
            self._record(ids, pos, cache_position)
            self._addresses = self.weight_addresses()
        token, position_ids, step_position, static_mask = self._inputs
        static_mask.copy_(mask)
        self._cache.reset()
        self.prefill_logits = self._prefill(ids, static_mask, pos, cache_position)

        def decode(next_token: torch.Tensor, t: int, next_position_ids: torch.Tensor) -> torch.Tensor:
            token.copy_(next_token)
            position_ids.copy_(next_position_ids)
            step_position.fill_(width + t)
            if self._graph is None:
                return self._step(*self._inputs)
            self._graph.replay()
            return self._logits

        return decode

    def _record(self, ids, pos, cache_position) -> None:
        """Warm up the step of a new cache shape and, on CUDA, capture it. The cache is allocated
        by an eager prefill first (its tensors then have the static addresses a graph needs); the
        warm-up steps write past the prompt, so the caller resets the cache and prefills again
        (whether a cache writes at ``cache_position`` or after its own count of written tokens, as
        some transformers versions' ``StaticLayer`` does, the decode then starts right after the prompt).
        A capture only records kernels, so it writes nothing."""
        from torch._dynamo.utils import counters

        _, position_ids, step_position, mask = self._inputs
        start, graphs = time.perf_counter(), counters["stats"]["unique_graphs"]
        self._prefill(ids, mask, pos, cache_position)
        cuda = ids.device.type == "cuda"
        stream = torch.cuda.Stream(ids.device) if cuda else None
        if cuda:
            stream.wait_stream(torch.cuda.current_stream(ids.device))
        limit = max(torch._dynamo.config.recompile_limit, MAX_SHAPES)
        with (
            torch.cuda.stream(stream) if cuda else contextlib.nullcontext(),
            torch._dynamo.config.patch(recompile_limit=limit),  # the first step compiles
        ):
            for i in range(WARMUP_STEPS):
                position_ids.copy_(pos[:, -1:] + 1 + i)
                step_position.fill_(ids.shape[1] + i)
                self._step(*self._inputs)
        if cuda:
            torch.cuda.current_stream(ids.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # on the warm-up's stream of the engine's device (the default capture stream would be
            # the current device's); thread_local: another thread of this worker (a weight
            # receiver) may use CUDA meanwhile
            with (
                torch.cuda.device(ids.device),
                torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"),
            ):
                logits = self._step(*self._inputs)
            self._graph, self._logits = graph, logits
            self.captures += 1
        log.info(
            "rollout engine 'hf': decode step for %d rows x %d cache tokens %s%s in %.1f s",
            *self._shape,
            "compiled, " if counters["stats"]["unique_graphs"] > graphs else "",
            "warmed up and captured as a CUDA graph" if cuda else "warmed up",
            time.perf_counter() - start,
        )

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
