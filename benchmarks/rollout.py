"""Rollout throughput of the ``hf`` and ``vllm`` engines, side by side in one run.

    python benchmarks/rollout.py [--sequences 256] [--new-tokens 64]

For two models built from configs (the demo's tiny 0.4 M-parameter Qwen2 and a ~100 M-parameter
one), both engines generate the same prompts x samples, every completion exactly
``--new-tokens`` long (EOS ignored), at temperature 1.0 with torch pinned to all cores. Each
engine is warmed up once, then timed over ``--repeats`` generations (median). The vLLM weight
sync (``update_weights`` with the full model, as after every actor step) is timed too and
reported as a fraction of an iteration = generation + sync. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

MODELS = {
    "tiny": {},  # TinyModelConfig defaults: 0.4 M parameters
    "100m": {"hidden_size": 768, "intermediate_size": 2304, "num_hidden_layers": 14,
             "num_attention_heads": 12, "num_key_value_heads": 12, "max_position_embeddings": 256},
}  # fmt: skip


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_model(name: str, path: Path, args) -> dict:
    from rlinf_lightning.engines.rollout import ROLLOUT_ENGINES, HFRolloutEngine, SamplingParams
    from rlinf_lightning.policies import LMPolicy

    tok = LMPolicy(str(path)).load_tokenizer()
    n_prompts = args.sequences // args.samples
    prompts = [
        tok(f"What is {i % 50}+{(7 * i) % 50}?=", add_special_tokens=False)["input_ids"]
        for i in range(n_prompts)
    ]
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens)
    groups = list(range(n_prompts))
    tokens = n_prompts * args.samples * args.new_tokens
    out = {"parameters_m": None, "sequences": n_prompts * args.samples, "new_tokens": args.new_tokens}

    hf = HFRolloutEngine(str(path))
    out["parameters_m"] = round(sum(p.numel() for p in hf.model.parameters()) / 1e6, 1)
    gen = lambda e: e.generate(prompts, groups, args.samples, params, 0, -1)  # noqa: E731
    lens = {len(c.token_ids) for cs in gen(hf) for c in cs}  # warm-up, and the lengths are forced
    assert lens == {args.new_tokens}, lens
    hf_s = timed(lambda: gen(hf), args.repeats)
    weights = [(k, v.detach().clone()) for k, v in hf.model.named_parameters()]
    hf = None  # free its memory before vLLM reserves its own

    t0 = time.perf_counter()
    vllm = ROLLOUT_ENGINES.get("vllm")(str(path))
    start_s = time.perf_counter() - t0
    gen(vllm)
    vllm_s = timed(lambda: gen(vllm), args.repeats)
    sync_s = timed(lambda: vllm.update_weights(weights), args.repeats)
    vllm = None
    out.update(
        {
            "hf_tokens_per_s": round(tokens / hf_s, 1),
            "vllm_tokens_per_s": round(tokens / vllm_s, 1),
            "vllm_over_hf": round(hf_s / vllm_s, 3),
            "vllm_start_s": round(start_s, 2),
            "vllm_sync_s": round(sync_s, 4),
            "sync_fraction_of_iteration": round(sync_s / (vllm_s + sync_s), 4),
        }
    )
    print(f"[{name}] {json.dumps(out)}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sequences", type=int, default=256)
    ap.add_argument("--samples", type=int, default=8, help="completions per prompt")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", default="tiny,100m")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    print(
        f"torch threads: {torch.get_num_threads()}; {args.sequences} sequences x {args.new_tokens} new tokens"
    )
    from rlinf_lightning.assets import TinyModelConfig, build_tiny_qwen2

    work = Path(tempfile.mkdtemp(prefix="rlinf-rollout-bench-"))
    result = {}
    for name in args.models.split(","):
        path = build_tiny_qwen2(work / name, TinyModelConfig(**MODELS[name]))
        result[name] = bench_model(name, path, args)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
