"""Learning under bounded staleness: PPO on FetchReach (``configs/embodied_ppo_fetchreach.yaml``)
with ``trainer.max_staleness`` k, with and without an off-policy correction.

    python benchmarks/embodied_async.py [--max-staleness 2] [--corrections decoupled none]
                                        [--seeds 0 1] [--jobs 2] [--iterations 200]

Per seed, the synchronous run (k = 0, ``sync``) and each correction at k run ``rlinf fit`` on the
config in a fresh process (``--jobs`` of them at once, the cores split between them), nothing
changed but ``trainer.max_staleness``, ``trainer.algorithm.init_args.off_policy_correction`` and the run
directory: every rollout samples with weights k versions older than the synchronous flow's (the
lag is a schedule, not a race, so the figures do not depend on the plan or the machine's load).
Per correction: held-out success before and after (``summary.json``), the success at each
evaluation, and the fit's wall time.

The bar (issue 25): k = 2 with the decoupled loss reaches >= 0.9 success (``passed``: on every
seed). Last line: JSON with each run's figures and ``success_after`` per case and seed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "embodied_ppo_fetchreach.yaml"
BAR = 0.9


def run(correction: str, k: int, seed: int, root: Path, threads: int, iterations: int | None) -> dict:
    """One fit; its summary's figures."""
    run_dir = root / f"{correction}-k{k}-seed{seed}"
    longer = [] if iterations is None else [f"--trainer.max_iterations={iterations}"]
    cmd = [
        sys.executable, "-m", "rlinf_lightning.cli", "fit", f"--config={CONFIG}", *longer,
        f"--trainer.max_staleness={k}", f"--trainer.seed={seed}", f"--trainer.num_threads={threads}",
        f"--trainer.algorithm.init_args.off_policy_correction={correction}",
        f"--trainer.default_root_dir={run_dir}", "--trainer.enable_progress_bar=false",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
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
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--jobs", type=int, default=1, help="fits at once (each on cores // jobs threads)")
    parser.add_argument("--iterations", type=int, help="every case's max_iterations (default: the config's)")
    args = parser.parse_args()
    cases = [("sync", "none", 0)] + [(c, c, args.max_staleness) for c in args.corrections]
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    with tempfile.TemporaryDirectory(prefix="rlinf-async-") as tmp, ThreadPoolExecutor(args.jobs) as pool:
        futures = {
            (name, seed): pool.submit(run, correction, k, seed, Path(tmp), threads, args.iterations)
            for name, correction, k in cases
            for seed in args.seeds
        }
        runs = {f"{name}-seed{seed}": f.result() for (name, seed), f in futures.items()}
    for name, r in runs.items():
        before, after = r["success_before"], r["success_after"]
        print(f"{name:>18}: success {before:.2f} -> {after:.2f} in {r['wall_s']:.0f} s")
    after = {
        name: [runs[f"{name}-seed{seed}"]["success_after"] for seed in args.seeds] for name, _, _ in cases
    }
    passed = "decoupled" in after and min(after["decoupled"]) >= BAR
    print(json.dumps({"max_staleness": args.max_staleness, "seeds": args.seeds, "iterations": args.iterations,
                      "success_after": after,
                      "runs": runs, "bar": BAR, "passed": passed}))  # fmt: skip


if __name__ == "__main__":
    main()
