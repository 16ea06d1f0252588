"""MFU's numerator: the model-FLOPs formula agrees with PyTorch's own count of the matmul FLOPs a
real forward and backward executes (on a batch without padding, where both count the same work)."""

from __future__ import annotations

import time

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from rlinf_lightning.assets import TinyModelConfig, build_tiny_qwen2
from rlinf_lightning.engines.flops import cpu_matmul_peak, peak_matmul_flops
from rlinf_lightning.policies.lm import causal_lm_train_flops


@pytest.mark.parametrize("seq", [16, 128])
def test_train_flops_formula_matches_counted_flops(tmp_path, seq):
    from transformers import AutoModelForCausalLM

    path = build_tiny_qwen2(tmp_path / "m", TinyModelConfig(max_position_embeddings=256))
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    ids = torch.randint(4, 100, (4, seq))
    mask = torch.ones_like(ids)
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, attention_mask=mask).logits.sum().backward()
    counted = counter.get_total_flops()
    # eager attention computes the full (non-causal) score matrix: count the masked half too
    layers, hidden = model.config.num_hidden_layers, model.config.hidden_size
    masked_half = 6.0 * layers * hidden * 4 * seq**2
    assert causal_lm_train_flops(model, mask) + masked_half == pytest.approx(counted, rel=0.05)


class FakeClock:
    """``perf_counter`` for ``engines.flops``: each timed product takes the next of ``runs``
    seconds (a product is timed between two reads), whatever the machine is doing."""

    def __init__(self, runs: list[float]) -> None:
        self.runs, self.now, self.reads = list(runs), 0.0, 0

    def perf_counter(self) -> float:
        if self.reads % 2:  # the read that ends a run
            self.now += self.runs.pop(0)
        self.reads += 1
        return self.now


def test_the_cpu_peak_is_the_best_of_three_runs_of_the_smallest_width_long_enough(monkeypatch):
    """On a fake clock: the first width's best run is under ``CPU_MIN_RUN_S``, so the next width is
    tried, whose best (not first, not mean) run reaches it: the peak is that width's FLOPs over
    that best run, and no wider product runs."""
    from rlinf_lightning.engines import flops

    short, enough = flops.CPU_MIN_RUN_S / 2, flops.CPU_MIN_RUN_S
    clock = FakeClock([short * 1.5, short, short * 1.2, enough * 2, enough, enough * 1.5])
    monkeypatch.setattr(flops, "time", clock)
    monkeypatch.setattr(flops, "CPU_WIDTHS", (8, 16, 32))  # small products: the clock decides
    n = 16
    assert flops.cpu_matmul_peak(torch.float32) == (n, pytest.approx(2.0 * n**3 / enough))
    assert clock.runs == [] and clock.reads == 12  # three runs of each of the two widths, no more
    clock.runs = [short] * 9  # never long enough: the widest is the peak
    assert flops.peak_matmul_flops.__wrapped__("cpu", torch.float32, 1) == pytest.approx(2.0 * 32**3 / short)


@pytest.fixture
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow  # a benchmark: two timings of real products, which need a core to themselves
def test_peak_matmul_flops_is_the_best_rate_of_that_matmul_timed_here(single_thread):
    """The peak is the FLOP/s a matmul of the same size reaches when timed independently here, its
    FLOPs counted by PyTorch. Rounds alternate and each side keeps its best; on one thread, since a
    product on two threads waits for both cores, which another process on the machine takes turns
    holding (two threads beside one busy process: one run in three missed by 2x, by chance)."""
    threads = torch.get_num_threads()
    n, _ = cpu_matmul_peak(torch.float32)
    a, b = torch.randn(n, n), torch.randn(n, n)
    with FlopCounterMode(display=False) as counter:
        a @ b
    peaks, best_s = [], float("inf")
    for _ in range(3):
        peaks.append(peak_matmul_flops.__wrapped__("cpu", torch.float32, threads))  # uncached
        for _ in range(3):
            t = time.perf_counter()
            a @ b
            best_s = min(best_s, time.perf_counter() - t)
    assert max(peaks) == pytest.approx(counter.get_total_flops() / best_s, rel=0.3)


def test_measuring_the_peak_leaves_the_runs_random_stream_alone():
    """The peak is measured inside a run (the train stage's first iteration at a thread count):
    drawing its matrices from the global generator would move every later sample of the run."""
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    peak_matmul_flops.__wrapped__("cpu", torch.float32, torch.get_num_threads())
    assert torch.equal(torch.rand(4), expected)
