"""Ours against TRL's ``GRPOTrainer``, side by side in one run, on the same machine and threads.

    python benchmarks/vs_trl.py [--steps 8] [--rounds 3] [--tiny-steps 150] [--long-steps 200]
                                [--sections throughput,learning,long_run]

Throughput (a ~24 M-parameter Qwen2 built from a config, random weights; the count is read from
the model): 8 prompts x 8 completions of up to 64 new tokens per optimizer step, learning rate
1e-6. Tokens/s counts the completion tokens each side actually generated (TRL's
``completion_ids`` as its reward function receives them, ours ``rollout/response_tokens_total``;
both up to and including the end-of-sequence token), averaged over the timed steps. TRL 1.16 runs
at its documented defaults (bf16 autocast where supported, HF ``generate``, loss ``dapo``, group
reward scaling, no KL) except what must match ours: ``num_generations=8``,
``per_device_train_batch_size=64`` (all 64 completions in one step, its fastest layout),
``max_completion_length=64``, ``learning_rate`` and ``lr_scheduler_type="constant"`` (ours keeps
the rate constant), ``logging``/``save`` off. Ours runs the library's defaults (collocated on one
slot of both cores, ``precision: auto``, ``rollout: hf``, ``rollout_dtype: auto``) as
``defaults``, and the candidates of :data:`CANDIDATES` (vLLM, float32 rollouts, a token budget);
the fastest is ``ours_best``. TRL and ours at the defaults run ``--rounds`` times, in interleaved
pairs whose order alternates; each side's figures are its median round's, and
``ours_defaults_over_trl_spread`` gives the lowest and highest ratio of a pair (the same side
moved 15% between runs here, so one pair decides nothing). The other candidates run once. Each
candidate is its own process; s/step excludes the first step
(warm-up: allocation, kernel selection), ``s_per_step_with_first`` includes it (from TRL's
``train()`` call and from our first iteration's start).

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

Long run (``long_run``): the 24 M model's GRPO fit over ``--long-steps`` steps (vLLM rollout), with
``trainer.compile`` and eager: the actor's seconds per step over all steps, compile included
(``actor_s_per_step``), after the first, the compile seconds the engine reports, and the MFU.

The last line is one JSON object: s/step, completions/s and tokens/s of both, ``ours_over_trl``
(best) and ``ours_defaults_over_trl`` (with its spread over the rounds), each side's actor MFU
where measured, the tiny model's accuracy and wall time of both (ours at the defaults, with a
float32 rollout, and in 32-true), the long run, and the load average at start and end.
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

from step_clock import StepClock

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
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    t_start = time.perf_counter()  # libraries imported, as in ours: from here on both sides build and train
    tok = AutoTokenizer.from_pretrained(model)
    data = Dataset.from_list(_prompts(train, batch_prompts * (steps + 1)))
    clock = StepClock()
    completion_tokens: list[int] = []  # per step: TRL generates and scores once per step here

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
        callbacks=[clock.trl()],
    )
    t0 = time.perf_counter()
    with sdpa_kernel(SDPBackend.MATH) if math_attention else contextlib.nullcontext():
        trainer.train()
    end = time.perf_counter()
    trainer.save_model(str(out / "final"))
    tok.save_pretrained(str(out / "final"))
    timed = completion_tokens[1:] or completion_tokens  # the steps the stamps time (the first is warm-up)
    return {"s_per_step": clock.s_per_step(end - t0),
            "s_per_step_with_first": clock.s_per_step_with_first(t0), "wall_s": end - t_start,
            "train_s": end - t0, "bf16": bool(config.bf16),
            "completion_tokens_per_step": sum(timed) / len(timed), "final": str(out / "final")}  # fmt: skip


def run_ours(
    model: str, train: Path, test: Path, steps: int, batch_prompts: int, new_tokens: int, lr: float,
    out: Path, task: dict | None = None, trainer: dict | None = None,
):  # fmt: skip
    """Our fit at the library's defaults but for the benchmark's shape and ``task``/``trainer``
    overrides (e.g. ``{"rollout": "vllm"}``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401 (imported untimed, as in TRL's run)

    from rlinf_lightning import LMPolicy, RLTrainer, SamplingParams
    from rlinf_lightning.tasks import MathTask

    clock = StepClock()
    fit = RLTrainer(
        **(trainer or {}),
        max_iterations=steps,
        default_root_dir=str(out),
        logger=False,
        enable_progress_bar=False,
        callbacks=[clock.ours()],
        ckpt_every=0,
    )
    t0 = time.perf_counter()
    math = MathTask(
        str(train),
        str(test),
        eval_size=1,
        group_size=8,
        rollout_batch_size=8 * batch_prompts,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=new_tokens),
        **(task or {}),
    )
    summary = fit.fit(LMPolicy(model, lr=lr), math)
    wall = time.perf_counter() - t0
    mean = clock.steady_mean
    last = (out / "checkpoints" / "last").read_text()
    return {
        "s_per_step": clock.s_per_step(wall),
        "s_per_step_with_first": clock.s_per_step_with_first(),
        "train_wall_s": summary["train_wall_s"],
        "fit_wall_s": wall,
        "mfu": mean("perf/mfu"),
        "actor_s_total": sum(m.get("time/actor", 0.0) for m in clock.metrics),
        "compile_s": sum(m.get("actor/compile_s", 0.0) for m in clock.metrics),
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
    overrides = {k: spec[k] for k in ("task", "trainer") if k in spec}
    name = f"{kind} {json.dumps(overrides)} {Path(spec['model']).name}"
    print(f"[{name}] {json.dumps(result)}", flush=True)
    return result


#: our throughput candidates: task (and trainer) overrides of the library's defaults
CANDIDATES = {
    "defaults": {},  # hf rollout, rollout_dtype auto (bf16 beside a bf16-mixed actor, TIS on)
    "hf-float32": {"task": {"rollout_dtype": "float32"}},  # the defaults before rollout_dtype auto
    "vllm": {"task": {"rollout": "vllm"}},
    "vllm-float32": {"task": {"rollout": "vllm", "rollout_dtype": "float32"}},
    "vllm-tokens2048": {"task": {"rollout": "vllm", "train_max_tokens_per_micro_batch": 2048}},
}
#: the tiny model's learning runs: ours at the defaults, at the defaults before rollout_dtype auto,
#: and in exact float32
TINY_RUNS = {
    "defaults": {},
    "rollout_float32": {"task": {"rollout_dtype": "float32"}},
    "32-true": {"trainer": {"precision": "32-true"}},
}
SECTIONS = ("throughput", "learning", "long_run")


def _median_run(runs: list[dict]) -> dict:
    """The run whose s/step is the median of ``runs`` (an odd count: the middle one), so every
    figure reported for it comes from one run."""
    return sorted(runs, key=lambda r: r["s_per_step"])[(len(runs) - 1) // 2]


def throughput(common: dict, test: Path, work: Path, rounds: int) -> dict:
    """TRL at its defaults against ours at its defaults in ``rounds`` interleaved pairs (the order
    alternates, so a drift of the machine's speed falls on both sides alike), then TRL under the
    math attention kernel and ours per other candidate once."""
    extra = {"trl": {}, "ours": {"test": test}}
    pairs = []
    for r in range(rounds):
        order = ("trl", "ours") if r % 2 == 0 else ("ours", "trl")
        pairs.append({kind: spawn(kind, **common, **extra[kind], out=work / f"{kind}-{r}") for kind in order})
    ratios = [p["trl"]["s_per_step"] / p["ours"]["s_per_step"] for p in pairs]
    trl = _median_run([p["trl"] for p in pairs])
    trl_math = spawn("trl", **common, out=work / "trl-math", math_attention=True)
    ours = {"defaults": _median_run([p["ours"] for p in pairs])}
    ours |= {
        name: spawn("ours", **common, test=test, **over, out=work / name)
        for name, over in CANDIDATES.items()
        if name != "defaults"
    }
    best = min(ours, key=lambda r: ours[r]["s_per_step"])
    completions = 8 * common["batch_prompts"]
    rate = lambda r: {  # noqa: E731
        "s_per_step": r["s_per_step"],
        "s_per_step_with_first": r["s_per_step_with_first"],
        "completions_per_s": completions / r["s_per_step"],
    }
    return {
        "rounds": rounds,
        "trl": {**rate(trl), "tokens_per_s": trl["completion_tokens_per_step"] / trl["s_per_step"],
                "bf16": trl["bf16"], "s_per_step_rounds": [p["trl"]["s_per_step"] for p in pairs]},
        "ours": {name: {**rate(o), "tokens_per_s": o["response_tokens_per_step"] / o["s_per_step"],
                        "actor_s": o["actor_s"], "rollout_s": o["rollout_s"], "mfu": o["mfu"]}
                 for name, o in ours.items()},
        "ours_defaults_s_per_step_rounds": [p["ours"]["s_per_step"] for p in pairs],
        "ours_best": best,
        "ours_over_trl": trl["s_per_step"] / ours[best]["s_per_step"],
        "ours_defaults_over_trl": trl["s_per_step"] / ours["defaults"]["s_per_step"],
        "ours_defaults_over_trl_rounds": ratios,
        "ours_defaults_over_trl_spread": [min(ratios), max(ratios)],
        "ours_defaults_over_trl_with_first": (
            trl["s_per_step_with_first"] / ours["defaults"]["s_per_step_with_first"]
        ),
        "trl_math_attention_s_per_step": trl_math["s_per_step"],
        "ours_over_trl_math_attention": trl_math["s_per_step"] / ours[best]["s_per_step"],
        "actor_mfu": ours[best]["mfu"],
    }  # fmt: skip


def learning(train: Path, test: Path, tiny: Path, steps: int, work: Path) -> dict:
    """The tiny model from the same warm start: held-out accuracy and wall time of TRL and ours."""
    learn = {"model": tiny, "train": train, "steps": steps, "batch_prompts": 16, "new_tokens": 6, "lr": 1e-4}
    trl_tiny = spawn("trl", **learn, out=work / "trl-tiny")
    runs = {
        name: spawn("ours", **learn, test=test, **over, out=work / f"ours-tiny-{name}")
        for name, over in TINY_RUNS.items()
    }
    return {"steps": steps, "trl_accuracy": held_out_accuracy(trl_tiny["final"], str(tiny), test),
            "trl_wall_s": trl_tiny["wall_s"], "trl_train_s": trl_tiny["train_s"],
            **{f"ours_{name}": {"accuracy": held_out_accuracy(r["checkpoint"], str(tiny), test),
                                "wall_s": r["fit_wall_s"], "train_s": r["train_wall_s"],
                                "wall_over_trl": r["fit_wall_s"] / trl_tiny["wall_s"],
                                "train_over_trl": r["train_wall_s"] / trl_tiny["train_s"]}
               for name, r in runs.items()}}  # fmt: skip


def long_run(common: dict, test: Path, steps: int, work: Path) -> dict:
    """``trainer.compile`` over a long run: the actor's seconds per step over ``steps`` steps,
    compile included, against eager (vLLM rollout: the shortest iterations around the actor)."""
    rows = {}
    for name, compiled in (("eager", False), ("compile", True)):
        over = {"task": {"rollout": "vllm"}, "trainer": {"compile": compiled}}
        r = spawn("ours", **{**common, "steps": steps}, test=test, **over, out=work / f"long-{name}")
        rows[name] = {"actor_s_per_step": r["actor_s_total"] / steps, "actor_s_after_first": r["actor_s"],
                      "compile_s": r["compile_s"], "mfu": r["mfu"]}  # fmt: skip
    speedup = rows["eager"]["actor_s_per_step"] / rows["compile"]["actor_s_per_step"]
    return {"steps": steps, **rows, "compile_over_eager": speedup}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps of the throughput runs")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved TRL / ours-at-defaults pairs (odd)")
    ap.add_argument("--tiny-steps", type=int, default=150, help="steps of the tiny model's learning runs")
    ap.add_argument("--long-steps", type=int, default=200, help="actor steps of the compile long run")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"some of {','.join(SECTIONS)}")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    sections = args.sections.split(",")
    if unknown := set(sections) - set(SECTIONS):
        sys.exit(f"--sections: unknown {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
    if args.rounds < 1 or args.rounds % 2 == 0:
        sys.exit(f"--rounds: {args.rounds}; give an odd count >= 1 (the median is one round's)")

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
    result: dict = {
        "model_parameters_m": round(causal_lm_shape(big).parameters / 1e6, 2),
        "load_start": os.getloadavg()[0],
    }
    if "throughput" in sections:
        result.update(throughput(common, test, work, args.rounds))
    if "learning" in sections:
        result["tiny"] = learning(train, test, tiny, args.tiny_steps, work)
    if "long_run" in sections:
        result["long_run"] = long_run(common, test, args.long_steps, work)
    result["load_end"] = os.getloadavg()[0]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
