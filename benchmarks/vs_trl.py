"""Ours against TRL's ``GRPOTrainer``, side by side in one run, on the same machine and threads.

    python benchmarks/vs_trl.py [--steps 8] [--tiny-steps 150]

Throughput (a ~24 M-parameter Qwen2 built from a config, random weights; the count is read from
the model): 8 prompts x 8 completions of up to 64 new tokens per optimizer step, learning rate
1e-6. Tokens/s counts the completion tokens each side actually generated (TRL's
``completion_ids`` as its reward function receives them, ours ``rollout/response_tokens_total``;
both up to and including the end-of-sequence token), averaged over the timed steps. TRL 1.16 runs
at its documented defaults (bf16 autocast where supported, HF ``generate``, loss ``dapo``, group
reward scaling, no KL) except what must match ours: ``num_generations=8``,
``per_device_train_batch_size=64`` (all 64 completions in one step, its fastest layout),
``max_completion_length=64``, ``learning_rate`` and ``lr_scheduler_type="constant"`` (ours keeps
the rate constant), ``logging``/``save`` off. Ours runs ``configs``-style defaults (collocated on
one slot of both cores, ``precision: auto``) with each rollout engine, in float32 and in bf16
(``rollout_dtype``); the fastest is "ours". Each candidate is its own
process; the first step (warm-up: allocation, kernel selection) is excluded.

Learning (the demo's 0.4 M tiny model from the same supervised warm start, ``artifacts/``): both
train ``--tiny-steps`` steps of 16 prompts x 8 completions of up to 6 tokens at lr 1e-4; held-out
greedy accuracy on the 500 test problems is measured the same way for both (our HF engine on each
result's weights). Wall time is the same span on both sides: from the libraries imported (each
child imports ``transformers`` and its trainer first, untimed) to the trained model, i.e. TRL's
model load, ``GRPOTrainer`` construction and ``train()``, and our whole ``fit`` (config and data
checks, model load, workers, the two one-problem evaluations, the final checkpoint). Each side's
training loop alone is reported too (``train_s``).

TRL at its defaults runs PyTorch's default attention kernel, whose bf16 backward on CPU is slow
(ours switches to the math kernel there, see ``LMPolicy.training_attention``); a TRL run under the
math kernel is reported as ``trl_math_attention_s_per_step`` for reference (the bar's baseline
stays TRL at its documented defaults).

The last line is one JSON object: s/step, completions/s and tokens/s of both, ``ours_over_trl``,
each side's actor MFU where measured, and the tiny model's accuracy and wall time of both.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIG = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8,
       "num_key_value_heads": 2, "max_position_embeddings": 256}  # fmt: skip


def _prompts(path: Path, n: int) -> list[dict]:
    from rlinf_lightning.tasks.data import load_problems

    return [{"prompt": p.prompt, "answer": p.answer} for p in load_problems(path)[:n]]


def _reward(completions, answer, **_):
    from rlinf_lightning.rewards import RewardInput, load_reward, score

    return score(load_reward("math_verify"), RewardInput(list(completions), list(answer))).tolist()


def run_trl(
    model: str, train: Path, steps: int, batch_prompts: int, new_tokens: int, lr: float, out: Path,
    math_attention: bool = False,
):  # fmt: skip
    import contextlib

    import torch
    from datasets import Dataset
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    t_start = time.perf_counter()  # libraries imported, as in ours: from here on both sides build and train
    tok = AutoTokenizer.from_pretrained(model)
    data = Dataset.from_list(_prompts(train, batch_prompts * (steps + 1)))
    stamps: list[float] = []
    completion_tokens: list[int] = []  # per step: TRL generates and scores once per step here

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

    def reward(completions, answer, completion_ids, **kw):
        completion_tokens.append(sum(len(ids) for ids in completion_ids))
        return _reward(completions, answer)

    config = GRPOConfig(
        output_dir=str(out),
        num_generations=8,
        per_device_train_batch_size=8 * batch_prompts,
        max_completion_length=new_tokens,
        learning_rate=lr,
        lr_scheduler_type="constant",
        max_steps=steps,
        logging_steps=10**9,
        save_strategy="no",
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
        seed=0,
    )
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model),
        reward_funcs=reward,
        args=config,
        train_dataset=data,
        processing_class=tok,
        callbacks=[Stamp()],
    )
    t0 = time.perf_counter()
    with sdpa_kernel(SDPBackend.MATH) if math_attention else contextlib.nullcontext():
        trainer.train()
    end = time.perf_counter()
    trainer.save_model(str(out / "final"))
    tok.save_pretrained(str(out / "final"))
    per_step = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else end - t0
    timed = completion_tokens[1:] or completion_tokens  # the steps the stamps time (the first is warm-up)
    return {"s_per_step": per_step, "wall_s": end - t_start, "train_s": end - t0, "bf16": bool(config.bf16),
            "completion_tokens_per_step": sum(timed) / len(timed), "final": str(out / "final")}  # fmt: skip


def run_ours(
    model: str, train: Path, test: Path, steps: int, batch_prompts: int, new_tokens: int, lr: float,
    rollout: str, out: Path, rollout_dtype: str | None = None, precision: str = "auto",
    max_tokens: int | None = None, devices: int = 1,
):  # fmt: skip
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401 (imported untimed, as in TRL's run)

    from rlinf_lightning import Callback, LMPolicy, RLTrainer, SamplingParams
    from rlinf_lightning.tasks import MathTask

    stamps: list[float] = []
    metrics: list[dict] = []

    class Stamp(Callback):
        def on_iteration_end(self, trainer, iteration, m):
            stamps.append(time.perf_counter())
            metrics.append(dict(m))

    trainer = RLTrainer(
        precision=precision,
        devices=devices,
        max_iterations=steps,
        default_root_dir=str(out),
        logger=False,
        enable_progress_bar=False,
        callbacks=[Stamp()],
        ckpt_every=0,
    )
    t0 = time.perf_counter()
    task = MathTask(
        str(train),
        str(test),
        eval_size=1,
        group_size=8,
        rollout_batch_size=8 * batch_prompts,
        rollout=rollout,
        rollout_dtype=rollout_dtype,
        train_max_tokens_per_micro_batch=max_tokens,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=new_tokens),
    )
    summary = trainer.fit(LMPolicy(model, lr=lr), task)
    wall = time.perf_counter() - t0
    per_step = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else wall
    steady = metrics[1:] or metrics
    mean = lambda k: sum(m.get(k, 0.0) for m in steady) / len(steady)  # noqa: E731
    last = (out / "checkpoints" / "last").read_text()
    return {
        "s_per_step": per_step,
        "train_wall_s": summary["train_wall_s"],
        "fit_wall_s": wall,
        "mfu": mean("perf/mfu"),
        "actor_s": mean("time/actor"),
        "rollout_s": mean("time/rollout"),
        "response_tokens_per_step": mean("rollout/response_tokens_total"),
        "checkpoint": str(out / "checkpoints" / last),
    }


def held_out_accuracy(weights_dir: str, model_dir: str, test: Path) -> float:
    """Greedy accuracy on every test problem with our HF engine and the weights in ``weights_dir``."""
    from safetensors.torch import load_file

    from rlinf_lightning.engines.rollout import HFRolloutEngine
    from rlinf_lightning.evaluation import greedy_accuracy
    from rlinf_lightning.policies import LMPolicy
    from rlinf_lightning.tasks.data import load_problems

    engine = HFRolloutEngine(model_dir)
    engine.update_weights(load_file(str(Path(weights_dir) / "model.safetensors")).items())
    problems = load_problems(test)
    tok = LMPolicy(model_dir).load_tokenizer()
    return greedy_accuracy(
        engine, tok, [p.prompt for p in problems], [p.answer for p in problems], max_new_tokens=6
    )


def child(args) -> None:
    spec = json.loads(args.child)
    kind = spec.pop("kind")
    fn = run_trl if kind == "trl" else run_ours
    result = fn(**{k: Path(v) if k in ("train", "test", "out") else v for k, v in spec.items()})
    print("RESULT " + json.dumps(result), flush=True)


def spawn(kind: str, **spec) -> dict:
    spec = {"kind": kind, **{k: str(v) if isinstance(v, Path) else v for k, v in spec.items()}}
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled"}
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True, env=env
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{kind} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    result = json.loads(lines[-1][7:])
    name = f"{kind} {spec.get('rollout', '')} {spec.get('rollout_dtype') or ''} {Path(spec['model']).name}"
    print(f"[{name}] {json.dumps(result)}", flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps of the throughput runs")
    ap.add_argument("--tiny-steps", type=int, default=150, help="steps of the tiny model's learning runs")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)

    from rlinf_lightning.assets import TinyModelConfig, build_tiny_qwen2
    from rlinf_lightning.policies.model_dir import causal_lm_shape

    data = ROOT / "data" / "arithmetic"
    train, test = data / "train.jsonl", data / "test.jsonl"
    tiny = ROOT / "artifacts" / "tiny-qwen2-sft"
    if not (train.is_file() and tiny.is_dir()):
        sys.exit("run `bash scripts/run.sh` (or `rlinf prepare` and `rlinf sft`) first: data and warm start")
    work = Path(tempfile.mkdtemp(prefix="vs_trl-"))
    big = build_tiny_qwen2(work / "qwen2-24m", TinyModelConfig(**BIG))
    common = {
        "model": big,
        "train": train,
        "steps": args.steps,
        "batch_prompts": 8,
        "new_tokens": 64,
        "lr": 1e-6,
    }

    trl = spawn("trl", **common, out=work / "trl")
    trl_math = spawn("trl", **common, out=work / "trl-math", math_attention=True)
    ours = {}
    candidates = {  # rollout engine, its dtype, the actor's token budget per micro-batch
        "vllm-float32": ("vllm", None, None),
        "vllm-bfloat16": ("vllm", "bfloat16", None),
        "vllm-bfloat16-tokens2048": ("vllm", "bfloat16", 2048),
        "hf-float32": ("hf", None, None),
        "hf-bfloat16": ("hf", "bfloat16", None),
    }
    for name, (rollout, dtype, budget) in candidates.items():
        ours[name] = spawn(
            "ours",
            **common,
            test=test,
            rollout=rollout,
            rollout_dtype=dtype,
            max_tokens=budget,
            out=work / name,
        )
    best = min(ours, key=lambda r: ours[r]["s_per_step"])
    completions = 64

    learn = {
        "model": tiny,
        "train": train,
        "steps": args.tiny_steps,
        "batch_prompts": 16,
        "new_tokens": 6,
        "lr": 1e-4,
    }
    trl_tiny = spawn("trl", **learn, out=work / "trl-tiny")
    tiny_runs = {  # precision auto is bf16-mixed on a CPU with AMX, which costs this 0.4 M model time
        p: spawn("ours", **learn, test=test, rollout="hf", precision=p, out=work / f"ours-tiny-{p}")
        for p in ("auto", "32-true")
    }
    trl_acc = held_out_accuracy(trl_tiny["final"], str(tiny), test)
    tiny_acc = {p: held_out_accuracy(r["checkpoint"], str(tiny), test) for p, r in tiny_runs.items()}

    result = {
        "model_parameters_m": round(causal_lm_shape(big).parameters / 1e6, 2),
        "trl": {"s_per_step": trl["s_per_step"], "completions_per_s": completions / trl["s_per_step"],
                "tokens_per_s": trl["completion_tokens_per_step"] / trl["s_per_step"], "bf16": trl["bf16"]},
        "ours": {r: {"s_per_step": o["s_per_step"], "completions_per_s": completions / o["s_per_step"],
                     "tokens_per_s": o["response_tokens_per_step"] / o["s_per_step"], "actor_s": o["actor_s"],
                     "rollout_s": o["rollout_s"], "mfu": o["mfu"]} for r, o in ours.items()},
        "ours_best_rollout": best,
        "ours_over_trl": trl["s_per_step"] / ours[best]["s_per_step"],
        "trl_math_attention_s_per_step": trl_math["s_per_step"],
        "ours_over_trl_math_attention": trl_math["s_per_step"] / ours[best]["s_per_step"],
        "actor_mfu": ours[best]["mfu"],
        "tiny": {"steps": args.tiny_steps, "trl_accuracy": trl_acc, "trl_wall_s": trl_tiny["wall_s"],
                 "trl_train_s": trl_tiny["train_s"],
                 **{f"ours_{p}": {"accuracy": tiny_acc[p], "wall_s": r["fit_wall_s"],
                                  "train_s": r["train_wall_s"],
                                  "wall_over_trl": r["fit_wall_s"] / trl_tiny["wall_s"],
                                  "train_over_trl": r["train_wall_s"] / trl_tiny["train_s"]}
                    for p, r in tiny_runs.items()}},
    }  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
