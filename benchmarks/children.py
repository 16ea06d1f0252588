"""What the side-by-side benchmarks share: the math recipe's assets, and running one candidate in
a fresh child process (same start-up for every candidate) that prints its result as JSON last."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def recipe_assets(work: Path) -> dict[str, str]:
    """The math recipe's warm-started model and data (reused from `rlinf sft` when present)."""
    from rlinf_lightning.assets import is_model_dir
    from rlinf_lightning.testing import build_warm_started

    sft, data = ROOT / "artifacts" / "tiny-qwen2-sft", ROOT / "data" / "arithmetic"
    if is_model_dir(sft) and (data / "train.jsonl").is_file():
        return {"model": str(sft), "train": str(data / "train.jsonl"), "test": str(data / "test.jsonl")}
    a = build_warm_started(
        work, n_train=20000, n_test=500, steps=300, batch_size=64, eval_size=500, num_threads=2
    )
    return {"model": str(a["sft"]), "train": str(a["train"]), "test": str(a["test"])}


def run_child(script: str, spec: dict, label: str, env: dict[str, str] | None = None) -> list[str]:
    """Run ``script --child <spec>``; its stdout lines (the last one is its JSON result)."""
    out = subprocess.run(
        [sys.executable, script, "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )
    if out.returncode:
        raise RuntimeError(f"{label} failed:\n{out.stderr[-4000:]}")
    return out.stdout.strip().splitlines()


def parse_args(ap: argparse.ArgumentParser, run_one: Callable[[dict], dict]) -> argparse.Namespace | None:
    """The benchmark's arguments, or ``None`` when this process is a child (``--child <spec>``, as
    :func:`run_child` starts it): then ``run_one(spec)`` has run and its result is printed as JSON."""
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_one(json.loads(args.child))))
        return None
    return args


def placement_of(plan) -> str:
    """``one worker[n slots]``, ``collocated``, or the groups in the hybrid placement syntax."""
    from rlinf_lightning.flow.plan import format_slots

    if len(plan.groups) == 1:
        g = plan.groups[0]
        return f"one worker[{len(g.slots)} slots]" if g.replicas == 1 else "collocated"
    return ", ".join(f"{','.join(g.stages)}: {format_slots(g.slots)}" for g in plan.groups)
