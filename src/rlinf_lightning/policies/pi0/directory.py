"""Up-front checks of a π0 checkpoint directory (``policy.model_path``), before any worker loads it.

A directory without its tokenizer, with weights saved for another config, or with normalisation
statistics that are corrupt or missing used to fail after the workers started (a 49- to 122-line
traceback), or, for missing statistics, not at all: the run went on raw, and a policy fitted on
standardised actions reached no goal. These checks read only ``config.json``, the safetensors
headers and ``norm_stats.json``; the weights are compared with a π0 built from the config on the
``meta`` device (no memory), by their shapes: transformers renames π0's tensors between the form it
saves (openpi's names) and its modules', so names cannot be compared, but a config of another size
changes the shapes.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from rlinf_lightning.policies.pi0.norm import NORM_FILE, NormStats

TOKENIZER_FILE = "tokenizer.json"  # π0 reads its instruction with a fast tokenizer
HEADS_FILE = "rl_heads.safetensors"  # noise and value heads, beside a saved π0


def directory_problems(path: str | Path, normalize: bool) -> list[str]:
    """Problems with the π0 directory ``path`` (its ``config.json`` read already): the tokenizer,
    the weights against the config and, with ``normalize``, ``norm_stats.json`` present and
    readable."""
    path = Path(path)
    problems = []
    if not (path / TOKENIZER_FILE).is_file():
        problems.append(
            f"{path}: no {TOKENIZER_FILE} (π0 reads its instruction with it); save the tokenizer into "
            "the directory with tokenizer.save_pretrained(path)"
        )
    problems += _weights_problems(path)
    if normalize:
        try:
            stats = NormStats.load(path)
        except ValueError as exc:
            problems.append(str(exc))
        else:
            if stats is None:
                problems.append(
                    f"{path}: no {NORM_FILE}, so states and actions would run raw (a π0 fitted on "
                    "standardised ones reaches no goal that way); point policy.model_path at the output "
                    "of rlinf sft, which writes it, or set policy.normalize: false to run raw on purpose"
                )
    return problems


def norm_size_problem(path: str | Path, state_dim: int, action_dim: int) -> str | None:
    """Why the directory's ``norm_stats.json`` does not fit the env's state and action sizes."""
    stats = NormStats.load(path)
    if stats is None or (len(stats.state_mean), len(stats.action_mean)) == (state_dim, action_dim):
        return None
    return (
        f"its {NORM_FILE} is for {len(stats.state_mean)}-d states and {len(stats.action_mean)}-d actions, "
        f"the env's are {state_dim}-d and {action_dim}-d; use the statistics of demonstrations of this "
        "env (rlinf sft on them writes them)"
    )


def _weights_problems(path: Path) -> list[str]:
    import torch
    from safetensors import safe_open
    from transformers import PI0Config, PI0ForConditionalGeneration

    files = sorted(f for f in path.glob("*.safetensors") if f.name != HEADS_FILE)
    if not files:
        return [f"{path}: no weights (*.safetensors); save π0 with save_pretrained(path)"]
    saved: list[tuple[int, ...]] = []
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                saved += [tuple(sf.get_slice(k).get_shape()) for k in sf.keys()]
        except Exception as exc:  # noqa: BLE001 (a truncated or foreign file)
            return [f"{f}: not a readable safetensors file ({exc}); save π0 again"]
    try:
        config = PI0Config.from_pretrained(str(path))
    except Exception as exc:  # noqa: BLE001 (any config a π0 cannot be built from)
        return [f"{path / 'config.json'}: not a π0 config ({type(exc).__name__}: {exc})"]
    with torch.device("meta"):
        model = PI0ForConditionalGeneration(config)
    expected = Counter(tuple(t.shape) for t in model.state_dict().values())
    missing, unexpected = expected - Counter(saved), Counter(saved) - expected
    if not (missing or unexpected):
        return []
    detail = [f"expected {list(s)}" for s in list(missing)[:2]] + [
        f"found {list(s)}" for s in list(unexpected)[:2]
    ]
    count = sum(missing.values()) + sum(unexpected.values())
    return [
        f"{path}: the weights do not match config.json ({count} tensor shapes differ: {'; '.join(detail)}); "
        "they were saved for another π0"
    ]
