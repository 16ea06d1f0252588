"""Soak: 2 000 iterations of the tiny workload on the ``processes`` launcher (a disaggregated plan:
two worker processes and the driver). Every 50 iterations the resident memory of each process is
sampled; after warm-up none may grow by more than 5%. Slow (minutes): ``bash scripts/test.sh -m slow``.
The figures are printed (run with ``-s``) and quoted in the README."""

from __future__ import annotations

import json

import psutil
import pytest

from rlinf_lightning import Callback, LMPolicy, RLTrainer
from trainer_defaults import tiny_task, tiny_trainer_kwargs, worker_processes

ITERATIONS, EVERY, WARMUP = 2000, 50, 500


class RSSSampler(Callback):
    """Resident set size (MiB) of the driver and each worker process every ``EVERY`` iterations."""

    def __init__(self) -> None:
        self.samples: dict[int, dict[str, float]] = {}

    def on_iteration_end(self, trainer, iteration, metrics) -> None:
        if iteration % EVERY:
            return
        me = psutil.Process()
        workers = worker_processes(me)
        procs = {"driver": me} | {f"worker pid {p.pid}": p for p in workers}
        self.samples[iteration] = {n: p.memory_info().rss / 2**20 for n, p in procs.items()}


@pytest.mark.slow
def test_no_process_grows_over_2000_iterations(assets, tmp_path):
    sampler = RSSSampler()
    trainer = RLTrainer(
        **tiny_trainer_kwargs(
            tmp_path, max_iterations=ITERATIONS, launcher="processes", strategy="disaggregated", devices=2,
            callbacks=[sampler], timeout_s=120,
        )
    )  # fmt: skip
    trainer.fit(
        LMPolicy(str(assets["sft"]), lr=1e-5),
        tiny_task(assets, eval_size=8),
    )
    after = {it: s for it, s in sampler.samples.items() if it >= WARMUP}
    base, last = after[WARMUP], after[ITERATIONS]
    growth = {n: max(s[n] for s in after.values()) / base[n] - 1 for n in base}
    print(json.dumps({"rss_mib_at_warmup": base, "rss_mib_at_end": last, "max_growth": growth}))
    assert len(base) == 3, base  # the driver and two workers
    assert max(growth.values()) <= 0.05, growth
