"""GPU validation on one device: the actor's MFU, the HF rollout's throughput, the weight sync, a
whole collocated GRPO iteration, and FSDP2 against the single engine.

    python benchmarks/gpu.py [--sections peak,actor,rollout,sync,iteration,fsdp]

Runs where CUDA is present and prints one line saying it skipped elsewhere (``--device cpu
--shape tiny`` runs the same code on the CPU with a small model, as ``tests/test_gpu_benchmark.py``
does, so the script cannot rot between GPU sessions). The sections live beside it by concept:
``gpu_common.py`` (shapes, model, batches), ``actor_speed.py`` (``actor``, ``compile``, ``fsdp``),
``actor_memory.py`` (``defaults``, ``chunked``), ``decode_ops.py`` (``generate``, ``decode_ops``).

The model is a ``Qwen2ForCausalLM`` built from Qwen2.5-0.5B's config (24 layers, hidden 896,
14 query and 2 key/value heads, vocabulary 151,936, tied embedding: 494 M parameters) with random
weights, saved and loaded with ``from_pretrained`` as a real checkpoint would be. Every figure runs
the library's own code (the reasoning workflow's ``ActorStage`` and ``PolicyLoss``, the ``hf``
rollout engine, ``RLTrainer.fit``), not a re-implementation:

- ``peak``: the bf16 matmul peak measured here (``engines.flops.peak_matmul_flops``), which MFU
  divides by.
- ``actor``: one GRPO optimizer step under ``bf16-mixed`` over 256 rollout-shaped samples (prompts
  of 24-64 tokens, responses of 128-256), cut into micro-batches by each token budget of
  ``--max-tokens``; tokens/s (real tokens) and MFU (model FLOPs, PaLM's count, over the peak), the
  median over the steps after the first.
- ``rollout``: the ``hf`` engine in bf16 generating ``--sequences`` completions (``--group`` per
  prompt) of exactly ``--new-tokens`` tokens each, KV-cached; tokens/s.
- ``sync``: the actor's weights into the rollout engine (``named_weights`` -> ``update_weights``),
  seconds and share of an iteration (rollout + actor step + sync).
- ``iteration``: ``RLTrainer.fit`` of the math task, collocated on the one GPU (rollout, reward,
  advantage, actor, weight sync), ``--iterations`` iterations; seconds per stage of the last one.
- ``fsdp``: the ``fsdp`` engine (FSDP2, ``MixedPrecisionPolicy``: bf16 compute, float32 reduce) on
  one rank against the ``single`` engine under bf16 autocast, 3 steps on the same batches: loss
  and grad norm per step and the weights' change over the 3 steps, relative differences.
- ``compile``: the actor step with the train engine's ``compile()`` (``trainer.compile``; its
  compile seconds reported).
- ``defaults``: the actor with no micro-batch size or token budget: the budget it chooses for this
  device (``flow.budget``), predicted and measured peak memory; the same for the inference stage
  (a reference forward) and the critic (a value model's step) (``actor_memory.py``).
- ``chunked``: the actor step with the chunked lm head and with whole logits at the smallest
  budget: peak memory, MFU (``actor_memory.py``).
- ``generate``: our ``hf`` engine beside plain ``model.generate`` on the same model, device, dtype
  and sizes: ``rollout_over_generate`` = generate's seconds over ours, and ``graph_rows_as_eager``,
  the share of rows whose first 8 tokens the CUDA-graph step samples as the eager one does (a
  check that the graph decodes right; ``null`` without one or where its capture failed), and
  ``graph_captures``, the graphs captured meanwhile (1: the run's cache shape, captured in the
  warm-up and replayed since; ``null`` without a graph); ``offload_cycle``: the same rollout
  before and after an offload and onload, the share of rows sampled the same, the memory the
  offload freed and the graphs captured again (``decode_ops.py``).
- ``decode_ops``: aten ops dispatched per decode step, ours and ``generate``'s, at ``--ops-rows``
  (eager: the CUDA-graph path replays one graph a step) (``decode_ops.py``).
- ``bound``: the eager actor step's floor on a GPU of ``--bound-tflops`` and ``--bound-tbs`` (an
  H200 by default) per token budget, from every op it dispatches on fake tensors, and so the
  highest MFU the ``actor`` section can measure there; needs no GPU (``--device cpu``)
  (``actor_bound.py``).

The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from actor_bound import bench_bound
from actor_speed import bench_actor, bench_compile, bench_fsdp
from gpu_common import SHAPES, build_model, load_meta, rollout_batch, sync

from rlinf_lightning.rewards import Reward

SECTIONS = (
    "peak", "actor", "rollout", "sync", "iteration", "fsdp", "compile", "defaults", "chunked", "generate",
    "decode_ops", "bound",
)  # fmt: skip


def bench_rollout(model: Path, args):
    from rlinf_lightning.engines.rollout import HFRolloutEngine, SamplingParams

    engine = HFRolloutEngine(str(model), device=args.device, dtype="bfloat16")
    n_prompts = args.sequences // args.group
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, args.token_vocab, (32,), generator=g).tolist() for _ in range(n_prompts)]
    groups = list(range(n_prompts))

    def generate(new_tokens: int) -> float:
        params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
        sync(args.device)
        t0 = time.perf_counter()
        out = engine.generate(
            prompts, groups, args.group, params, 0, -1
        )  # EOS -1: every completion full length
        sync(args.device)
        assert {len(c.token_ids) for cs in out for c in cs} == {new_tokens}
        return time.perf_counter() - t0

    generate(args.new_tokens)  # warm-up: kernels, the allocator, the decode graph of this cache shape
    seconds = statistics.median(generate(args.new_tokens) for _ in range(args.repeats))
    tokens = n_prompts * args.group * args.new_tokens
    row = {
        "sequences": n_prompts * args.group,
        "new_tokens": args.new_tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds),
    }
    print(f"rollout: {row}", flush=True)
    return row, engine


def bench_sync(stage, engine, args) -> dict:
    def once() -> float:
        sync(args.device)
        t0 = time.perf_counter()
        engine.update_weights(stage.engine.named_weights())
        sync(args.device)
        return time.perf_counter() - t0

    once()
    seconds = statistics.median(once() for _ in range(args.repeats))
    row = {"seconds": round(seconds, 4)}
    print(f"sync: {row}", flush=True)
    return row


class Alternating(Reward):
    """A timing reward: 0, 1, 0, 1, ... down each micro-batch (every group has signal)."""

    def __call__(self, batch) -> list[float]:
        return [float(i % 2) for i in range(len(batch.completions))]


def bench_iteration(model: Path, work: Path, args) -> dict:
    """``RLTrainer.fit`` on the math task, collocated on the device: seconds per stage."""
    import rlinf_lightning as rl
    from rlinf_lightning.engines.rollout import SamplingParams
    from rlinf_lightning.rewards import REWARDS
    from rlinf_lightning.tasks.data import make_arithmetic_splits

    data = make_arithmetic_splits(work / "data", n_train=2000, n_validation=50, n_test=64)
    # random weights never answer right (and decode mostly to ''), so every completion would score
    # alike and the actor would skip every group for want of signal; for timing, half of each
    # group is rewarded, so every sample trains
    if "alternating" not in REWARDS:
        REWARDS.register("alternating", Alternating)
    rows: list[dict] = []

    class Record(rl.Callback):
        def on_iteration_end(self, trainer, iteration, metrics) -> None:
            rows.append(dict(metrics))

    task = rl.tasks.MathTask(
        str(data["train"]),
        str(data["test"]),
        reward="alternating",
        eval_size=args.sequences // args.group,
        group_size=args.group,
        rollout_batch_size=args.sequences,
        rollout="hf",
        rollout_dtype="bfloat16",
        sampling=SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens),
        train_max_tokens_per_micro_batch=max(args.max_tokens),
    )
    trainer = rl.RLTrainer(
        strategy="collocated",
        accelerator="cuda" if args.device.startswith("cuda") else "cpu",
        devices=1,
        precision="bf16-mixed",
        max_iterations=args.iterations,
        eval_every=0,
        ckpt_every=0,
        default_root_dir=str(work / "run"),
        logger=False,
        callbacks=[Record()],
        enable_progress_bar=False,
    )
    t0 = time.perf_counter()
    trainer.fit(rl.LMPolicy(str(model), lr=1e-6), task)
    last = rows[-1]
    out = {
        "fit_s": round(time.perf_counter() - t0, 1),
        "iteration_s": round(last["time/iteration"], 3),
        "stages_s": {
            k[5:]: round(v, 3) for k, v in last.items() if k.startswith("time/") and k != "time/iteration"
        },
        "mfu": round(last.get("perf/mfu", float("nan")), 4),
        "response_tokens": last.get("rollout/response_length"),
    }
    print(f"iteration: {out}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="0.5b", choices=sorted(SHAPES))
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--sequences", type=int, default=256)
    ap.add_argument("--group", type=int, default=8, help="completions per prompt")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", default="16384,32768,65536", help="actor token budgets to compare")
    ap.add_argument("--steps", type=int, default=4, help="actor steps per budget (the first is a warm-up)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--fsdp-samples", type=int, default=64)
    ap.add_argument("--profile", action="store_true", help="print the top kernels of one actor step")
    ap.add_argument(
        "--token-vocab", type=int, default=None, help="sample ids below this (default: the vocabulary)"
    )
    ap.add_argument("--logit-chunk", type=int, default=1024, help="chunked section: tokens per lm-head chunk")
    ap.add_argument("--ops-rows", default="32,256", help="decode_ops section: batch sizes")
    bound = "bound section: the GPU's"
    ap.add_argument("--bound-tflops", type=float, default=790.0, help=f"{bound} bf16 matmul peak (H200)")
    ap.add_argument("--bound-tbs", type=float, default=4.8, help=f"{bound} memory bandwidth in TB/s (H200)")
    args = ap.parse_args()
    args.max_tokens = sorted(int(x) for x in args.max_tokens.split(","))
    if args.device == "cuda":
        args.device = "cuda:0"  # what a plan hands a worker
    args.token_vocab = args.token_vocab or SHAPES[args.shape]["vocab_size"]
    sections = args.sections.split(",")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device: torch.cuda.is_available() is False"}))
        return
    if unknown := sorted(set(sections) - set(SECTIONS)):
        raise SystemExit(f"--sections: unknown {unknown}; choose from {','.join(SECTIONS)}")

    from rlinf_lightning.engines.flops import peak_matmul_flops

    result: dict = {
        "device": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "shape": args.shape,
    }
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        t0 = time.perf_counter()
        model = build_model(work / "model", SHAPES[args.shape])
        result["parameters_m"] = round(sum(p.numel() for p in load_meta(model).parameters()) / 1e6, 1)
        result["build_s"] = round(time.perf_counter() - t0, 1)
        peak = peak_matmul_flops(args.device, torch.bfloat16, torch.get_num_threads())
        if not args.device.startswith("cuda"):  # a CPU without native bf16 (no AVX512-BF16/AMX)
            # emulates its square bf16 product slower than it runs float32 or the autocast actor's
            # matmuls (MFU 1.95 against it, 2026-11-27): the chip's peak is its faster dtype's
            peak = max(peak, peak_matmul_flops(args.device, torch.float32, torch.get_num_threads()))
        result["peak_matmul_tflops"] = round(peak / 1e12, 1)
        print(
            f"model {result['parameters_m']} M parameters; measured matmul peak {peak / 1e12:.1f} TFLOP/s",
            flush=True,
        )
        stage = engine = None
        for name in sections:
            try:
                if name == "actor":
                    result["actor"], stage = bench_actor(model, args, peak)
                elif name == "rollout":
                    result["rollout"], engine = bench_rollout(model, args)
                elif name == "sync" and stage is not None and engine is not None:
                    result["sync"] = bench_sync(stage, engine, args)
                elif name == "iteration":
                    stage = engine = None
                    if args.device.startswith("cuda"):
                        torch.cuda.empty_cache()
                    result["iteration"] = bench_iteration(model, work, args)
                elif name == "fsdp":
                    result["fsdp"] = bench_fsdp(model, args)
                elif name == "compile":
                    result["compile"] = bench_compile(model, args, peak)
                elif name in ("defaults", "chunked"):
                    result[name] = bench_memory(name, model, args, peak)
                elif name == "bound":
                    result["bound"] = bench_bound(model, args)
                elif name in ("generate", "decode_ops"):
                    result[name] = bench_decode(name, model, args, engine)
            except Exception as exc:  # one section's failure is a finding; the others still run
                import traceback

                traceback.print_exc()
                result[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        if "sync" in result and "seconds" in result["sync"] and "step_s" in result.get("actor", {}):
            it = result["rollout"]["seconds"] + result["actor"]["step_s"] + result["sync"]["seconds"]
            result["sync"]["share_of_iteration"] = round(result["sync"]["seconds"] / it, 4)
    if out := os.environ.get("OUT"):
        Path(out, "gpu.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


def bench_memory(name: str, model: Path, args, peak: float) -> dict:
    from actor_memory import bench_chunked, bench_defaults

    from rlinf_lightning.flow.memory import gpu_memory, host_memory

    batch = rollout_batch(args.sequences, args.token_vocab, args.new_tokens)
    if name == "chunked":
        return bench_chunked(model, args, batch, peak)
    device_bytes = (
        gpu_memory(torch.device(args.device).index or 0) if args.device.startswith("cuda") else host_memory()
    )
    return bench_defaults(model, args, batch, device_bytes)


def bench_decode(name: str, model: Path, args, engine) -> dict:
    from decode_ops import decode_ops, rollout_over_generate

    from rlinf_lightning.engines.rollout import HFRolloutEngine

    if name == "decode_ops":  # eager, as the profiler counts dispatched ops
        eager = HFRolloutEngine(str(model), device=args.device, dtype="bfloat16", cuda_graph=False)
        rows = [int(r) for r in args.ops_rows.split(",")]
        return decode_ops(eager, rows, args.group, args.token_vocab, short=4, long=12)
    engine = engine or HFRolloutEngine(str(model), device=args.device, dtype="bfloat16")
    return rollout_over_generate(
        engine, args.sequences, args.group, args.token_vocab, args.new_tokens, args.repeats
    )


if __name__ == "__main__":
    main()
