"""Actor step time and memory of the ``single``, ``ddp`` and ``fsdp`` train engines, side by side.

    python benchmarks/train_engines.py [--steps 4] [--batch 32] [--model 14m|100m]

A Qwen2 built from a config (14 M parameters by default, or ~100 M); every engine trains the
same global batches (real rollouts' shapes: prompt + 16 response tokens, random advantages), two
micro-batches per step, AdamW, as the actor stage of a collocated plan under the ``processes``
launcher, every engine with the same thread budget: ``ddp`` and ``fsdp`` on 2 replicas (the engine's
ranks) of ``--threads`` torch threads each, ``single`` on 1 replica of twice that (the JSON's
``threads_total`` and ``threads_per_replica`` say so per engine). Each engine runs from a fresh
driver process; the step time is the median over the steps after the first. Memory: peak RSS of
each replica process (also above its RSS before the model loaded), and the bytes of parameters +
gradients + Adam state each one holds; each engine as shipped, and all under one allocator
setting (see ALLOCATORS). Last line: JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from children import parse_args, run_child

from rlinf_lightning.workflows.reasoning.actor import ActorStage

# Each engine as shipped: ``single`` and ``ddp`` train under the launcher's allocator setting; the fsdp
# engine fixes its replica processes' mmap threshold (4 MiB). Then, so that the comparison does
# not hinge on that, every process under the same fixed threshold. The fsdp engine with glibc's
# default heap is measured too: the fragmentation that the engine's setting avoids.
ALLOCATORS = {"as-shipped": {}, "4mib-mmap-for-all": {"MALLOC_MMAP_THRESHOLD_": str(4 * 2**20)}}
CANDIDATES = {"single": {}, "ddp": {}, "fsdp": {}, "fsdp-glibc-heap": {"malloc_mmap_threshold_mb": None}}

RANKS = 2  # ddp and fsdp replicas; single trains on one replica with their threads combined

MODELS = {
    "14m": {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4, "num_attention_heads": 8,
            "num_key_value_heads": 8},
    "100m": {"hidden_size": 768, "intermediate_size": 2304, "num_hidden_layers": 14,
             "num_attention_heads": 12, "num_key_value_heads": 12},
}  # fmt: skip


def batches(n_batches: int, size: int, seed: int = 0):
    import torch
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        prompt, resp = 12, 16
        ids = torch.randint(3, 100, (size, prompt + resp), generator=g)
        td = TensorDict(
            {
                "input_ids": ids,
                "attention_mask": torch.ones_like(ids),
                "response_mask": torch.ones(size, resp),
                "rollout_logprobs": -torch.rand(size, resp, generator=g) * 3,
                "advantage": torch.randn(size, generator=g),
            },
            batch_size=[size],
        )
        out.append(td)
    return out


class BenchActor(ActorStage):
    """The reasoning actor, reporting its process's memory and the state its engine holds."""

    def setup(self, ctx) -> None:
        self.rss_before_model_mb = _max_rss_mb()
        super().setup(ctx)

    def memory(self) -> dict:
        engine = self.engine
        params = sum(_local(p).numel() * _local(p).element_size() for p in engine.policy.parameters())
        optim = sum(
            _local(v).numel() * _local(v).element_size()
            for st in engine.optimizer.state.values()
            for v in st.values()
            if torch.is_tensor(v) and v.dim()
        )
        peak = _max_rss_mb()
        return {
            "peak_rss_mb": (peak, peak - self.rss_before_model_mb),
            "state_mb": (2 * params + optim) / 2**20,
        }


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _max_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_one(spec: dict) -> dict:
    from rlinf_lightning.algorithms import GRPO
    from rlinf_lightning.engines.train import TrainSpec
    from rlinf_lightning.flow import BatchShape, Workflow
    from rlinf_lightning.launchers import LAUNCHERS
    from rlinf_lightning.policies import LMPolicy
    from rlinf_lightning.strategies import STRATEGIES, Resources

    name = spec["engine"].split("-")[0]
    replicas = 1 if name == "single" else RANKS
    threads = RANKS * spec["threads"] // replicas  # the same budget for every engine
    train = TrainSpec(name, CANDIDATES[spec["engine"]])  # float32, as the figures in the README
    actor = BenchActor(LMPolicy(spec["model"], lr=1e-5), GRPO(), train, 1.0, None)
    wf = Workflow("train").chain(actor).role("train", "actor")
    plan = STRATEGIES.resolve("collocated").plan(
        wf, Resources(replicas, threads_per_slot=threads), BatchShape(spec["batch"], spec["batch"] // 2)
    )
    runtime = LAUNCHERS.get("processes")().launch(wf, plan, timeout_s=1800)
    try:
        data = batches(2 * spec["steps"], spec["batch"] // 2)
        times = []
        for s in range(spec["steps"]):
            t0 = time.perf_counter()
            runtime.run_iteration(s + 1, data[2 * s : 2 * s + 2])
            times.append(time.perf_counter() - t0)
        weights = runtime.call("actor", "state_dict", replicas="all")[0]["model"]
        memory = runtime.call("actor", "memory", replicas="all")
    finally:
        runtime.shutdown()
    return {
        "step_s": statistics.median(times[1:]),
        "checksum": float(sum(v.double().sum() for k, v in weights.items() if k != "lm_head.weight")),
        "peak_rss_mb": [m["peak_rss_mb"] for m in memory],
        "state_mb": [m["state_mb"] for m in memory],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--model", choices=sorted(MODELS), default="14m")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per ddp/fsdp rank")
    args = parse_args(ap, run_one)
    if args is None:
        return
    from rlinf_lightning.assets import TinyModelConfig, build_tiny_qwen2

    model = build_tiny_qwen2(
        Path(tempfile.mkdtemp(prefix="rlinf-train-bench-")) / f"qwen2-{args.model}",
        TinyModelConfig(**MODELS[args.model]),
    )
    result: dict = {
        "ranks": RANKS,
        "model": args.model,
        "threads_total": RANKS * args.threads,
        "threads_per_replica": {"single": RANKS * args.threads, "ddp": args.threads, "fsdp": args.threads},
    }
    for allocator, env in ALLOCATORS.items():
        res = {}
        for name in CANDIDATES if allocator == "as-shipped" else ("single", "ddp", "fsdp"):
            spec = {
                "engine": name,
                "model": str(model),
                "steps": args.steps,
                "batch": args.batch,
                "threads": args.threads,
            }
            res[name] = r = json.loads(run_child(__file__, spec, f"{allocator} {name}", env)[-1])
            rss = [f"{p:.0f} (+{m:.0f} for the model)" for p, m in r["peak_rss_mb"]]
            state = [round(x, 1) for x in r["state_mb"]]
            print(
                f"[{allocator}] {name:<15} step {r['step_s']:.3f} s  peak RSS/process {rss} MB"
                f"  state/process {state} MB",
                flush=True,
            )
        fsdp_peak = [p for p, _ in res["fsdp"]["peak_rss_mb"]]
        single_peak = res["single"]["peak_rss_mb"][0][0]
        figures = {
            "single_step_s": round(res["single"]["step_s"], 4),
            "ddp_step_s": round(res["ddp"]["step_s"], 4),
            "fsdp_step_s": round(res["fsdp"]["step_s"], 4),
            "single_peak_rss_mb": round(single_peak, 1),
            "ddp_peak_rss_mb_per_rank": [round(p, 1) for p, _ in res["ddp"]["peak_rss_mb"]],
            "fsdp_peak_rss_mb_per_rank": [round(p, 1) for p in fsdp_peak],
            "fsdp_peak_below_single": max(fsdp_peak) < single_peak,
            "single_state_mb": round(res["single"]["state_mb"][0], 1),
            "fsdp_state_mb_per_rank": [round(x, 1) for x in res["fsdp"]["state_mb"]],
            "fsdp_weights_match_single": abs(res["fsdp"]["checksum"] - res["single"]["checksum"]) < 1e-2,
        }
        if allocator == "as-shipped":
            heap = res["fsdp-glibc-heap"]
            figures["fsdp_glibc_heap_step_s"] = round(heap["step_s"], 4)
            figures["fsdp_glibc_heap_peak_rss_mb_per_rank"] = [round(p, 1) for p, _ in heap["peak_rss_mb"]]
            result.update(figures)
        else:
            result[allocator] = figures
    print(json.dumps(result))


if __name__ == "__main__":
    main()
