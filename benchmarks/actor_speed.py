"""The actor step's speed (sections of ``gpu.py``): MFU per token budget, with ``torch.compile``, and
the ``fsdp`` engine on one rank against ``single``."""

from __future__ import annotations

import statistics
from pathlib import Path

import torch
from gpu_common import rollout_batch, timed_step


def actor_stage(model: Path, engine: str, device: str, max_tokens: int | None):
    from rlinf_lightning.algorithms import GRPO
    from rlinf_lightning.engines.train import TrainSpec
    from rlinf_lightning.flow.stage import StageContext
    from rlinf_lightning.policies import LMPolicy
    from rlinf_lightning.workflows.reasoning.actor import ActorStage
    from rlinf_lightning.workflows.specs import BudgetSpec, RolloutSpec, RunSpec

    run = RunSpec(GRPO(), TrainSpec(engine, {}, "bf16-mixed"))
    stage = ActorStage(LMPolicy(str(model), lr=1e-6), run, RolloutSpec(), BudgetSpec(max_tokens=max_tokens))
    stage.setup(StageContext(device=device, num_threads=torch.get_num_threads()))
    return stage


def bench_actor(model: Path, args, peak: float) -> tuple[dict, object]:
    """Step time, tokens/s and MFU per token budget; returns the stage for the sync section."""
    from rlinf_lightning.policies.lm import causal_lm_train_flops

    batch = rollout_batch(args.sequences, args.token_vocab, args.new_tokens)
    tokens = int(batch["attention_mask"].sum())
    stage = actor_stage(model, "single", args.device, None)
    flops = causal_lm_train_flops(stage.engine.policy.model, batch["attention_mask"])
    out = {
        "samples": len(batch),
        "tokens": tokens,
        "model_tflops_per_step": round(flops / 1e12, 2),
        "budgets": {},
    }
    for budget in args.max_tokens:
        stage.max_tokens = budget
        if args.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats(args.device)
        try:
            times = [timed_step(stage, batch, args.device)[0] for _ in range(args.steps)]
        except torch.OutOfMemoryError as exc:  # larger budgets would too: stop here
            out["budgets"][budget] = {"error": f"out of memory: {str(exc).splitlines()[0][:120]}"}
            print(f"actor  budget {budget}: out of memory", flush=True)
            stage.engine.optimizer.zero_grad(set_to_none=True)
            stage.engine._count = stage.engine._loss_sum = 0.0
            torch.cuda.empty_cache()
            break
        step_s = statistics.median(times[1:]) if len(times) > 1 else times[0]
        row = {
            "step_s": round(step_s, 4),
            "first_step_s": round(times[0], 3),
            "tokens_per_s": round(tokens / step_s),
            "mfu": round(flops / step_s / peak, 4),
        }
        if args.device.startswith("cuda"):
            row["peak_memory_gb"] = round(torch.cuda.max_memory_allocated(args.device) / 2**30, 1)
        out["budgets"][budget] = row
        print(f"actor  budget {budget}: {row}", flush=True)
    ok = {b: r for b, r in out["budgets"].items() if "mfu" in r}
    if ok:
        best = max(ok, key=lambda b: ok[b]["mfu"])
        out.update(
            best_budget=best,
            mfu=ok[best]["mfu"],
            tokens_per_s=ok[best]["tokens_per_s"],
            step_s=ok[best]["step_s"],
        )
        if args.profile:
            stage.max_tokens = min(ok)
            profile_step(stage, batch, args.device)
    return out, stage


def profile_step(stage, batch, device: str) -> None:
    """Where one actor step's device time goes: the top kernels, printed."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        timed_step(stage, batch, device)
    key = "self_cuda_time_total" if device.startswith("cuda") else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60), flush=True)


def bench_compile(model: Path, args, peak: float) -> dict:
    """The actor step at the smallest token budget with the train engine's ``compile()`` (what
    ``trainer.compile`` turns on): compile seconds as the engine reports them (``compile_s``), and
    the step time and MFU after the steps that compiled."""
    from rlinf_lightning.policies.lm import causal_lm_train_flops

    batch = rollout_batch(args.sequences, args.token_vocab, args.new_tokens)
    stage = actor_stage(model, "single", args.device, min(args.max_tokens))
    flops = causal_lm_train_flops(stage.engine.policy.model, batch["attention_mask"])
    stage.engine.compile()
    steps = [timed_step(stage, batch, args.device) for _ in range(args.steps + 2)]
    times = [t for t, _ in steps]
    step_s = statistics.median(times[2:])
    out = {
        "budget": min(args.max_tokens),
        "compile_s": round(sum(m.get("compile_s", 0.0) for _, m in steps), 2),
        "compile_and_first_steps_s": [round(t, 2) for t in times[:2]],
        "step_s": round(step_s, 4),
        "mfu": round(flops / step_s / peak, 4),
    }
    print(f"compile: {out}", flush=True)
    return out


def bench_fsdp(model: Path, args) -> dict:
    """``fsdp`` (one rank) against ``single``: 3 steps over the same batches under bf16."""
    batches = [
        rollout_batch(args.fsdp_samples, args.token_vocab, args.new_tokens // 4, seed=s) for s in range(3)
    ]
    runs = {}
    for engine in ("single", "fsdp"):
        stage = actor_stage(model, engine, args.device, min(args.max_tokens))
        before = {k: v.to("cpu", torch.float32, copy=True) for k, v in stage.engine.named_weights()}
        steps = [timed_step(stage, b, args.device) for b in batches]
        update = {k: v.to("cpu", torch.float32) - before[k] for k, v in stage.engine.named_weights()}
        runs[engine] = {
            "loss": [m["loss"] for _, m in steps],
            "grad_norm": [m["grad_norm"] for _, m in steps],
            "step_s": [round(t, 3) for t, _ in steps],
            "update": torch.cat([u.reshape(-1) for u in update.values()]),
        }
        stage.teardown()
        del stage
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()

    def rel(a: list[float], b: list[float]) -> float:
        return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))

    s, f = runs["single"], runs["fsdp"]
    # the weights' change over the 3 steps (the weights themselves barely move at this rate, and
    # the zero-initialised biases would make any relative difference of weights meaningless)
    fu, su = f["update"].double(), s["update"].double()
    update_diff = float((fu - su).norm() / su.norm())
    cosine = float(fu @ su / (fu.norm() * su.norm()))
    out = {
        "loss_rel_diff": round(rel(f["loss"], s["loss"]), 5),
        "grad_norm_rel_diff": round(rel(f["grad_norm"], s["grad_norm"]), 5),
        "update_rel_diff": round(update_diff, 4),
        "update_cosine": round(cosine, 5),
        "loss": {"single": s["loss"], "fsdp": f["loss"]},
        "grad_norm": {"single": s["grad_norm"], "fsdp": f["grad_norm"]},
        "step_s": {"single": s["step_s"], "fsdp": f["step_s"]},
    }
    print(f"fsdp: {out}", flush=True)
    return out
