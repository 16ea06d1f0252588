"""Atomic checkpoints: write into a temporary directory, then rename it into place.

A checkpoint directory holds ``model.safetensors`` (policy weights), ``optimizer.pt`` (and
``lr_scheduler.pt`` when the policy configures a scheduler; with LoRA, ``model.safetensors`` holds the
trainable tensors only and ``lora.json`` the adapters' config and their base's path and hash), ``rng.pt``
(torch / Python / NumPy generator states) and ``state.json`` (iteration, data position, ...).
Sharded train engines (``ddp``, ``fsdp``) add ``sharded/``: ``torch.distributed.checkpoint`` shards
of weights and optimizer state, loadable on any number of ranks (then there is no optimizer.pt).
``stages/<name>.pt`` holds what a stage needs beyond that (``Stage.extra_state``: a critic's weights
and optimizer state, an adaptive KL coefficient).
An asynchronous run (``trainer.max_staleness``) adds ``sync_backlog.pt``: the weight versions its
rollout held and had not applied yet, so that a resumed run lags exactly as the uninterrupted one.
``<root>/last`` names the newest complete checkpoint; it is replaced atomically too, so a crash at
any moment leaves either the previous or the new checkpoint, never a torn one.

A checkpoint is user input (it may come from anywhere), so nothing in it is unpickled freely:
weights are safetensors, ``optimizer.pt`` and ``rng.pt`` hold only tensors and plain containers and
load with ``weights_only=True``, and sharded state loads through :class:`SafeShardReader`.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from rlinf_lightning.errors import CheckpointError, RunError

log = logging.getLogger(__name__)

LAST = "last"
ITER = "iter-"  # a checkpoint directory is ITER + the iteration, six digits
LORA_FILE = "lora.json"  # a LoRA checkpoint's adapter config and base identity


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> dict[str, Any]:
    """Generator states as tensors and plain containers (loadable with ``weights_only=True``)."""
    import numpy as np

    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "python": [version, list(mt), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


@contextmanager
def _write_errors(final: Path) -> Iterator[None]:
    """A failed write (the disk is full, ...) as a :class:`RunError` saying what survives."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, RuntimeError, SafetensorError) as exc:  # torch.save raises RuntimeError
        pointer = final.parent / LAST
        previous = pointer.read_text().strip() if pointer.is_file() else "none"
        raise RunError(
            f"could not write checkpoint {final}: {type(exc).__name__}: {exc}; the last complete "
            f"checkpoint ({previous}) is intact and resumes with --ckpt_path last"
        ) from exc


def save_checkpoint(
    root: str | Path,
    iteration: int,
    actor_state: dict[str, Any],
    state: dict[str, Any],
    write_extra: Callable[[Path], None] | None = None,
    stage_states: dict[str, dict[str, Any]] | None = None,
    keep: int = 0,
) -> Path:
    """Write ``iter-NNNNNN`` atomically; ``write_extra(tmp_dir)`` adds files (e.g. sharded state)
    before the rename, so they are part of the same atomic step; ``stage_states``: each stage's
    ``extra_state`` by name; ``keep``: then delete all but the newest ``keep`` (0: keep all)."""
    from safetensors.torch import save_file

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{ITER}{iteration:06d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with _write_errors(final):
            tmp.mkdir()
            # clone: tied weights share storage, which safetensors refuses to write twice
            weights = {k: v.detach().to("cpu").clone().contiguous() for k, v in actor_state["model"].items()}
            save_file(weights, str(tmp / "model.safetensors"))
            if actor_state.get("optimizer") is not None:
                torch.save(actor_state["optimizer"], tmp / "optimizer.pt")
            if actor_state.get("lr_scheduler") is not None:
                torch.save(actor_state["lr_scheduler"], tmp / "lr_scheduler.pt")
            if actor_state.get("lora") is not None:
                (tmp / LORA_FILE).write_text(json.dumps(actor_state["lora"], indent=1))
            for name, stage_state in (stage_states or {}).items():
                (tmp / "stages").mkdir(exist_ok=True)
                torch.save(stage_state, tmp / "stages" / f"{name}.pt")
        if write_extra is not None:
            write_extra(tmp)
        with _write_errors(final):
            torch.save(rng_state(), tmp / "rng.pt")
            (tmp / "state.json").write_text(json.dumps({"iteration": iteration, **state}, indent=1))
            for f in tmp.rglob("*"):
                if f.is_file():
                    with open(f, "rb") as fh:
                        os.fsync(fh.fileno())
    except BaseException:  # drop the partial copy; the previous checkpoints stay as they are
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # re-saving an iteration: move the old copy aside (atomic) rather than deleting it first, so
    # that a crash between the two renames still leaves it, and resolve_checkpoint finds it
    old = root / f".old-{final.name}"
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    pointer = root / f".{LAST}.tmp"
    pointer.write_text(final.name)
    os.replace(pointer, root / LAST)
    _fsync_dir(root)
    shutil.rmtree(old, ignore_errors=True)
    if keep:
        prune_checkpoints(root, iteration, keep)
    return final


def prune_checkpoints(root: Path, iteration: int, keep: int) -> None:
    """Delete the checkpoints of iterations before ``iteration`` but the newest ``keep`` up to it
    (``iteration``'s own included). ``last`` already names ``iteration``'s, so a crash while
    deleting leaves it whole; checkpoints after ``iteration`` (left by a run this one resumed
    earlier than) are not this run's to delete. One that cannot be deleted is a warning naming it:
    the new checkpoint is written, and the run goes on."""
    numbers = {p: p.name.removeprefix(ITER) for p in root.glob(f"{ITER}*") if p.is_dir()}
    done = sorted(p for p, n in numbers.items() if n.isdigit() and int(n) <= iteration)
    for path in done[:-keep]:
        try:
            shutil.rmtree(path)
        except OSError as e:
            log.warning("trainer.ckpt_keep: could not delete %s (%s); delete it by hand", path, e)


def resolve_checkpoint(ckpt_path: str, root: str | Path) -> Path:
    """``"last"`` -> the newest checkpoint under ``root``; otherwise the given directory
    (:func:`load_checkpoint` checks it is complete)."""
    if ckpt_path == LAST:
        pointer = Path(root) / LAST
        if not pointer.is_file():
            raise CheckpointError(
                f"--ckpt_path last: no checkpoint under {root} yet; run without --ckpt_path to start "
                "fresh, or set trainer.default_root_dir to the run that wrote one"
            )
        path = Path(root) / pointer.read_text().strip()
        if not path.is_dir() and (path.parent / f".old-{path.name}").is_dir():
            path = path.parent / f".old-{path.name}"  # a crash while re-saving this iteration
    else:
        path = Path(ckpt_path)
    return path


def verify_checkpoint(path: Path) -> None:
    """Raise :class:`CheckpointError` naming the first missing or unreadable file of ``path``."""
    from safetensors import safe_open

    if not path.is_dir():
        raise CheckpointError(f"--ckpt_path {path}: no such checkpoint directory")
    try:
        state = json.loads((path / "state.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not a checkpoint directory (no state.json)") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path / 'state.json'}: corrupt ({type(exc).__name__}: {exc})") from None
    if why := _state_problem(state):
        raise CheckpointError(f"{path / 'state.json'}: corrupt ({why})")
    if (path / LORA_FILE).is_file() and (why := _lora_problem(path / LORA_FILE)):
        raise CheckpointError(f"{path / LORA_FILE}: corrupt ({why})")
    try:
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            list(f.keys())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: partial checkpoint, model.safetensors is missing") from None
    except Exception as exc:  # noqa: BLE001 (safetensors raises its own error types)
        raise CheckpointError(f"{path / 'model.safetensors'}: corrupt ({exc})") from None
    needed = ["rng.pt", "sharded/.metadata" if (path / "sharded").is_dir() else "optimizer.pt"]
    for name in needed:
        if not (path / name).is_file():
            raise CheckpointError(f"{path}: partial checkpoint, {name} is missing")


def _state_problem(state: Any) -> str | None:
    """What ``state.json`` lacks that a resume reads: an iteration (an int >= 0) and the
    evaluation history (a list)."""
    if not isinstance(state, dict):
        return f"expected an object, got {type(state).__name__}"
    iteration = state.get("iteration")
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
        return f"'iteration' must be an int >= 0, got {iteration!r}"
    if not isinstance(state.get("eval_history"), list):
        return f"'eval_history' must be a list, got {state.get('eval_history')!r}"
    return None


def _lora_problem(file: Path) -> str | None:
    """What ``lora.json`` lacks that a resume reads: the adapters' ``config`` and their base's
    ``path`` and ``sha256``."""
    try:
        lora = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    base = lora.get("base") if isinstance(lora, dict) else None
    if not isinstance(lora, dict) or not isinstance(lora.get("config"), dict):
        return "no 'config' object (the adapters' policy.lora)"
    if not isinstance(base, dict) or not all(isinstance(base.get(k), str) for k in ("path", "sha256")):
        return "no 'base' object with 'path' and 'sha256' (the model the adapters were trained on)"
    return None


def _load_pt(path: Path) -> Any:
    try:
        return torch.load(path, weights_only=True)
    except Exception as exc:  # noqa: BLE001 (truncated files, pickles with code, ...)
        raise CheckpointError(f"{path}: cannot be loaded safely ({type(exc).__name__}: {exc})") from None


SYNC_BACKLOG = "sync_backlog.pt"


def save_sync_backlog(directory: Path, held_back: dict[str, list[tuple[int, Any]]]) -> None:
    """Write what lagged sync targets held back (``Runtime.held_back``) as plain tensors."""
    plain = {
        channel: [(v, None if state is None else dict(state.items())) for v, state in versions]
        for channel, versions in held_back.items()
    }
    torch.save(plain, directory / SYNC_BACKLOG)


def load_sync_backlog(path: str | Path) -> dict[str, list[tuple[int, Any]]] | None:
    """What :func:`save_sync_backlog` wrote into checkpoint ``path``, states as TensorDicts;
    ``None`` when the checkpoint has none (a synchronous run's, or one taken after a drain)."""
    from tensordict import TensorDict

    file = Path(path) / SYNC_BACKLOG
    if not file.is_file():
        return None
    return {
        channel: [(v, None if s is None else TensorDict(s, batch_size=[])) for v, s in versions]
        for channel, versions in _load_pt(file).items()
    }


def load_checkpoint(path: str | Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``(actor_state, state, rng)`` as saved by :func:`save_checkpoint`."""
    from safetensors.torch import load_file

    path = Path(path)
    verify_checkpoint(path)
    try:
        model = load_file(str(path / "model.safetensors"))
    except Exception as exc:  # noqa: BLE001 (a file truncated after its header)
        raise CheckpointError(f"{path / 'model.safetensors'}: corrupt ({exc})") from None
    optimizer = _load_pt(path / "optimizer.pt") if (path / "optimizer.pt").is_file() else None
    scheduler = _load_pt(path / "lr_scheduler.pt") if (path / "lr_scheduler.pt").is_file() else None
    state = json.loads((path / "state.json").read_text())
    lora = json.loads((path / LORA_FILE).read_text()) if (path / LORA_FILE).is_file() else None
    actor = {"model": model, "optimizer": optimizer, "lr_scheduler": scheduler, "lora": lora}
    return actor, state, _load_pt(path / "rng.pt")


def load_stage_states(path: str | Path) -> dict[str, dict[str, Any]]:
    """Each stage's ``extra_state`` saved in the checkpoint at ``path``, by stage name."""
    stages = Path(path) / "stages"
    return {f.stem: _load_pt(f) for f in sorted(stages.glob("*.pt"))} if stages.is_dir() else {}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles ``torch.distributed.checkpoint`` metadata and nothing else (no code runs)."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            module in ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
            or (module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)))
            or (module, name) in {("torch.serialization", "_get_layout"), ("pathlib", "PosixPath")}
            or (module, name) == ("collections", "OrderedDict")
        )
        if not allowed:
            raise pickle.UnpicklingError(f"sharded checkpoint metadata refers to {module}.{name}")
        return super().find_class(module, name)


class SafeShardReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is unpickled with an allow-list (torch's uses pickle)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with self.fs.create_stream(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except Exception as exc:  # noqa: BLE001
            raise CheckpointError(f"{path}: cannot be loaded safely ({type(exc).__name__}: {exc})") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` whose non-tensor items load with ``weights_only=True``."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            _set_at(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _set_at(state: dict[str, Any], path: tuple[str | int, ...], value: Any) -> None:
    """Put ``value`` at ``path`` (dict keys and list indices) of the nested ``state``. The path
    exists: the planner reads only the items of the state dict it was given, whose flattening
    produced ``path``. (torch's own helper for this is private.)"""
    for key in path[:-1]:
        state = state[key]
    state[path[-1]] = value
