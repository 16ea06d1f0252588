"""Atomic checkpoints: write into a temporary directory, then rename it into place.

A checkpoint directory holds ``model.safetensors`` (policy weights), ``optimizer.pt``, ``rng.pt``
(torch / Python / NumPy generator states) and ``state.json`` (iteration, data position, ...).
Sharded train engines (``ddp``, ``fsdp``) add ``sharded/``: ``torch.distributed.checkpoint`` shards
of weights and optimizer state, loadable on any number of ranks (then there is no optimizer.pt).
``<root>/last`` names the newest complete checkpoint; it is replaced atomically too, so a crash at
any moment leaves either the previous or the new checkpoint, never a torn one.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

LAST = "last"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> dict[str, Any]:
    import numpy as np

    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def save_checkpoint(
    root: str | Path,
    iteration: int,
    actor_state: dict[str, Any],
    state: dict[str, Any],
    write_extra: Callable[[Path], None] | None = None,
) -> Path:
    """Write ``iter-NNNNNN`` atomically; ``write_extra(tmp_dir)`` adds files (e.g. sharded state)
    before the rename, so they are part of the same atomic step."""
    from safetensors.torch import save_file

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"iter-{iteration:06d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    # clone: tied weights share storage, which safetensors refuses to write twice
    weights = {k: v.detach().to("cpu").clone().contiguous() for k, v in actor_state["model"].items()}
    save_file(weights, str(tmp / "model.safetensors"))
    if actor_state.get("optimizer") is not None:
        torch.save(actor_state["optimizer"], tmp / "optimizer.pt")
    if write_extra is not None:
        write_extra(tmp)
    torch.save(rng_state(), tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps({"iteration": iteration, **state}, indent=1))
    for f in tmp.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    pointer = root / f".{LAST}.tmp"
    pointer.write_text(final.name)
    os.replace(pointer, root / LAST)
    _fsync_dir(root)
    return final


def resolve_checkpoint(ckpt_path: str, root: str | Path) -> Path:
    """``"last"`` -> the newest checkpoint under ``root``; otherwise the given directory."""
    if ckpt_path == LAST:
        pointer = Path(root) / LAST
        if not pointer.is_file():
            raise FileNotFoundError(f"--ckpt_path last: no checkpoint under {root} yet")
        return Path(root) / pointer.read_text().strip()
    path = Path(ckpt_path)
    if not (path / "state.json").is_file():
        raise FileNotFoundError(f"--ckpt_path {ckpt_path}: not a checkpoint directory (no state.json)")
    return path


def load_checkpoint(path: str | Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``(actor_state, state, rng)`` as saved by :func:`save_checkpoint`."""
    from safetensors.torch import load_file

    path = Path(path)
    actor = {
        "model": load_file(str(path / "model.safetensors")),
        "optimizer": torch.load(path / "optimizer.pt", weights_only=False)
        if (path / "optimizer.pt").is_file()
        else None,
    }
    state = json.loads((path / "state.json").read_text())
    rng = torch.load(path / "rng.pt", weights_only=False)
    return actor, state, rng
