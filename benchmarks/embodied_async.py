"""Learning under bounded staleness: PPO on FetchReach (``configs/embodied_ppo_fetchreach.yaml``)
with ``trainer.max_staleness`` k, with and without an off-policy correction.

    python benchmarks/embodied_async.py [--max-staleness 2] [--corrections decoupled none] [--seed 0]

Each correction runs ``rlinf fit`` on the config in a fresh process, nothing changed but
``trainer.max_staleness``, ``trainer.algorithm.init_args.off_policy_correction`` and the run
directory: every rollout samples with weights k versions older than the synchronous flow's (the
lag is a schedule, not a race, so the figures do not depend on the plan or the machine's load).
Per correction: held-out success before and after (``summary.json``), the success at each
evaluation, and the fit's wall time.

The bar (issue 25): k = 2 with the decoupled loss reaches >= 0.9 success. Last line: JSON with
each run's figures and ``passed``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "embodied_ppo_fetchreach.yaml"
BAR = 0.9


def run(correction: str, k: int, seed: int, root: Path) -> dict:
    """One fit; its summary's figures."""
    run_dir = root / f"{correction}-k{k}-seed{seed}"
    cmd = [
        sys.executable, "-m", "rlinf_lightning.cli", "fit", f"--config={CONFIG}",
        f"--trainer.max_staleness={k}", f"--trainer.seed={seed}",
        f"--trainer.algorithm.init_args.off_policy_correction={correction}",
        f"--trainer.default_root_dir={run_dir}", "--trainer.enable_progress_bar=false",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    subprocess.run(cmd, check=True, env=env, cwd=ROOT)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "success_before": summary["success_before"],
        "success_after": summary["success_after"],
        "success_by_iteration": {h["iteration"]: h["success"] for h in summary["eval_history"]},
        "wall_s": round(summary["wall_s"], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--corrections", nargs="+", default=["decoupled", "none"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rlinf-async-") as tmp:
        runs = {c: run(c, args.max_staleness, args.seed, Path(tmp)) for c in args.corrections}
    for name, r in runs.items():
        before, after = r["success_before"], r["success_after"]
        print(f"{name:>12}: success {before:.2f} -> {after:.2f} in {r['wall_s']:.0f} s")
    decoupled = runs.get("decoupled")
    passed = decoupled is not None and decoupled["success_after"] >= BAR
    print(json.dumps({"max_staleness": args.max_staleness, "seed": args.seed, "runs": runs, "bar": BAR,
                      "passed": passed}))  # fmt: skip


if __name__ == "__main__":
    main()
