"""What every section of ``gpu.py`` shares: the model shapes, a random-weight model built from one,
rollout-shaped batches, and one timed actor step."""

from __future__ import annotations

import time
from pathlib import Path

import torch

SHAPES = {
    # Qwen2.5-0.5B's config.json, weights random
    "0.5b": {
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
    },
    # the 0.5b vocabulary on a small body: what the logits cost, measurable on a CPU
    "vocab": {
        "vocab_size": 151936,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
    },
    # the same code on a CPU in seconds
    "tiny": {
        "vocab_size": 1024,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 1024,
    },
}


def build_model(path: Path, shape: dict) -> Path:
    """A random-weight Qwen2 of ``shape`` with the library's byte-level chat tokenizer (its ids are
    the first few hundred of the vocabulary), saved like a downloaded checkpoint."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from rlinf_lightning.assets import build_chat_tokenizer

    build_chat_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(path)
    config = Qwen2Config(
        **shape,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path)
    return path


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def rollout_batch(n: int, vocab: int, max_response: int, seed: int = 0):
    """``n`` rollout-shaped samples (prompts 24-64 tokens, responses half to all of
    ``max_response``) packed as the rollout stage packs them, with advantages."""
    from rlinf_lightning.engines.rollout import Completion
    from rlinf_lightning.workflows.reasoning.rollout import pack_samples

    g = torch.Generator().manual_seed(seed)
    prompts, completions = [], []
    for _ in range(n):
        p = int(torch.randint(24, 65, (1,), generator=g))
        r = int(torch.randint(max_response // 2, max_response + 1, (1,), generator=g))
        prompts.append(torch.randint(3, vocab, (p,), generator=g).tolist())
        ids = torch.randint(3, vocab, (r,), generator=g).tolist()
        completions.append([Completion(ids, (-torch.rand(r, generator=g) * 3).tolist())])
    batch = pack_samples(prompts, completions, pad_id=0)
    batch["advantage"] = torch.randn(n, generator=g)
    batch["policy_version"] = torch.zeros(n, dtype=torch.long)  # sampled by the initial weights
    from tensordict import TensorDict

    return TensorDict(batch, batch_size=[n])


def timed_step(stage, batch, device: str) -> tuple[float, dict]:
    sync(device)
    t0 = time.perf_counter()
    stage.begin_iteration(1)  # as a worker does before each iteration's first micro-batch
    stage.process(batch)
    metrics = stage.end_iteration().compute()
    sync(device)
    return time.perf_counter() - t0, metrics


def load_meta(path: Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
