"""Up-front checks of a ``save_pretrained`` model directory, before any worker loads it.

Loading a directory whose tokenizer files are missing, or whose weights were saved for another
config, fails late and obscurely (a reshape error deep in attention, after workers started). These
checks read only ``config.json``, the tokenizer files and the safetensors headers, and compare the
weights' names and shapes with a model built from the config on the ``meta`` device (no memory).
"""

from __future__ import annotations

import json
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def check_causal_lm_dir(path: str | Path) -> list[str]:
    """Problems with the causal-LM directory ``path`` (empty when it loads cleanly)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        return [
            f"{str(path)!r} is not a model directory (no config.json). Point it at a save_pretrained() "
            "directory, e.g. run `rlinf prepare` to build the tiny one."
        ]
    try:
        json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        return [f"{path / 'config.json'}: not valid JSON ({exc})"]
    problems = _check_tokenizer(path)
    problems += _check_weights(path)
    return problems


def _check_tokenizer(path: Path) -> list[str]:
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        return [
            f"{path}: no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); save the tokenizer "
            "into the model directory with tokenizer.save_pretrained(path)"
        ]
    from transformers import AutoConfig, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        config = AutoConfig.from_pretrained(str(path))
    except Exception as exc:  # noqa: BLE001 (any loading failure is reported, naming the directory)
        return [f"{path}: the tokenizer or config does not load: {type(exc).__name__}: {exc}"]
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and len(tokenizer) > vocab:
        return [
            f"{path}: the tokenizer has {len(tokenizer)} tokens but config.json's vocab_size is {vocab}; "
            "token ids past the embedding would crash the model. Save matching tokenizer and model."
        ]
    return []


def _check_weights(path: Path) -> list[str]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        if any(path.glob("pytorch_model*.bin")):
            return []  # legacy pickled weights: transformers checks them when loading
        return [f"{path}: no weights (*.safetensors); save the model with model.save_pretrained(path)"]
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    saved: dict[str, list[int]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                saved.update({k: list(sf.get_slice(k).get_shape()) for k in sf.keys()})
        except Exception as exc:  # noqa: BLE001 (a truncated or foreign file)
            return [f"{f}: not a readable safetensors file ({exc}); re-save the model"]
    config = AutoConfig.from_pretrained(str(path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    expected = {k: list(v.shape) for k, v in model.state_dict().items()}
    wrong = [
        f"{k} is {saved[k]} in the weights but {shape} by config.json"
        for k, shape in expected.items()
        if k in saved and saved[k] != shape
    ]
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = sorted(set(expected) - set(saved) - tied)
    unexpected = sorted(set(saved) - set(expected))
    if not (wrong or missing or unexpected):
        return []
    detail = wrong[:3] + [f"missing {k}" for k in missing[:3]] + [f"unexpected {k}" for k in unexpected[:3]]
    n = len(wrong) + len(missing) + len(unexpected)
    return [
        f"{path}: the weights do not match config.json ({n} tensors differ: {'; '.join(detail)}); "
        "the weights were saved for another model configuration"
    ]
