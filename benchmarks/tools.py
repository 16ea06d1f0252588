"""Multi-turn RL with a calculator: the tiny model learns to delegate what it cannot compute.

    python benchmarks/tools.py [--seeds 0 1] [--iterations 30] [--sft-steps 700]

The task: products of two numbers up to 999 (``What is 123*456?=``), which the 0.4 M-parameter
tiny Qwen2 cannot compute by itself; the twin-free held-out split (no operand multiset of a test
problem in train) of ``tasks.data.make_arithmetic_splits``. The recipe is the one of
``configs/math_sft_tools_tiny.yaml`` and ``configs/math_grpo_tools_tiny.yaml`` (read from them;
the arguments override it). The warm start (``rlinf sft`` with ``tools: [calculator]``) imitates
``--sft-steps`` steps of tool-use traces of *easier* problems (``tasks/tool_traces.py``: 200 each of
products up to 99x99, of a three-digit number and a digit either side, of a three-digit number
and a number up to 99, and sums and differences up to 999 and up to 999999, none sharing its
operands with a held-out problem): ``<calc>12*7</calc>`` then the calculator's reply
``<res>84</res>`` (masked out of the loss) then ``84``. It teaches the call format and copying, not
the task: no product of two three-digit operands is shown.

Per seed, from the same warm start and on the same budget (``--iterations`` of ``--prompts`` x 8
samples, the same learning rate): GRPO with the calculator (``task.tools: [calculator]``, two turns
of at most 24 tokens) and GRPO without tools (single turn, 24 tokens). Measured: greedy held-out
accuracy of the warm start, of each run's curve (``--eval-every``) and at its end; the share of
held-out samples that call the tool, and that call it on the problem's expression copied right,
before and after; per ``--eval-every`` iterations, the sampled rollouts' accuracy, share of groups
with signal and calling share.

Bars (issue 41): with tools after GRPO >= 0.3 above no tools, >= 0.2 above its warm start, and the
warm start < 0.5. The last line is one JSON object with every figure per seed and ``bars_met``.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
from csv import DictReader
from pathlib import Path

import yaml
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
#: the recipe, shared with the configs a user runs (docs/tools.md)
SFT = yaml.safe_load((ROOT / "configs" / "math_sft_tools_tiny.yaml").read_text())
GRPO = yaml.safe_load((ROOT / "configs" / "math_grpo_tools_tiny.yaml").read_text())
TURN_TOKENS, TURNS = GRPO["task"]["sampling"]["max_new_tokens"], GRPO["task"]["max_turns"]
#: the hard task's splits: the docs' ``rlinf prepare`` command writes the same
HARD = {"n_train": 5000, "n_validation": 100, "n_test": 200, "max_value": 999, "ops": "*", "seed": 0}


def make_data(root: Path) -> dict[str, Path]:
    """The hard task's splits (as ``rlinf prepare`` writes them with :data:`HARD`), and the
    warm-start problems, none sharing its operand multiset with a held-out hard problem."""
    from rlinf_lightning.tasks.data import make_arithmetic_splits
    from rlinf_lightning.tasks.tool_traces import calculator_traces

    hard = make_arithmetic_splits(root / "hard", **HARD)
    return {
        **hard,
        "warm_start": calculator_traces([hard["validation"], hard["test"]], root / "warm_start.jsonl"),
    }


def evaluate(model: Path, weights: Path | None, test: Path, size: int) -> dict:
    """Greedy held-out figures with the calculator: ``accuracy``, ``calling`` (share of samples
    that call), ``exact_call`` (share whose call is the problem's expression, copied right) and
    ``result_copied`` (share whose answer is the calculator's reply, copied right)."""
    from rlinf_lightning.engines.rollout import HFRolloutEngine, SamplingParams
    from rlinf_lightning.policies.lm import LMPolicy
    from rlinf_lightning.prompts import RAW
    from rlinf_lightning.tasks.data import expression_of, load_problems
    from rlinf_lightning.tools import TurnLoop, environment_factory

    engine = HFRolloutEngine(str(model))
    if weights is not None:
        engine.update_weights(load_file(str(weights)).items())
    problems = load_problems(test)[:size]
    prompts, answers = [p.prompt for p in problems], [p.answer for p in problems]
    loop = TurnLoop(environment_factory(None, ["calculator"]), TURNS, TURNS * TURN_TOKENS)
    tokenizer = LMPolicy(str(model)).load_tokenizer()
    greedy = SamplingParams(max_new_tokens=TURN_TOKENS, temperature=0.0)
    accuracy, calling = loop.evaluate(engine, tokenizer, RAW, prompts, answers, "math_verify", greedy)
    _, outs = loop.generate(engine, tokenizer, RAW, prompts, list(range(len(prompts))), 1, greedy, 0)
    exact = copied = 0
    for problem, (completion,) in zip(problems, outs):
        text = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        call = re.match(r"<calc>(.*?)</calc><res>(.*?)</res>(.*)", text)
        exact += call is not None and call.group(1) == expression_of(problem.prompt)
        copied += call is not None and call.group(3).strip() == call.group(2)
    n = max(1, len(problems))
    return {"accuracy": accuracy, "calling": calling, "exact_call": exact / n, "result_copied": copied / n}


def run_stats(run: Path, every: int) -> dict[str, list[float]]:
    """Per block of ``every`` iterations, the means of the sampled rollouts' accuracy, the share of
    groups with signal (not all rewards equal) and, with tools, the share of samples calling."""
    (csv,) = run.glob("logs/version_*/metrics.csv")
    rows = [r for r in DictReader(csv.open()) if r.get("reward/accuracy")]
    keys = {"sampled_accuracy": "reward/accuracy", "groups_with_signal": "advantage/groups_with_signal",
            "calling_share": "rollout/tools/calling_share"}  # fmt: skip
    out = {}
    for name, key in keys.items():
        values = [float(r[key]) for r in rows if r.get(key)]
        if values:
            blocks = [values[i : i + every] for i in range(0, len(values), every)]
            out[name] = [round(sum(b) / len(b), 3) for b in blocks]
    return out


def grpo(model: Path, data: dict, run: Path, seed: int, args, tools: bool) -> dict:
    """GRPO from ``model``: its eval curve, and the final weights' accuracy and calling share."""
    from rlinf_lightning import LMPolicy, RLTrainer
    from rlinf_lightning.engines.rollout import SamplingParams
    from rlinf_lightning.tasks import MathTask

    cfg = GRPO["task"]
    multi_turn = {k: cfg[k] for k in ("tools", "max_turns", "max_response_tokens", "tool_timeout_s")}
    task = MathTask(
        str(data["train"]), str(data["test"]), reward=cfg["reward"], eval_size=args.eval_size,
        group_size=cfg["group_size"], rollout_batch_size=cfg["group_size"] * args.prompts,
        train_micro_batch_size=cfg["train_micro_batch_size"], sampling=SamplingParams(**cfg["sampling"]),
        **(multi_turn if tools else {}),
    )  # fmt: skip
    trainer = RLTrainer(
        max_iterations=args.iterations, eval_every=args.eval_every, ckpt_every=args.iterations,
        default_root_dir=str(run), seed=seed, enable_progress_bar=False, strategy="collocated",
        num_threads=args.threads, timeout_s=GRPO["trainer"]["timeout_s"], logger=True,
    )  # fmt: skip
    start = time.perf_counter()
    policy = LMPolicy(str(model), lr=args.lr, max_grad_norm=GRPO["policy"]["max_grad_norm"])
    summary = trainer.fit(policy, task)
    weights = run / "checkpoints" / f"iter-{args.iterations:06d}" / "model.safetensors"
    after = evaluate(model, weights, data["test"], args.eval_size)
    return {
        "curve": [[h["iteration"], round(h["accuracy"], 4)] for h in summary["eval_history"]],
        "accuracy_after": after["accuracy"],  # with the calculator (without tools: the run's own eval)
        "run_accuracy_after": summary["eval_accuracy_after"],
        "calling_share_after": after["calling"],
        "exact_call_after": after["exact_call"],
        "per_block": run_stats(run, args.eval_every),
        "wall_s": round(time.perf_counter() - start, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--iterations", type=int, default=GRPO["trainer"]["max_iterations"])
    parser.add_argument("--eval-every", type=int, default=GRPO["trainer"]["eval_every"])
    parser.add_argument("--sft-steps", type=int, default=SFT["steps"])
    parser.add_argument("--lr", type=float, default=GRPO["policy"]["lr"])
    prompts = GRPO["task"]["rollout_batch_size"] // GRPO["task"]["group_size"]
    parser.add_argument("--prompts", type=int, default=prompts, help="prompts per iteration (a group each)")
    parser.add_argument("--eval-size", type=int, default=GRPO["task"]["eval_size"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--root", type=Path, default=ROOT / "runs" / "bench_tools")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from rlinf_lightning.assets import build_tiny_qwen2, is_model_dir
    from rlinf_lightning.sft import run_sft

    args.root.mkdir(parents=True, exist_ok=True)
    base = args.root / "tiny-qwen2"
    if not is_model_dir(base):
        build_tiny_qwen2(base)
    data = make_data(args.root / "data")
    results = {}
    for seed in args.seeds:
        out = args.root / f"seed{seed}"
        sft = run_sft(
            str(base), str(data["warm_start"]), str(data["test"]), str(out / "sft"), steps=args.sft_steps,
            batch_size=SFT["batch_size"], lr=SFT["lr"], seed=seed, eval_size=args.eval_size,
            num_threads=args.threads, tools=SFT["tools"], max_turns=SFT["max_turns"],
            max_new_tokens=SFT["max_new_tokens"],
        )  # fmt: skip
        before = evaluate(out / "sft", None, data["test"], args.eval_size)
        with_tools = grpo(out / "sft", data, out / "grpo_tools", seed, args, tools=True)
        without = grpo(out / "sft", data, out / "grpo_no_tools", seed, args, tools=False)
        start = sft["eval_accuracy"]
        results[seed] = {
            "sft_start": start,
            "calling_share_before": sft["eval_calling_share"],
            "exact_call_before": before["exact_call"],
            "result_copied_before": before["result_copied"],
            "with_tools": with_tools,
            "without_tools": without,
            "gain_over_no_tools": with_tools["accuracy_after"] - without["run_accuracy_after"],
            "gain_over_start": with_tools["accuracy_after"] - start,
        }
        print(json.dumps({"seed": seed, **results[seed]}), flush=True)
    met = all(
        r["gain_over_no_tools"] >= 0.3 and r["gain_over_start"] >= 0.2 and r["sft_start"] < 0.5
        for r in results.values()
    )
    print(json.dumps({
        "benchmark": "tools", "task": "products up to 999x999, twin-free held-out",
        "iterations": args.iterations,
        "sft_steps": args.sft_steps, "lr": args.lr, "prompts": args.prompts, "eval_size": args.eval_size,
        "seeds": results,
        "bars": {"gain_over_no_tools": 0.3, "gain_over_start": 0.2, "sft_start_below": 0.5}, "bars_met": met,
    }))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
