"""The actor's memory (and the inference and critic stages'), measured against ``flow.budget``'s
prediction (sections of ``gpu.py``).

- ``defaults``: an ``ActorStage`` with no micro-batch size and no token budget, its budget chosen
  as a plan's memory check chooses it (``choose_budget`` over the whole device: the only resident),
  one GRPO step over ``--sequences`` rollout-shaped samples; the chosen budget, the predicted
  and the measured peak.
  Beside it the inference stage (reference log-probs: one forward under ``no_grad``) and the
  critic (a value model's step), each alone on the device at the defaults as well: the budget it
  chooses, its predicted and measured peak over the same samples.
- ``chunked``: the same step at one token budget with the lm head chunked
  (``policy.logit_chunk_tokens``) and with whole logits: peak memory, tokens/s and MFU side by side.

Peak memory: ``torch.cuda.max_memory_allocated`` on a GPU; on a CPU the process's resident
high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``) above its resident size
before the stage was built, so the interpreter and libraries are not counted but allocator slack is.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import torch

GIB = 2**30


def _vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


class PeakMemory:
    """Peak bytes a block of work adds on ``device`` (see the module docstring)."""

    def __init__(self, device: str) -> None:
        self.device = device

    def __enter__(self) -> PeakMemory:
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
            self.base = _vm("VmRSS")
        return self

    def __exit__(self, *exc) -> None:
        if self.device.startswith("cuda"):
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.base
        else:
            self.peak = _vm("VmHWM") - self.base


def _stage(model: Path, device: str, budget: int | None, chunk: int | None, prompt: int, new: int):
    from rlinf_lightning.algorithms import GRPO
    from rlinf_lightning.engines.rollout import SamplingParams
    from rlinf_lightning.engines.train import TrainSpec
    from rlinf_lightning.policies import LMPolicy
    from rlinf_lightning.workflows.reasoning.actor import ActorStage
    from rlinf_lightning.workflows.specs import BudgetSpec, RolloutSpec, RunSpec

    policy = LMPolicy(str(model), lr=1e-6, logit_chunk_tokens=chunk)
    spec = TrainSpec("single", {}, "auto")  # bf16-mixed on a GPU; float32 on a CPU without bf16
    rollout = RolloutSpec(sampling=SamplingParams(max_new_tokens=new), max_prompt_tokens=prompt)
    return ActorStage(policy, RunSpec(GRPO(), spec), rollout, BudgetSpec(max_tokens=budget))


def bench_defaults(model: Path, args, batch, device_bytes: int) -> dict:
    """The budget chosen at the defaults for ``device_bytes`` and one step at it."""
    from gpu_common import timed_step

    from rlinf_lightning.flow.budget import DEVICE_FRACTION
    from rlinf_lightning.flow.stage import StageContext

    prompt = int(batch["attention_mask"].shape[-1] - batch["response_mask"].shape[-1])
    stage = _stage(model, args.device, None, 1024, prompt, args.new_tokens)
    chosen = stage.choose_budget(args.device, device_bytes * DEVICE_FRACTION, 1, len(batch))
    if isinstance(chosen, tuple):
        return {"error": f"{chosen[0]}: {chosen[1]}"}
    stage.apply_budget(chosen)
    predicted = sum(p.nbytes for p in stage.memory(args.device, 1, len(batch), budget=chosen))
    with PeakMemory(args.device) as mem:
        stage.setup(StageContext(device=args.device, num_threads=torch.get_num_threads()))
        seconds = [timed_step(stage, batch, args.device)[0] for _ in range(args.steps)]
    row = {
        "chosen_budget": chosen.tokens,
        "checkpointing": chosen.checkpointing,
        "cut": stage.max_tokens is not None,
        "predicted_peak_gib": round(predicted / GIB, 2),
        "peak_memory_gib": round(mem.peak / GIB, 2),
        "peak_over_predicted": round(mem.peak / predicted, 3),
        "step_s": round(statistics.median(seconds), 3),
    }
    print(f"defaults: {row}", flush=True)
    del stage
    return {**row, **other_stages(model, args, batch, device_bytes)}


def other_stages(model: Path, args, batch, device_bytes: int) -> dict:
    """The inference and critic stages at the defaults, each alone on ``device_bytes``: the budget
    each chooses, its predicted peak and the measured peak of one call over ``batch`` (a reference
    forward; a critic step). On a CPU each is measured after the actor's step, whose freed memory the
    process keeps and reuses, so these peaks read low there."""
    from rlinf_lightning.algorithms import GRPO, PPO
    from rlinf_lightning.engines.rollout import SamplingParams
    from rlinf_lightning.engines.train import TrainSpec
    from rlinf_lightning.flow.budget import DEVICE_FRACTION
    from rlinf_lightning.flow.stage import StageContext
    from rlinf_lightning.policies import LMPolicy, ValueModel
    from rlinf_lightning.workflows.critic import CriticStage
    from rlinf_lightning.workflows.padding import micro_batches
    from rlinf_lightning.workflows.reasoning.advantage import AdvantageStage
    from rlinf_lightning.workflows.reasoning.inference import InferenceStage
    from rlinf_lightning.workflows.specs import BudgetSpec, RolloutSpec, RunSpec

    prompt = int(batch["attention_mask"].shape[-1] - batch["response_mask"].shape[-1])
    new, spec = args.new_tokens, TrainSpec("single", {}, "auto")
    rollout = RolloutSpec(sampling=SamplingParams(max_new_tokens=new), max_prompt_tokens=prompt)
    ppo = PPO().on_tokens()
    stages = {
        "inference": InferenceStage(LMPolicy(str(model)), RunSpec(GRPO(kl_coef=0.01)), rollout),
        "critic": CriticStage(
            ValueModel(str(model)), AdvantageStage(ppo, new), RunSpec(ppo, spec), rollout, BudgetSpec()
        ),
    }
    data = batch.clone()
    data["values"] = torch.zeros(data["response_mask"].shape)
    data["returns"] = torch.randn(data["response_mask"].shape, generator=torch.Generator().manual_seed(0))
    out = {}
    for name, stage in stages.items():
        chosen = stage.choose_budget(args.device, device_bytes * DEVICE_FRACTION, 1, len(batch))
        if isinstance(chosen, tuple):
            out[name] = {"error": f"{chosen[0]}: {chosen[1]}"}
            continue
        stage.apply_budget(chosen)
        predicted = sum(p.nbytes for p in stage.memory(args.device, 1, len(batch), budget=chosen))
        with PeakMemory(args.device) as mem:
            stage.setup(StageContext(device=args.device, num_threads=torch.get_num_threads()))
            if name == "inference":
                stage.process(batch.clone())
            else:
                for chunk in micro_batches(data, None, stage.max_tokens):
                    stage.engine.accumulate(chunk, stage.loss)
                stage.engine.step()
        out[name] = {
            "chosen_budget": chosen.tokens,
            "cut": stage.max_tokens is not None,
            "predicted_peak_gib": round(predicted / GIB, 2),
            "peak_memory_gib": round(mem.peak / GIB, 2),
            "peak_over_predicted": round(mem.peak / predicted, 3),
        }
        print(f"defaults, {name}: {out[name]}", flush=True)
        stage.teardown()
        stages[name] = stage = None  # freed before the next one is measured
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return out


def bench_chunked(model: Path, args, batch, peak_flops: float) -> dict:
    """Chunked against whole logits at the smallest ``--max-tokens`` budget."""
    from gpu_common import timed_step

    from rlinf_lightning.flow.stage import StageContext
    from rlinf_lightning.policies.lm import causal_lm_train_flops

    budget = min(args.max_tokens)
    prompt = int(batch["attention_mask"].shape[-1] - batch["response_mask"].shape[-1])
    out = {"budget": budget}
    # chunked first: on a CPU what the allocator kept from the first can only lower the second's
    # measured peak, which understates the whole logits' cost, not the saving
    for name, chunk in (("chunked", args.logit_chunk), ("whole", None)):
        stage = _stage(model, args.device, budget, chunk, prompt, args.new_tokens)
        with PeakMemory(args.device) as mem:
            stage.setup(StageContext(device=args.device, num_threads=torch.get_num_threads()))
            times = [timed_step(stage, batch, args.device)[0] for _ in range(args.steps)]
        step_s = statistics.median(times[1:]) if len(times) > 1 else times[0]
        flops = causal_lm_train_flops(stage.engine.policy.model, batch["attention_mask"])
        predicted = sum(p.nbytes for p in stage.memory(args.device, 1, len(batch)))
        out[name] = {
            "peak_memory_gib": round(mem.peak / GIB, 3),
            "predicted_peak_gib": round(predicted / GIB, 3),
            "step_s": round(step_s, 3),
            "mfu": round(flops / step_s / peak_flops, 4),
        }
        del stage
    out["peak_whole_over_chunked"] = round(
        out["whole"]["peak_memory_gib"] / out["chunked"]["peak_memory_gib"], 2
    )
    print(f"chunked: {out}", flush=True)
    return out
