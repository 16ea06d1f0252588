"""Multi-turn RL with a calculator: the tiny model learns to delegate what it cannot compute.

    python benchmarks/tools.py [--seeds 0 1] [--iterations 30] [--sft-steps 700]

The task: products of two numbers up to 999 (``What is 123*456?=``), which the 0.4 M-parameter
tiny Qwen2 cannot compute by itself; the twin-free held-out split (no operand multiset of a test
problem in train) of ``tasks.data.make_arithmetic_splits``. The warm start (``rlinf sft`` with
``tools: [calculator]``) imitates ``--sft-steps`` steps of tool-use traces of *easier* problems
(products of numbers up to 99, products of a number from 100 to 999 and a digit, either side, and
sums and differences of numbers up to 999 and of numbers up to 999999, none sharing its operands
with a held-out problem; without the second kind every three-digit call it saw was a sum or a
difference, and it wrote ``+`` or ``-`` for the products; without the last, no result it copied
had more than four digits, and it cut the products' five- and six-digit results to four):
``<calc>12*7</calc>`` then the calculator's reply ``<res>84</res>`` (masked out of the loss) then
``84``; 200 traces of each kind. It teaches the call format and copying, not the task: no
product of two three-digit operands is shown, and calling on one and copying its result right is
left to GRPO (the warm start is right on a few per cent of held-out problems).

Per seed, from the same warm start and on the same budget (``--iterations`` of ``--prompts`` x 8
samples, the same learning rate): GRPO with the calculator (``task.tools: [calculator]``, two turns
of at most 24 tokens) and GRPO without tools (single turn, 24 tokens). Measured: greedy held-out
accuracy of the warm start, of each run's curve (``--eval-every``) and at its end, and the share of
held-out samples that call the tool before and after.

Bars (issue 41): with tools after GRPO >= 0.3 above no tools, >= 0.2 above its warm start, and the
warm start < 0.5. The last line is one JSON object with every figure per seed and ``bars_met``.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from pathlib import Path

from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
EASY_MAX = 99
TRACES = 200  # of each kind
TURN_TOKENS, TURNS = 24, 2


def make_data(root: Path) -> dict[str, Path]:
    """The hard task's splits, and warm-start problems (easier products) sharing no operand
    multiset with a held-out hard problem."""
    from rlinf_lightning.tasks.data import (
        Problem,
        generate_arithmetic,
        load_problems,
        make_arithmetic_splits,
        operand_multiset,
        write_jsonl,
    )

    hard = make_arithmetic_splits(
        root / "hard", n_train=5000, n_validation=100, n_test=200, max_value=999, ops="*", seed=0
    )
    held_out = {operand_multiset(p.prompt) for s in ("test", "validation") for p in load_problems(hard[s])}
    rng = random.Random(3)
    pairs = [(rng.randint(100, 999), rng.randint(0, 9)) for _ in range(TRACES)]
    by_digit = [  # the operator after a three-digit operand, either side; short results
        Problem(f"What is {x}*{y}?=" if i % 2 else f"What is {y}*{x}?=", str(x * y))
        for i, (x, y) in enumerate(pairs)
    ]
    easy = [
        *generate_arithmetic(TRACES, max_value=EASY_MAX, ops="*", seed=1),  # the operator, short
        *by_digit,
        *generate_arithmetic(TRACES, max_value=999, ops="+-", seed=2),  # long operands, either operator
        *generate_arithmetic(TRACES, max_value=999999, ops="+-", seed=4),  # long copies: 5-6 digit results
    ]
    traces = [p for p in easy if operand_multiset(p.prompt) not in held_out]
    return {**hard, "warm_start": write_jsonl(traces, root / "warm_start.jsonl")}


def evaluate(model: Path, weights: Path | None, test: Path, size: int) -> tuple[float, float]:
    """Greedy held-out ``(accuracy, share calling the tool)`` with the calculator."""
    from rlinf_lightning.engines.rollout import HFRolloutEngine, SamplingParams
    from rlinf_lightning.policies.lm import LMPolicy
    from rlinf_lightning.prompts import RAW
    from rlinf_lightning.tasks.data import load_problems
    from rlinf_lightning.tools import TurnLoop, environment_factory

    engine = HFRolloutEngine(str(model))
    if weights is not None:
        engine.update_weights(load_file(str(weights)).items())
    problems = load_problems(test)[:size]
    loop = TurnLoop(environment_factory(None, ["calculator"]), TURNS, TURNS * TURN_TOKENS)
    tokenizer = LMPolicy(str(model)).load_tokenizer()
    return loop.evaluate(
        engine, tokenizer, RAW, [p.prompt for p in problems], [p.answer for p in problems],
        "math_verify", SamplingParams(max_new_tokens=TURN_TOKENS),
    )  # fmt: skip


def grpo(model: Path, data: dict, run: Path, seed: int, args, tools: bool) -> dict:
    """GRPO from ``model``: its eval curve, and the final weights' accuracy and calling share."""
    from rlinf_lightning import LMPolicy, RLTrainer
    from rlinf_lightning.engines.rollout import SamplingParams
    from rlinf_lightning.tasks import MathTask

    task = MathTask(
        str(data["train"]), str(data["test"]), reward="math_verify", eval_size=args.eval_size,
        group_size=8, rollout_batch_size=8 * args.prompts, train_micro_batch_size=64,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=TURN_TOKENS),
        tools=["calculator"] if tools else None, max_turns=TURNS,
    )  # fmt: skip
    trainer = RLTrainer(
        max_iterations=args.iterations, eval_every=args.eval_every, ckpt_every=args.iterations,
        default_root_dir=str(run), seed=seed, enable_progress_bar=False,
        strategy="collocated", num_threads=args.threads, timeout_s=1200, logger=True,
    )  # fmt: skip
    start = time.perf_counter()
    summary = trainer.fit(LMPolicy(str(model), lr=args.lr, max_grad_norm=1.0), task)
    weights = run / "checkpoints" / f"iter-{args.iterations:06d}" / "model.safetensors"
    accuracy, calling = evaluate(model, weights, data["test"], args.eval_size)
    return {
        "curve": [[h["iteration"], round(h["accuracy"], 4)] for h in summary["eval_history"]],
        "accuracy_after": accuracy,  # with the calculator; without tools the run's own eval is single-turn
        "run_accuracy_after": summary["eval_accuracy_after"],
        "calling_share_after": calling,
        "wall_s": round(time.perf_counter() - start, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--sft-steps", type=int, default=700)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per iteration (8 samples each)")
    parser.add_argument("--eval-size", type=int, default=100)
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
            batch_size=32, seed=seed, eval_size=args.eval_size, num_threads=args.threads,
            tools=["calculator"], max_turns=TURNS, max_new_tokens=TURN_TOKENS,
        )  # fmt: skip
        with_tools = grpo(out / "sft", data, out / "grpo_tools", seed, args, tools=True)
        without = grpo(out / "sft", data, out / "grpo_no_tools", seed, args, tools=False)
        start = sft["eval_accuracy"]
        results[seed] = {
            "sft_start": start,
            "calling_share_before": sft["eval_calling_share"],
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
