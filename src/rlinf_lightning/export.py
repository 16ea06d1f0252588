"""``rlinf export``: a trained checkpoint as a model directory that ``from_pretrained`` and vLLM load.

A checkpoint holds what resuming needs, not a model directory: the policy's weights under the
policy's names (a LoRA run's adapters alone, trained on the base that ``lora.json`` names), the
optimizer and the generators. Exporting rebuilds the policy that wrote it from the configuration
recorded in its ``state.json`` (the same class and arguments; ``model_path`` may be given anew when
the base has moved), loads its weights, merging a LoRA checkpoint's adapters into their base
(:func:`~rlinf_lightning.policies.lora.save_merged`), and writes the policy's ``save_pretrained``
directory: for ``LMPolicy`` the config, generation config and weights, with the tokenizer and chat
template of its model directory. The directory is written beside its destination and renamed into
place, so it appears complete or not at all.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

from rlinf_lightning.checkpoint import LAST, load_checkpoint, resolve_checkpoint
from rlinf_lightning.errors import CheckpointError, InputError

log = logging.getLogger(__name__)


def export_checkpoint(ckpt_path: str, output_dir: str, model_path: str | None = None) -> Path:
    """Write the checkpoint at ``ckpt_path`` as a ``from_pretrained`` directory at ``output_dir``.

    Args:
        ckpt_path: a checkpoint directory (``runs/x/checkpoints/iter-000200``), the ``last`` file
            beside it (its run's newest), or a run directory (``trainer.default_root_dir``: its
            newest checkpoint).
        output_dir: where the model directory is written; it must not exist yet, or be empty.
        model_path: the policy's ``model_path`` (the base a LoRA checkpoint's adapters are merged
            into, and the tokenizer's source) when it is no longer where the run recorded it;
            ``None``: the recorded one.
    """
    out = Path(output_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InputError(
            f"--output_dir {out}: exists and is not an empty directory; choose a new one or remove it"
        )
    path = _checkpoint_dir(ckpt_path)
    train_state, state, _ = load_checkpoint(path)
    policy = _recorded_policy(path, state, model_path)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        _save(policy, path, train_state, tmp)
        os.replace(tmp, out)  # an empty directory at ``out`` is replaced too
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("exported %s (iteration %d) to %s", path, state["iteration"], out)
    return out


def _checkpoint_dir(ckpt_path: str) -> Path:
    """The checkpoint directory ``ckpt_path`` names (see :func:`export_checkpoint`)."""
    given = Path(ckpt_path)
    if given.is_file() and given.name == LAST:
        return resolve_checkpoint(LAST, given.parent)
    if (given / "checkpoints" / LAST).is_file():
        return resolve_checkpoint(LAST, given / "checkpoints")
    if (given / LAST).is_file() and not (given / "state.json").exists():
        return resolve_checkpoint(LAST, given)
    return given


def _recorded_policy(path: Path, state: dict[str, Any], model_path: str | None) -> Any:
    """The policy the run was configured with (``state.json``'s ``config.policy``), not loaded yet;
    its settings checked as ``rlinf fit`` checks them."""
    from jsonargparse import ArgumentError, ArgumentParser

    from rlinf_lightning.policies.module import RLModule

    recorded = (state.get("config") or {}).get("policy")
    if not isinstance(recorded, dict) or "class_path" not in recorded:
        raise CheckpointError(
            f"{path / 'state.json'}: records no policy configuration (a checkpoint written before "
            "runs recorded it); export it from Python with the policy's save_pretrained"
        )
    recorded = {**recorded, "init_args": dict(recorded.get("init_args") or {})}
    if model_path is not None:
        if "model_path" not in recorded["init_args"]:
            name = recorded["class_path"].rsplit(".", 1)[-1]
            raise InputError(
                f"--model_path: the checkpoint's policy ({name}) takes no model_path; leave it out"
            )
        recorded["init_args"]["model_path"] = model_path
    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(RLModule, "policy")
    try:
        policy = parser.instantiate(parser.parse_object({"policy": recorded})).policy
    except (ArgumentError, ValueError, TypeError) as exc:
        raise CheckpointError(f"{path / 'state.json'}: its policy cannot be rebuilt ({exc})") from None
    if not hasattr(policy, "save_pretrained"):
        raise InputError(
            f"{path}: policy {type(policy).__name__} has no save_pretrained, so it cannot be exported"
        )
    for key, problem in policy.validate_config() if hasattr(policy, "validate_config") else ():
        fix = "; give its new place with --model_path" if key == "model_path" else ""
        raise InputError(f"{path}: the checkpoint's policy.{key}: {problem}{fix}")
    return policy


def _save(policy: Any, path: Path, train_state: dict[str, Any], out: Path) -> None:
    """``policy`` with the checkpoint's weights, saved at ``out``."""
    from rlinf_lightning.policies.lora import checkpoint_mismatch, save_merged
    from rlinf_lightning.policies.model_dir import parameter_aliases

    if why := checkpoint_mismatch(policy, train_state["lora"]):
        fix = "; give the base it was trained on with --model_path" if "trained on base" in why else ""
        raise CheckpointError(f"{path}: {why}{fix}")
    weights = train_state["model"]
    if train_state["lora"] is not None:
        save_merged(policy, weights, out)
        return
    if hasattr(policy, "check_state_dict") and (why := policy.check_state_dict(weights)):
        raise CheckpointError(f"{path}: {why}")
    policy.configure_model()
    missing, unexpected = policy.model.load_state_dict(weights, strict=False)
    # a sharded engine saves each parameter once: a head tied to the embedding comes under one name
    aliased = {
        name for group in parameter_aliases(policy.model) if set(group) & weights.keys() for name in group
    }
    if unexpected or (missing := sorted(set(missing) - aliased)):
        what = f"no tensor for {missing[0]!r}" if missing else f"an unknown tensor {unexpected[0]!r}"
        raise CheckpointError(f"{path / 'model.safetensors'}: {what}; export with the policy that wrote it")
    policy.save_pretrained(out)
