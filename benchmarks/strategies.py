"""Samples/s of each execution plan on the tiny math GRPO workload, side by side in one run.

    python benchmarks/strategies.py [--iterations 40] [--rounds 3]

Every candidate runs in a fresh process (same start-up for all), rounds alternate the candidates
so machine noise hits all of them alike, and the median round counts. All plans get the same two
device slots (``devices=2``; on CPU a slot is one core):

- collocated_1worker (the baseline): one worker on both slots, torch intra-op threads over both
  cores, in the driver's process (no IPC at all): the best a one-process user could do. It runs
  at the default precision (``auto``: bf16-mixed on a CPU with AMX) and at ``32-true``, and the
  faster of the two is the baseline;
- collocated: two data-parallel replicas, one process of one thread per slot, every stage on
  both, the actor's ddp ranks the replicas (``processes`` launcher);
- disaggregated: rollout on slot 0, reward/advantage/inference/actor on slot 1, pipelined;
- hybrid: each explicit placement in HYBRID_PLACEMENTS (RLinf's syntax), pipelined; the best counts.

A second part measures peak RSS of a collocated run with and without offload (context
switching) on a 14 M-parameter model, where weights and optimizer state dominate memory (both
with a fixed 64 KiB mmap threshold, so that RSS follows live memory; see FIXED_MMAP_THRESHOLD).
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from children import parse_args, recipe_assets, run_child

# Offload frees a stage's tensors and re-allocates them at its next turn. glibc's default heap
# keeps freed large blocks (its mmap threshold grows after frees), so RSS would measure heap
# history rather than live memory; with a fixed threshold freed blocks >= 64 KiB return to the OS.
# Both offload candidates run with it.
FIXED_MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": "65536"}

HYBRID = "rlinf_lightning.strategies.HybridStrategy"
HYBRID_PLACEMENTS = [
    "rollout,reward: 0, advantage,inference,actor: 1",
    "rollout,reward,advantage: 0, inference,actor: 1",
]
BASELINE = "collocated_1worker"
ONE_WORKER = {
    "strategy": {"class_path": "rlinf_lightning.strategies.CollocatedStrategy", "init_args": {"replicas": 1}},
    "launcher": "inprocess",
}
BASELINES = {BASELINE: ONE_WORKER, f"{BASELINE}[32-true]": {**ONE_WORKER, "precision": "32-true"}}
PLANS = {
    **BASELINES,
    "collocated": {"strategy": "collocated", "launcher": "processes"},
    "disaggregated": {"strategy": "disaggregated", "launcher": "processes"},
    **{
        f"hybrid[{p}]": {
            "strategy": {"class_path": HYBRID, "init_args": {"placement": p}},
            "launcher": "processes",
        }
        for p in HYBRID_PLACEMENTS
    },
}


def run_one(spec: dict) -> dict:
    """Child process: one fit; samples/s over the iterations after warm-up, peak RSS."""
    import resource
    import time

    from rlinf_lightning import Callback, LMPolicy, RLTrainer, SamplingParams
    from rlinf_lightning.tasks import MathTask

    class Clock(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_iteration_end(self, trainer, iteration, metrics):
            self.times.append(metrics["time/iteration"])

    clock = Clock()
    trainer = RLTrainer(
        strategy=spec["strategy"],
        launcher=spec["launcher"],
        devices=spec.get("devices", 2),
        max_iterations=spec["iterations"],
        default_root_dir=spec["run_dir"],
        logger=False,
        enable_progress_bar=False,
        callbacks=[clock],
        seed=0,
        timeout_s=300,
        precision=spec.get("precision", "auto"),
    )
    task = MathTask(
        spec["train"],
        spec["test"],
        eval_size=spec.get("eval_size", 8),
        group_size=8,
        rollout_batch_size=spec.get("batch", 128),
        sampling=SamplingParams(temperature=1.0, max_new_tokens=6),
    )
    t0 = time.perf_counter()
    trainer.fit(LMPolicy(spec["model"], lr=1e-4), task)
    warm = clock.times[spec.get("warmup", 5) :]
    return {
        "samples_per_s": len(warm) * task.rollout_batch_size / sum(warm),
        "wall_s": time.perf_counter() - t0,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "plan": trainer.plan.describe(),
    }


def child(spec: dict, env: dict[str, str] | None = None) -> dict:
    return json.loads(run_child(__file__, spec, str(spec), env)[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    args = parse_args(ap, run_one)
    if args is None:
        return

    work = Path(tempfile.mkdtemp(prefix="rlinf-bench-"))
    assets = recipe_assets(work)
    print(
        f"cores: {os.cpu_count()}; every plan gets devices=2 (two slots);"
        f" {args.iterations} iterations x 128 samples"
    )
    runs: dict[str, list[float]] = {k: [] for k in PLANS}
    for r in range(args.rounds):
        for name, plan in PLANS.items():
            res = child(
                {**plan, **assets, "iterations": args.iterations, "run_dir": str(work / f"{name}-{r}")}
            )
            runs[name].append(res["samples_per_s"])
            if r == 0:
                print(f"\n[{name}]\n{res['plan']}")
            print(f"round {r}: {name:<60} {res['samples_per_s']:7.1f} samples/s", flush=True)
    sps = {k: statistics.median(v) for k, v in runs.items()}
    best_hybrid = max((k for k in sps if k.startswith("hybrid[")), key=lambda k: sps[k])
    best = max((k for k in sps if k not in BASELINES), key=lambda k: sps[k])
    baseline = max(BASELINES, key=lambda k: sps[k])

    # Offload: a 14 M-parameter model, so weights + Adam state dominate the process's memory.
    from rlinf_lightning.assets import TinyModelConfig, build_tiny_qwen2

    big = build_tiny_qwen2(
        work / "qwen2-14m",
        TinyModelConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                        num_key_value_heads=8),
    )  # fmt: skip
    rss = {}
    for strategy in ("collocated", "collocated_offload"):
        spec = {"strategy": strategy, "launcher": "inprocess", "devices": 1, "model": str(big),
                "iterations": 3, "warmup": 1, "batch": 32, "train": assets["train"], "test": assets["test"],
                "eval_size": 4, "run_dir": str(work / strategy)}  # fmt: skip
        rss[strategy] = child(spec, env=FIXED_MMAP_THRESHOLD)["peak_rss_mb"]
        print(f"peak RSS {strategy:<20} {rss[strategy]:7.1f} MB (14 M-parameter model, 3 iterations)")

    result = {
        **{k: round(v, 1) for k, v in sps.items() if not k.startswith("hybrid[")},
        "hybrid": round(sps[best_hybrid], 1),
        "hybrid_placement": best_hybrid[len("hybrid[") : -1],
        "hybrid_placements": {
            k[len("hybrid[") : -1]: round(v, 1) for k, v in sps.items() if k.startswith("hybrid[")
        },
        "baseline": baseline,
        "best_plan": best,
        "best_over_baseline": round(sps[best] / sps[baseline], 3),
        "rounds": {k: [round(x, 1) for x in v] for k, v in runs.items()},
        "peak_rss_mb_collocated": round(rss["collocated"], 1),
        "peak_rss_mb_collocated_offload": round(rss["collocated_offload"], 1),
        "offload_rss_saving_mb": round(rss["collocated"] - rss["collocated_offload"], 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
