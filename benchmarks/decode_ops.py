"""The work a decode step dispatches: aten ops per generated token, our ``hf`` engine against plain
``transformers`` ``model.generate`` on the same model, at two batch sizes.

    python benchmarks/decode_ops.py [--rows 32,256] [--short 8] [--long 24]

On a GPU each dispatched op is a kernel launch, and a small model's decode is launch-bound, so the
op count per step is what a CPU can show of the GPU gap (a CPU timing cannot: there decoding is
compute-bound). Counted with the torch profiler (every ``aten::`` event, nested ones included)
over a short and a long generation; per step = the difference over the difference in tokens, so
the prefill and the per-call set-up cancel. Both sample at temperature 1 from the whole vocabulary
(``top_k`` off for ``generate``, whose default is 50) and generate exactly as many tokens (no stop
token). Also times both (``rollout_over_generate``: generate's seconds over ours).

Prints one line per figure; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def aten_ops(fn) -> int:
    """``aten::`` events the profiler records while ``fn()`` runs (nested ones included)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))


def _prompts(rows: int, group: int, vocab: int, length: int = 16) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(rows // group)]


def ours(engine, prompts: list[list[int]], group: int, tokens: int):
    """A callable: the engine's ``generate`` of ``tokens`` new tokens per row, no stop token."""
    from rlinf_lightning.engines.rollout import SamplingParams

    params = SamplingParams(temperature=1.0, max_new_tokens=tokens)
    return lambda: engine.generate(prompts, list(range(len(prompts))), group, params, 0, -1)


def plain_generate(model, prompts: list[list[int]], group: int, tokens: int, device: str):
    """A callable: ``model.generate`` sampling ``tokens`` new tokens per row (left-padded prompts
    repeated ``group`` times, as the engine's rows are), no stop token."""
    from transformers import GenerationConfig

    rows = [p for p in prompts for _ in range(group)]
    width = max(len(p) for p in rows)
    pad = model.config.pad_token_id or 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in rows], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows], device=device)
    config = GenerationConfig(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=tokens,
        eos_token_id=None, pad_token_id=pad,
    )  # fmt: skip
    return lambda: model.generate(input_ids=ids, attention_mask=mask, generation_config=config)


def ops_per_step(engine, rows: int, group: int, vocab: int, short: int, long: int) -> dict:
    """Aten ops per decode step at ``rows`` rows, ours and ``generate``'s."""
    prompts = _prompts(rows, group, vocab)
    out = {}
    for name, make in (
        ("ours", lambda t: ours(engine, prompts, group, t)),
        ("generate", lambda t: plain_generate(engine.model, prompts, group, t, engine.device)),
    ):
        make(2)()  # warm-up (lazy initialisation is not a step's work)
        out[name] = (aten_ops(make(long)) - aten_ops(make(short))) / (long - short)
    return out


def decode_ops(engine, rows: list[int], group: int, vocab: int, short: int = 8, long: int = 24) -> dict:
    """Ops per step at each of ``rows`` and their growth from the fewest rows to the most."""
    per = {r: ops_per_step(engine, r, group, vocab, short, long) for r in rows}
    lo, hi = min(rows), max(rows)
    result = {
        "ops_per_step": {str(r): {k: round(v, 1) for k, v in per[r].items()} for r in rows},
        "growth": {k: round(per[hi][k] - per[lo][k], 1) for k in ("ours", "generate")},
    }
    result["ours_le_generate"] = per[hi]["ours"] <= per[hi]["generate"]
    result["growth_le_generate"] = result["growth"]["ours"] <= result["growth"]["generate"]
    print(f"decode ops: {result}", flush=True)
    return result


def first_tokens(run, first: int) -> list[list[int]]:
    """Each row's first ``first`` token ids from one call of ``run`` (an :func:`ours` callable)."""
    return [c.token_ids[:first] for cs in run() for c in cs]


def share_same(a: list[list[int]], b: list[list[int]]) -> float:
    """The share of rows whose tokens are the same in ``a`` and ``b``."""
    return round(sum(x == y for x, y in zip(a, b)) / len(b), 3)


def graph_rows_as_eager(
    engine, prompts: list[list[int]], group: int, tokens: int, first: int = 8
) -> float | None:
    """The share of rows whose first ``first`` tokens (same seed) are the same with the engine's
    captured decode step as with its eager one; ``None`` without a captured step (CPU, or
    ``cuda_graph=False``). A wrong graph (a shifted cache, a stale output) gives ~0; compiled
    kernels round differently from eager ones in bf16, which moves a few rows at most. Both
    generate ``tokens`` tokens, the timed run's count, so the graph of that cache shape is replayed,
    not compiled again for another."""
    if engine.graphs is None:
        return None
    run = ours(engine, prompts, group, tokens)
    captured = first_tokens(run, first)
    if engine.graphs.failed:  # it decoded eagerly: nothing to compare
        return None
    graphs, engine.graphs = engine.graphs, None
    try:
        eager = first_tokens(run, first)
    finally:
        engine.graphs = graphs
    return share_same(captured, eager)


def offload_cycle(engine, prompts: list[list[int]], group: int, tokens: int, first: int = 8) -> dict:
    """Our rollout before and after an offload and onload (what ``collocated_offload`` does between
    turns): ``rows_same_after_offload``, the share of rows whose first ``first`` tokens (same seed)
    are the same (a graph captured again on the onloaded weights' new addresses that decodes wrong
    gives ~0); ``offload_freed_gib``, the device memory the offload gave back (the weights, the
    static cache and the graph's pool; ``null`` on a CPU, where it goes to a spill file); and
    ``graph_captures`` meanwhile (1 with a graph: the step captured again after the onload)."""
    run = ours(engine, prompts, group, tokens)
    before = first_tokens(run, first)
    captures = engine.graphs.captures if engine.graphs is not None else None
    cuda = engine.device.startswith("cuda")
    held = torch.cuda.memory_allocated(engine.device) if cuda else 0
    engine.offload()
    freed = held - torch.cuda.memory_allocated(engine.device) if cuda else None
    engine.onload()
    after = first_tokens(run, first)
    return {
        "rows_same_after_offload": share_same(before, after),
        "offload_freed_gib": None if freed is None else round(freed / 2**30, 3),
        "graph_captures": None if captures is None else engine.graphs.captures - captures,
    }


def rollout_over_generate(engine, rows: int, group: int, vocab: int, tokens: int, repeats: int) -> dict:
    """Seconds of ``generate`` over ours, same model, device, dtype, prompts and token count."""

    def timed(fn) -> float:
        if engine.device.startswith("cuda"):
            torch.cuda.synchronize(engine.device)
        t0 = time.perf_counter()
        fn()
        if engine.device.startswith("cuda"):
            torch.cuda.synchronize(engine.device)
        return time.perf_counter() - t0

    captures = engine.graphs.captures if engine.graphs is not None else None
    prompts = _prompts(rows, group, vocab, length=32)
    runs = {
        "ours": ours(engine, prompts, group, tokens),
        "generate": plain_generate(engine.model, prompts, group, tokens, engine.device),
    }
    seconds = {}
    for name, fn in runs.items():
        timed(fn)  # warm-up: kernels, the allocator, and ours' graph for this cache shape
        seconds[name] = statistics.median(timed(fn) for _ in range(repeats))
    row = {
        "sequences": rows,
        "new_tokens": tokens,
        "ours_s": round(seconds["ours"], 3),
        "generate_s": round(seconds["generate"], 3),
        "rollout_over_generate": round(seconds["generate"] / seconds["ours"], 3),
        "graph_rows_as_eager": graph_rows_as_eager(engine, prompts, group, tokens),
        # graphs captured meanwhile: the run's cache shape once (in the warm-up) at most, none again
        "graph_captures": None if captures is None else engine.graphs.captures - captures,
        "offload_cycle": offload_cycle(engine, prompts, group, tokens),
    }
    print(f"ours vs generate: {row}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rows", default="32,256")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--short", type=int, default=8)
    ap.add_argument("--long", type=int, default=24)
    args = ap.parse_args()
    from gpu_common import SHAPES, build_model

    from rlinf_lightning.engines.rollout import HFRolloutEngine

    shape = SHAPES["tiny"]
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "model", shape)
        # eager, as the profiler counts it: a CUDA-graph replay is one launch per step
        engine = HFRolloutEngine(str(model), device=args.device, cuda_graph=False)
        rows = [int(r) for r in args.rows.split(",")]
        result = decode_ops(engine, rows, args.group, shape["vocab_size"], args.short, args.long)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
