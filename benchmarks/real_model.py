"""A real pretrained chat model learns with GRPO: SmolLM2-135M-Instruct on natural-language
arithmetic (configs/math_grpo_smollm2.yaml), side by side with TRL's ``GRPOTrainer``.

    python benchmarks/real_model.py [--seeds 0,1] [--kinds addition,mix] [--steps 60]
        [--trl-steps 10] [--eval-size 200] [--rounds 3] [--threads 0]
        [--sections learning,vs_trl,rollout,actor,tools] [--fit-args "--policy.lr=2e-5 ..."]
    python benchmarks/real_model.py --smoke     # the whole path at a tiny budget (minutes)

Assets are made if absent (``rlinf prepare --model smollm2-135m-instruct --word_problems
'[addition, mix]'``): the model, and 200 held-out problems per kind that share their operands, in
any order, with no training problem (``tasks/word_problems.py``).

Held-out accuracy is greedy (float32, our HF engine on the weights under test, the recipe's prompt
template inside the chat template, the recipe's ``max_new_tokens``), judged twice: by the recipe's
reward (``math_verify``) and by the last integer of the completion (``last_int``: a restated
question or a number the reward misreads shows as a gap between the two). ``anchored`` counts
completions whose "The answer is N" names the gold answer.

Sections:

* ``learning``: per kind (two-digit addition; the harder mix) and seed, ``rlinf fit`` of the recipe
  (exactly as configured but for ``--steps`` and the data paths) and the held-out accuracy before
  and after; ``fit_wall_s`` is the whole fit (model load, workers, checkpoint). Bars (issue #59):
  addition >= 0.60 and the mix >= +0.20 over its start, on both judges, within 30 minutes of fit.
* ``vs_trl``: TRL's ``GRPOTrainer`` and ours from the same model on the same data (two-digit
  addition, the same chat prompts), group size, completions per step, completion length, learning
  rate (constant), sampling temperature and precision (bf16 autocast: TRL's default, ours under
  ``precision: auto`` where the CPU computes bf16), ``--trl-steps`` steps each; seconds per step
  after the first (the stamps of each side's step ends) and held-out accuracy after the same
  number of steps. TRL runs at its defaults otherwise (loss ``dapo``, no KL), as in
  benchmarks/vs_trl.py. Bars: ours >= 2.0x TRL's steps per second, accuracy within 0.03 of TRL's
  or better.
* ``rollout``: our ``hf`` rollout engine against plain ``model.generate`` (sampling at the
  recipe's temperature, top-k off, bf16 weights on both) on the same prompts, batch and length:
  completion tokens per second, each side's median of ``--rounds`` after one warm-up. Bar:
  >= 1.0.
* ``tools``: the calculator task in words (three-digit products,
  ``configs/math_grpo_smollm2_tools.yaml``): the warm start on traces of easier problems
  (``configs/math_sft_tools_smollm2.yaml``, cached in ``artifacts/``), then ``--steps`` GRPO
  iterations with the calculator, against the model without tools trained by the addition recipe's
  config on the same products for the same iterations; held-out greedy accuracy by the reward
  (with tools: the final turn's) and the share of samples that called the tool. Bar (issue #59):
  >= +0.30 over the model without tools.
* ``actor``: our actor step (the recipe's precision, micro-batches and learning rate) over a plain
  ``transformers`` forward and backward of the same batch of ``batch`` completions, and over that
  plus the clipped AdamW step (``benchmarks/actor_vs_hf.py``), in this process, ``--rounds``
  interleaved: ratios, meaningful on a loaded machine where the seconds are not.

``--threads N`` gives every side N torch threads (ours ``trainer.num_threads``, TRL's child and this
process ``torch.set_num_threads``); 0 leaves each at its default, the machine's cores. On a shared
machine fewer threads than cores are faster: where other processes hold the cores, each parallel
kernel waits for a thread the scheduler has put aside (measured on 2 cores at a load average of
2-4: our actor step on 4 samples took 13 s with 2 threads, 2.9 s with 1).

Each fit runs in its own process. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from step_clock import StepClock

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "math_grpo_smollm2.yaml"
TOOLS_CONFIG = ROOT / "configs" / "math_grpo_smollm2_tools.yaml"
SFT_CONFIG = ROOT / "configs" / "math_sft_tools_smollm2.yaml"
MODEL = "smollm2-135m-instruct"
KINDS = ("addition", "mix")
SECTIONS = ("learning", "vs_trl", "rollout", "actor", "tools")
SMOKE = {"steps": 1, "trl_steps": 2, "eval_size": 4, "rounds": 1, "seeds": "0", "kinds": "addition"}
#: the smoke run's batch: 2 prompts x 2 samples of up to 16 tokens
SMOKE_FIT = ["--task.group_size=2", "--task.rollout_batch_size=4", "--task.sampling.max_new_tokens=16"]


def recipe(fit_args: list[str], path: Path = CONFIG) -> dict:
    """The recipe's settings that both sides of a comparison must share (the config at ``path``,
    then the ``--task.*`` / ``--policy.lr`` overrides among ``fit_args``)."""
    import yaml

    config = yaml.safe_load(path.read_text())
    task = config["task"]
    r = {
        "template": task["prompt_template"],
        "group": task["group_size"],
        "batch": task["rollout_batch_size"],
        "new_tokens": task["sampling"]["max_new_tokens"],
        "temperature": task["sampling"]["temperature"],
        "lr": config["policy"]["lr"],
        "precision": config["trainer"]["precision"],
        "micro_batch": task["train_micro_batch_size"],
        "tools": task.get("tools", []),
        "max_turns": task.get("max_turns", 1),
    }
    keys = {
        "--task.group_size": "group",
        "--task.rollout_batch_size": "batch",
        "--policy.lr": "lr",
        "--task.sampling.max_new_tokens": "new_tokens",
        "--task.sampling.temperature": "temperature",
        "--trainer.precision": "precision",
        "--task.train_micro_batch_size": "micro_batch",
    }
    for arg in fit_args:
        key, _, value = arg.partition("=")
        if key in keys:
            kind = {"lr": float, "temperature": float, "precision": str}.get(keys[key], int)
            r[keys[key]] = kind(value)
    return r


def assets(kinds: list[str]) -> tuple[Path, dict[str, dict[str, Path]]]:
    """The model directory and each kind's splits, made where absent (as `rlinf prepare` does)."""
    from rlinf_lightning.cli import TRACES, WORD_SPLIT
    from rlinf_lightning.pretrained import prepare_pretrained
    from rlinf_lightning.tasks.data import arithmetic_splits_on_disk
    from rlinf_lightning.tasks.tool_traces import word_traces
    from rlinf_lightning.tasks.word_problems import make_word_problem_splits

    model = prepare_pretrained(MODEL, ROOT / "artifacts" / MODEL)
    data = {}
    for kind in kinds:
        out = ROOT / "data" / "words" / kind
        data[kind] = arithmetic_splits_on_disk(out, kind=kind, **WORD_SPLIT) or make_word_problem_splits(
            out, kind=kind, **WORD_SPLIT
        )
        if kind == "products":  # the calculator recipe's warm-start traces
            held = [data[kind]["validation"], data[kind]["test"]]
            data[kind]["traces"] = (
                out / TRACES if (out / TRACES).is_file() else word_traces(held, out / TRACES)
            )
    return model, data


def last_int(text: str) -> str | None:
    found = re.findall(r"-?\d+", text.replace(",", ""))
    return str(int(found[-1])) if found else None


def anchored(text: str) -> str | None:
    found = re.findall(r"answer is:?\s*\$?\s*(-?[\d,]+)", text, flags=re.IGNORECASE)
    return str(int(found[-1].replace(",", ""))) if found else None


def held_out(model_dir: Path, weights: Path | None, test: Path, n: int, r: dict) -> dict:
    """Greedy accuracy on the first ``n`` test problems, by the reward, the last integer and the
    anchored answer, with ``weights`` (a ``model.safetensors``; ``None``: the model's own)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from rlinf_lightning.engines.rollout import HFRolloutEngine, SamplingParams
    from rlinf_lightning.engines.sampling import end_token_ids
    from rlinf_lightning.prompts import PromptFormat
    from rlinf_lightning.rewards import RewardInput, load_reward, score
    from rlinf_lightning.tasks.data import load_problems

    torch.manual_seed(0)
    problems = load_problems(test)[:n]
    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = HFRolloutEngine(str(model_dir))
    if weights is not None:
        engine.update_weights(load_file(str(weights)).items())
    ids = PromptFormat(r["template"]).encode(tok, [p.prompt for p in problems])
    params = SamplingParams(temperature=0.0, max_new_tokens=r["new_tokens"])
    texts = []
    for i in range(0, len(ids), 64):
        chunk = ids[i : i + 64]
        outs = engine.generate(chunk, list(range(i, i + len(chunk))), 1, params, 0, end_token_ids(tok))
        texts += [tok.decode(o[0].token_ids, skip_special_tokens=True) for o in outs]
    answers = [p.answer for p in problems]
    judge = load_reward("math_verify")
    judge.setup()
    by_reward = score(judge, RewardInput(texts, answers, [p.prompt for p in problems])).tolist()
    mean = lambda xs: round(sum(xs) / len(xs), 4)  # noqa: E731
    return {
        "reward": mean([float(s > 0.5) for s in by_reward]),
        "last_int": mean([float(last_int(t) == a) for t, a in zip(texts, answers)]),
        "anchored": mean([float(anchored(t) == a) for t, a in zip(texts, answers)]),
        "problems": len(problems),
        "example": texts[0][:200],
    }


# --- children: each fit in its own process -------------------------------------------------------


def run_ours(
    model: str,
    train: str,
    test: str,
    steps: int,
    seed: int,
    out: str,
    fit_args: list[str],
    config: str = str(CONFIG),
) -> dict:
    """The recipe (``config``) through `rlinf fit`'s own parser (so the config is read exactly as
    the CLI reads it), with a callback stamping each iteration's end."""
    from rlinf_lightning.cli import algorithm_names_as_classes, build_parser, subcommand_parser
    from rlinf_lightning.engines.precision import resolve_precision

    clock = StepClock()
    argv = ["fit", f"--config={config}", f"--policy.model_path={model}", f"--task.train_path={train}",
            f"--task.test_path={test}", f"--trainer.default_root_dir={out}", f"--trainer.seed={seed}",
            f"--trainer.max_iterations={steps}", "--trainer.eval_every=0", "--task.eval_size=1",
            "--trainer.ckpt_every=0", "--trainer.logger=false", "--trainer.enable_progress_bar=false",
            *fit_args]  # fmt: skip
    parser = build_parser()
    init = subcommand_parser(parser, "fit").instantiate(
        parser.parse_args(algorithm_names_as_classes(argv))["fit"]
    )
    init.trainer.callbacks.append(clock.ours())
    t0 = time.perf_counter()
    summary = init.trainer.fit(init.policy, init.task)
    wall = time.perf_counter() - t0
    mean = clock.steady_mean
    last = (Path(out) / "checkpoints" / "last").read_text().strip()
    return {
        "s_per_step": clock.s_per_step(wall),
        "fit_wall_s": wall,
        "train_wall_s": summary["train_wall_s"],
        "precision": resolve_precision(init.trainer.precision, "cpu"),
        "rollout_s": mean("time/rollout"),
        "actor_s": mean("time/actor"),
        "train_reward": [round(m.get("reward/accuracy", 0.0), 3) for m in clock.metrics],
        "response_tokens_per_step": mean("rollout/response_tokens_total"),
        "weights": str(Path(out) / "checkpoints" / last / "model.safetensors"),
    }


def run_trl(model: str, train: str, steps: int, seed: int, out: str, r: dict, threads: int) -> dict:
    """TRL's ``GRPOTrainer`` on the recipe's chat prompts (conversational: TRL applies the chat
    template), at its defaults but for what must match ours."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from rlinf_lightning.prompts import PromptFormat
    from rlinf_lightning.rewards import RewardInput, load_reward, score
    from rlinf_lightning.tasks.data import load_problems

    if threads:
        torch.set_num_threads(threads)
    fmt = PromptFormat(r["template"])
    prompts_per_step = r["batch"] // r["group"]
    problems = load_problems(train)[: prompts_per_step * (steps + 1)]
    data = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": fmt.text(p.prompt)}], "answer": p.answer} for p in problems]
    )
    judge = load_reward("math_verify")
    judge.setup()
    clock = StepClock()
    rewards: list[float] = []

    def reward(completions, answer, **kw):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        scores = score(judge, RewardInput(texts, list(answer))).tolist()
        rewards.append(sum(scores) / len(scores))
        return scores

    config = GRPOConfig(
        output_dir=out, num_generations=r["group"], per_device_train_batch_size=r["batch"],
        max_completion_length=r["new_tokens"], temperature=r["temperature"], learning_rate=r["lr"],
        lr_scheduler_type="constant", max_steps=steps, logging_steps=10**9, save_strategy="no",
        report_to="none", use_cpu=not torch.cuda.is_available(), seed=seed,
    )  # fmt: skip
    tok = AutoTokenizer.from_pretrained(model)
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model),
        reward_funcs=reward,
        args=config,
        train_dataset=data,
        processing_class=tok,
        callbacks=[clock.trl()],
    )
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    trainer.save_model(str(Path(out) / "final"))
    return {
        "s_per_step": clock.s_per_step(wall),
        "train_s": wall,
        "bf16": bool(config.bf16),
        "train_reward": [round(x, 3) for x in rewards],
        "weights": str(Path(out) / "final" / "model.safetensors"),
    }


def child(spec: str) -> None:
    spec = json.loads(spec)
    fn = {"ours": run_ours, "trl": run_trl}[spec.pop("kind")]
    print("RESULT " + json.dumps(fn(**spec)), flush=True)


def spawn(kind: str, **spec) -> dict:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled"}
    cmd = [sys.executable, __file__, "--child", json.dumps({"kind": kind, **spec})]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{kind} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    result = json.loads(lines[-1][7:])
    print(
        f"[{kind} seed {spec.get('seed')} {Path(spec['train']).parent.name}] {json.dumps(result)}", flush=True
    )
    return result


# --- sections -------------------------------------------------------------------------------------


def learning(model, data, kinds, seeds, steps, n, r, fit_args, work) -> dict:
    out: dict = {}
    for kind in kinds:
        train, test = str(data[kind]["train"]), data[kind]["test"]
        before = held_out(model, None, test, n, r)
        print(f"[{kind} before] {json.dumps(before)}", flush=True)
        runs = {}
        for seed in seeds:
            fit = spawn("ours", model=str(model), train=train, test=str(test), steps=steps, seed=seed,
                        out=str(work / f"{kind}-{seed}"), fit_args=fit_args)  # fmt: skip
            after = held_out(model, Path(fit["weights"]), test, n, r)
            print(f"[{kind} seed {seed} after] {json.dumps(after)}", flush=True)
            runs[f"seed{seed}"] = {"after": after, "fit_wall_s": round(fit["fit_wall_s"], 1),
                                   "s_per_step": round(fit["s_per_step"], 2), "precision": fit["precision"],
                                   "train_reward": fit["train_reward"]}  # fmt: skip
        worst = {j: min(run["after"][j] for run in runs.values()) for j in ("reward", "last_int")}
        out[kind] = {"steps": steps, "before": before, **runs, "worst_after": worst,
                     "worst_gain": {j: round(worst[j] - before[j], 4) for j in worst},
                     "within_30_min": all(run["fit_wall_s"] <= 1800 for run in runs.values())}  # fmt: skip
    return out


def vs_trl(model, data, steps, seed, n, r, fit_args, work, threads) -> dict:
    train, test = str(data["addition"]["train"]), data["addition"]["test"]
    trl = spawn("trl", model=str(model), train=train, steps=steps, seed=seed, out=str(work / "trl"), r=r,
                threads=threads)  # fmt: skip
    ours = spawn("ours", model=str(model), train=train, test=str(test), steps=steps, seed=seed,
                 out=str(work / "ours-vs-trl"), fit_args=fit_args)  # fmt: skip
    acc = {
        side: held_out(model, Path(res["weights"]), test, n, r)
        for side, res in (("trl", trl), ("ours", ours))
    }
    return {
        "steps": steps,
        "settings": r,
        "trl": {"s_per_step": round(trl["s_per_step"], 2), "bf16": trl["bf16"], "accuracy": acc["trl"],
                "train_reward": trl["train_reward"]},
        "ours": {"s_per_step": round(ours["s_per_step"], 2), "precision": ours["precision"],
                 "rollout_s": round(ours["rollout_s"], 2), "actor_s": round(ours["actor_s"], 2),
                 "accuracy": acc["ours"], "train_reward": ours["train_reward"]},
        "ours_over_trl": round(trl["s_per_step"] / ours["s_per_step"], 3),
        "accuracy_ours_minus_trl": round(acc["ours"]["reward"] - acc["trl"]["reward"], 4),
    }  # fmt: skip


def rollout(model, data, rounds, r) -> dict:
    """Our HF engine against ``model.generate``: completion tokens per second, same prompts,
    batch (``r["batch"]`` completions: the recipe's prompts x group) and length."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlinf_lightning.engines.rollout import HFRolloutEngine, SamplingParams
    from rlinf_lightning.engines.sampling import end_token_ids
    from rlinf_lightning.prompts import PromptFormat
    from rlinf_lightning.tasks.data import load_problems

    tok = AutoTokenizer.from_pretrained(model)
    per = r["batch"] // r["group"]
    problems = [p.prompt for p in load_problems(data["addition"]["train"])[:per]]
    ids = PromptFormat(r["template"]).encode(tok, problems)
    ends = end_token_ids(tok)
    engine = HFRolloutEngine(str(model), dtype="bfloat16")
    params = SamplingParams(temperature=r["temperature"], max_new_tokens=r["new_tokens"])

    def ours(i: int) -> tuple[int, float]:
        t = time.perf_counter()
        outs = engine.generate(ids, list(range(per)), r["group"], params, i, ends)
        return sum(len(c.token_ids) for cs in outs for c in cs), time.perf_counter() - t

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval()
    tok.padding_side = "left"
    rows = [i for i in ids for _ in range(r["group"])]
    width = max(map(len, rows))
    input_ids = torch.tensor([[tok.pad_token_id] * (width - len(i)) + i for i in rows])
    mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in rows])

    def plain(i: int) -> tuple[int, float]:
        torch.manual_seed(i)
        t = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(input_ids=input_ids, attention_mask=mask, do_sample=True, top_k=0, top_p=1.0,
                              temperature=r["temperature"], max_new_tokens=r["new_tokens"],
                              eos_token_id=ends, pad_token_id=tok.pad_token_id)  # fmt: skip
        dt = time.perf_counter() - t
        new = out[:, width:]
        ended = torch.isin(new, torch.tensor(ends))
        # tokens up to and including the first end token, as ours counts them
        lengths = torch.where(ended.any(1), ended.int().argmax(1) + 1, torch.full((len(rows),), new.shape[1]))
        return int(lengths.sum()), dt

    rates = {}
    for name, fn in (("ours", ours), ("generate", plain)):
        fn(0)  # warm-up
        runs = [fn(i + 1) for i in range(rounds)]
        rates[name] = statistics.median(tokens / s for tokens, s in runs)
    return {
        "completions": len(rows),
        "new_tokens": r["new_tokens"],
        "dtype": "bfloat16",
        "ours_tokens_per_s": round(rates["ours"], 1),
        "generate_tokens_per_s": round(rates["generate"], 1),
        "ours_over_generate": round(rates["ours"] / rates["generate"], 3),
    }


def warm_start(products: dict[str, Path], smoke: bool, work: Path) -> Path:
    """The calculator recipe's warm start, as `rlinf sft --config configs/math_sft_tools_smollm2.yaml`
    makes it (cached there); the smoke run's is 2 steps, in ``work``."""
    import yaml

    from rlinf_lightning.sft import run_sft

    sft = yaml.safe_load(SFT_CONFIG.read_text())
    sft.update(base_model=str(ROOT / sft["base_model"]), train_path=str(products["traces"]),
               test_path=str(products["test"]), output_dir=str(ROOT / sft["output_dir"]))  # fmt: skip
    if smoke:
        sft.update(steps=2, eval_size=2, output_dir=str(work / "sft-tools"))
    run_sft(**sft)
    return Path(sft["output_dir"])


def held_out_tools(model_dir: Path, weights: Path | None, test: Path, n: int, r: dict) -> dict:
    """Greedy accuracy with the recipe's tools on the first ``n`` test problems (the final turn
    judged by the reward), and the share of samples that called a tool."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from rlinf_lightning.engines.rollout import HFRolloutEngine, SamplingParams
    from rlinf_lightning.prompts import PromptFormat
    from rlinf_lightning.tasks.data import load_problems
    from rlinf_lightning.tools.loop import TurnLoop, default_budget, environment_factory

    problems = load_problems(test)[:n]
    engine = HFRolloutEngine(str(model_dir))
    if weights is not None:
        engine.update_weights(load_file(str(weights)).items())
    budget = default_budget(r["max_turns"], r["new_tokens"])
    loop = TurnLoop(environment_factory(None, r["tools"]), r["max_turns"], budget)
    accuracy, calling = loop.evaluate(
        engine, AutoTokenizer.from_pretrained(model_dir), PromptFormat(r["template"]),
        [p.prompt for p in problems], [p.answer for p in problems], "math_verify",
        SamplingParams(max_new_tokens=r["new_tokens"]),
    )  # fmt: skip
    return {"reward": round(accuracy, 4), "calling": round(calling, 4), "problems": len(problems)}


def tools(model, data, steps, seed, n, fit_args, work, smoke) -> dict:
    """The calculator recipe (warm start, then ``steps`` GRPO iterations with the calculator)
    against the model without tools (the addition recipe's config on the same products, the same
    iterations), on the held-out products. Bar: >= +0.30 by the reward."""
    products = data["products"]
    train, test = str(products["train"]), products["test"]
    warm = warm_start(products, smoke, work)
    with_tools = spawn("ours", model=str(warm), train=train, test=str(test), steps=steps, seed=seed,
                       out=str(work / "tools"), fit_args=fit_args, config=str(TOOLS_CONFIG))  # fmt: skip
    without = spawn("ours", model=str(model), train=train, test=str(test), steps=steps, seed=seed,
                    out=str(work / "no-tools"), fit_args=fit_args)  # fmt: skip
    r_tools = recipe(fit_args, TOOLS_CONFIG)
    after = held_out_tools(warm, Path(with_tools["weights"]), test, n, r_tools)
    plain = held_out(model, Path(without["weights"]), test, n, recipe(fit_args))
    return {
        "steps": steps,
        "warm_start": held_out_tools(warm, None, test, n, r_tools),
        "with_tools": {**after, "s_per_step": round(with_tools["s_per_step"], 2),
                       "fit_wall_s": round(with_tools["fit_wall_s"], 1)},
        "without_tools": {**plain, "s_per_step": round(without["s_per_step"], 2),
                          "fit_wall_s": round(without["fit_wall_s"], 1)},
        "gain_by_reward": round(after["reward"] - plain["reward"], 4),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--steps", type=int, default=60, help="GRPO iterations of each learning run")
    ap.add_argument("--trl-steps", type=int, default=10, help="steps of each side of the TRL comparison")
    ap.add_argument("--eval-size", type=int, default=200, help="held-out problems judged")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds of the rollout and actor sections")
    ap.add_argument("--threads", type=int, default=0, help="torch threads of every side (0: their default)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"some of {','.join(SECTIONS)}")
    ap.add_argument("--fit-args", default="", help="more `rlinf fit` overrides for our side, quoted")
    ap.add_argument("--smoke", action="store_true", help="a tiny budget: does every path run")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    sections, kinds = args.sections.split(","), args.kinds.split(",")
    if unknown := (set(sections) - set(SECTIONS)) | (set(kinds) - set(KINDS)):
        sys.exit(f"unknown section or kind: {', '.join(sorted(unknown))}; sections {SECTIONS}, kinds {KINDS}")
    seeds = [int(s) for s in args.seeds.split(",")]
    fit_args = (SMOKE_FIT if args.smoke else []) + shlex.split(args.fit_args)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
        fit_args.append(f"--trainer.num_threads={args.threads}")
    r = recipe(fit_args)
    model, data = assets(sorted(set(kinds) | {"addition"} | ({"products"} if "tools" in sections else set())))
    result: dict = {
        "model": MODEL,
        "smoke": args.smoke,
        "fit_args": fit_args,
        "threads": args.threads or os.cpu_count(),
        "load_start": os.getloadavg()[0],
    }
    # each fit's checkpoint (weights and optimizer state, ~1.7 GB) is gone when the run ends
    with tempfile.TemporaryDirectory(prefix="real_model-") as tmp:
        work = Path(tmp)
        if "learning" in sections:
            result["learning"] = learning(
                model, data, kinds, seeds, args.steps, args.eval_size, r, fit_args, work
            )
        if "vs_trl" in sections:
            result["vs_trl"] = vs_trl(
                model, data, args.trl_steps, seeds[0], args.eval_size, r, fit_args, work, args.threads
            )
        if "rollout" in sections:
            result["rollout"] = rollout(model, data, args.rounds, r)
        if "tools" in sections:
            result["tools"] = tools(
                model, data, args.steps, seeds[0], args.eval_size, fit_args, work, args.smoke
            )
    if "actor" in sections:
        from actor_vs_hf import actor_vs_hf

        result["actor"] = actor_vs_hf(
            str(model), r["batch"], r["new_tokens"], r["lr"], r["micro_batch"], r["precision"], args.rounds
        )
    result["load_end"] = os.getloadavg()[0]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
