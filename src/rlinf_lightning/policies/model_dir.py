"""Up-front checks of a ``save_pretrained`` model directory, before any worker loads it.

Loading a directory whose tokenizer files are missing, or whose weights were saved for another
config, fails late and obscurely (a reshape error deep in attention, after workers started). These
checks read only ``config.json``, the tokenizer files and the safetensors headers, and compare the
weights' names and shapes with a model built from the config on the ``meta`` device (no memory);
the same model gives the parameter count and attention shape a memory estimate needs.

transformers renames and merges some families' weights as it loads them (the cases and versions:
docs/benchmarks.md) and reverts that as it saves, so a directory may hold either form: the weights
match when they match the model's own names or what ``save_pretrained`` writes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

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
    from safetensors import safe_open

    saved: dict[str, list[int]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                saved.update({k: list(sf.get_slice(k).get_shape()) for k in sf.keys()})
        except Exception as exc:  # noqa: BLE001 (a truncated or foreign file)
            return [f"{f}: not a readable safetensors file ({exc}); re-save the model"]
    forms = [config_shapes(path)]
    if (disk := saved_shapes(path)) != forms[0]:
        forms.append(disk)
    differences = [shape_difference(form, saved) for form in forms]
    if None in differences:
        return []
    detail = differences[-1]  # against the form save_pretrained writes, as checkpoints are saved
    return [f"{path}: the weights do not match config.json ({detail}); they were saved for another model"]


@dataclass(frozen=True)
class CausalLMShape:
    """What a memory estimate needs from a causal LM's config.json (see :func:`causal_lm_shape`)."""

    parameters: int  # shared tensors (a tied lm_head) once
    layers: int
    kv_heads: int
    head_dim: int


def causal_lm_shape(path: str | Path) -> CausalLMShape | None:
    """Parameter count and attention shape of the causal LM that ``path``'s config.json describes,
    from a model built on the ``meta`` device (no memory, no weights read); ``None`` without a
    config.json. Cached per config.json (path, mtime, size): a planner may ask for every candidate."""
    key = _config_key(path)
    return None if key is None else _causal_lm_shape(*key)


@lru_cache(maxsize=8)
def _causal_lm_shape(path: str, mtime_ns: int, size: int) -> CausalLMShape:
    model = _build_meta_causal_lm(path, mtime_ns, size)[1]
    config = model.config.get_text_config()
    heads = config.num_attention_heads
    return CausalLMShape(
        parameters=sum(p.numel() for p in model.parameters()),  # parameters() lists a tied one once
        layers=config.num_hidden_layers,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
    )


def config_shapes(path: str | Path) -> dict[str, list[int]]:
    """Parameter name -> shape of the causal LM that ``path``'s config.json describes, from a model
    built on the ``meta`` device (no memory), under the model's own names; a tied parameter (the
    head tied to the embedding) under its first name only."""
    model = _meta_causal_lm(path)[1]
    if model is None:
        raise FileNotFoundError(f"{Path(path) / 'config.json'} does not exist")
    return {k: list(v.shape) for k, v in _untied_state(model).items()}


def saved_shapes(path: str | Path) -> dict[str, list[int]]:
    """:func:`config_shapes` as ``save_pretrained`` writes them: transformers' load-time renames and
    merges reverted (the same as :func:`config_shapes` for most families, or where the installed
    transformers has no such conversions)."""
    key = _config_key(path)
    if key is None:
        raise FileNotFoundError(f"{Path(path) / 'config.json'} does not exist")
    return _saved_shapes(*key)


@lru_cache(maxsize=8)
def _saved_shapes(path: str, mtime_ns: int, size: int) -> dict[str, list[int]]:
    model = _build_meta_causal_lm(path, mtime_ns, size)[1]
    state = _untied_state(model)
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # a transformers without weight conversions saves the model's own names
        return {k: list(v.shape) for k, v in state.items()}
    return {k: list(v.shape) for k, v in revert_weight_conversion(model, state).items()}


def _untied_state(model: Any) -> dict[str, Any]:
    """The model's ``state_dict`` without the later names of a parameter held under several (as
    ``save_pretrained`` leaves out a tied head)."""
    later = {name for names in parameter_aliases(model) for name in names[1:]}
    return {k: v for k, v in model.state_dict().items() if k not in later}


def parameter_aliases(model: Any) -> list[list[str]]:
    """The names of each parameter held under several (a head tied to the embedding), in
    registration order."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _meta_causal_lm(path: str | Path) -> tuple[Any, Any]:
    """``(config, model on the meta device)`` for ``path``, or ``(None, None)`` without a config.json."""
    key = _config_key(path)
    return (None, None) if key is None else _build_meta_causal_lm(*key)


def _config_key(path: str | Path) -> tuple[str, int, int] | None:
    """The identity of ``path``'s config.json (absolute directory, mtime, size), the caches' key;
    ``None`` without one. Not resolved: a planner asks for every candidate plan, and resolving
    the links of a path costs ten times the stat."""
    try:
        stat = os.stat(os.path.join(path, "config.json"))
    except OSError:
        return None
    return os.path.abspath(path), stat.st_mtime_ns, stat.st_size


@lru_cache(maxsize=8)
def _build_meta_causal_lm(path: str, mtime_ns: int, size: int) -> tuple[Any, Any]:
    """The meta-device model, cached by the config file's identity (the key's last two parts)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):  # as accelerate's init_empty_weights, buffers included: no memory at all
        model = AutoModelForCausalLM.from_config(config)
    return config, model


def shape_difference(expected: dict[str, list[int]], saved: dict[str, list[int]]) -> str | None:
    """``None`` when ``saved`` has every expected tensor with its shape (and nothing else but a
    tied head); otherwise a short description of the first differences."""
    wrong = [f"{k} is {saved[k]}, expected {v}" for k, v in expected.items() if k in saved and saved[k] != v]
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected) - {"lm_head.weight"})
    if not (wrong or missing or unexpected):
        return None
    detail = wrong[:3] + [f"missing {k}" for k in missing[:3]] + [f"unexpected {k}" for k in unexpected[:3]]
    return f"{len(wrong) + len(missing) + len(unexpected)} tensors differ: {'; '.join(detail)}"
