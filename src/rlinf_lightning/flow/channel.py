"""Channel: a FIFO queue of messages between workers, one transport per placement.

The transport is chosen from the plan (adaptive communication): stages on the same worker pass
objects through an in-process queue; stages in different processes on one machine use a
:class:`SharedMemoryChannel` (tensors travel as shared-memory handles, not pickled copies, and CUDA
tensors as CUDA IPC handles); the Ray launcher uses Ray's object store. Every ``get`` has a timeout
and stops early when the run is aborted, so a stalled producer or a failed peer becomes a clear
error, never a hang. How channels connect a group's replicas is ``flow.wiring``'s job.
"""

from __future__ import annotations

import pickle
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

# Default longest wait for a channel's next item (``trainer.timeout_s``): room for the slowest stage
# of a real model to produce its output, while a stalled run still ends in minutes.
DEFAULT_TIMEOUT_S = 600.0
ABORT_POLL_S = 0.05  # a waiting ``get`` notices that the run was aborted within this


class ChannelTimeout(TimeoutError):
    pass


class ChannelAborted(RuntimeError):
    """Raised in a waiting stage when another part of the run failed."""


class EndOfIteration:
    """Marker each producer replica sends after its last micro-batch of an iteration."""

    def __repr__(self) -> str:
        return "EndOfIteration()"


@dataclass
class Message:
    """A micro-batch and its routing header.

    ``key``: the micro-batch's index in the iteration's input, kept downstream (sticky stages are
    dealt by it); ``turn``: how many times it has been round a loop; ``origin``: the replica of the
    loop head that sent it, where the body's answer goes back.
    """

    payload: Any
    key: int = 0
    turn: int = 0
    origin: int = 0


class Channel:
    """In-process FIFO; the base of every transport."""

    transport = "object"

    def __init__(
        self, name: str, timeout_s: float = DEFAULT_TIMEOUT_S, abort: Any = None, q: Any = None
    ) -> None:
        self.name = name
        self.timeout_s = timeout_s
        self.abort = abort or threading.Event()
        self._q = q if q is not None else queue.Queue()

    def put(self, item: Any) -> None:
        self._q.put(item)

    def get(self, timeout: float | None = None) -> Any:
        """Next item; waits at most ``timeout`` (default: the channel's) and stops early on abort."""
        t = self.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + t
        while True:
            try:
                return self._q.get(timeout=min(ABORT_POLL_S, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                if self.abort.is_set():
                    raise ChannelAborted(f"channel {self.name!r}: run aborted") from None
                if time.monotonic() >= deadline:
                    raise ChannelTimeout(
                        f"channel {self.name!r}: nothing arrived within {t:.0f} s (trainer.timeout_s); "
                        "the stage feeding it is stuck or too slow for this timeout"
                    ) from None

    def poll(self, timeout: float = 0.0) -> tuple[bool, Any]:
        """``(True, item)`` if an item arrives within ``timeout`` s, else ``(False, None)``;
        raises :class:`ChannelAborted` when the run was aborted."""
        try:
            return True, (self._q.get(timeout=timeout) if timeout > 0 else self._q.get_nowait())
        except queue.Empty:
            if self.abort.is_set():
                raise ChannelAborted(f"channel {self.name!r}: run aborted") from None
            return False, None

    def empty(self) -> bool:
        return self._q.empty()


class SharedMemoryChannel(Channel):
    """Between processes of one machine: a ``torch.multiprocessing`` queue.

    Tensors of at least ``shm_min_bytes`` (also inside a ``TensorDict``) are moved into shared
    memory and only their handles cross the pipe; smaller ones are pickled inline, since a
    shared-memory segment per tiny tensor costs more than copying it. Items are pickled in
    ``put`` itself, so an unpicklable item fails there, in the sender, instead of vanishing in
    the queue's feeder thread. ``copy=True`` copies tensors that alias live state (weights the
    sender keeps updating), so the receiver sees the values as of ``put``.
    """

    transport = "shared-memory"

    def __init__(
        self,
        name: str,
        timeout_s: float,
        abort: Any,
        mp_context: Any,
        copy: bool = False,
        shm_min_bytes: int = 64 * 1024,
    ) -> None:
        super().__init__(name, timeout_s, abort, mp_context.Queue())
        self.copy, self.shm_min_bytes = copy, shm_min_bytes

    def put(self, item: Any) -> None:
        self._q.put(encode(item, self.copy, self.shm_min_bytes))

    def get(self, timeout: float | None = None) -> Any:
        return decode(super().get(timeout))

    def poll(self, timeout: float = 0.0) -> tuple[bool, Any]:
        got, item = super().poll(timeout)
        return (True, decode(item)) if got else (False, None)


def encode(item: Any, copy: bool = False, shm_min_bytes: int = 64 * 1024) -> bytes:
    """Bytes for a pipe: small parts pickled inline, large tensors as shared-memory handles.

    A ``TensorDict`` travels as its plain parts (batch size, device, and a dict of tensors and
    lists for its non-tensor entries, nested ones alike) and is rebuilt on arrival: pickling the
    ``TensorDict`` object itself costs about 1 ms a micro-batch, its parts (small tensors as NumPy
    arrays) a fifth of that.
    """
    if isinstance(item, Message):
        header = (item.key, item.turn, item.origin)
        return pickle.dumps(("msg", header, encode(item.payload, copy, shm_min_bytes)))
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers the shared-memory tensor reductions)
    from tensordict import TensorDictBase

    def share(t: torch.Tensor) -> torch.Tensor:
        if copy:
            return t.detach().clone().share_memory_()
        return t if t.is_shared() else t.share_memory_()

    if isinstance(item, TensorDictBase):
        small, large = _parts(item, shm_min_bytes)
        shared = {k: share(v) for k, v in large.items()}
        return bytes(ForkingPickler.dumps(("td", pickle.dumps(small), shared)))
    if isinstance(item, torch.Tensor) and item.numel() * item.element_size() >= shm_min_bytes:
        return bytes(ForkingPickler.dumps(("shm", share(item))))
    return pickle.dumps(("obj", item))


# dtypes a tensor may cross as a NumPy array, which pickles far faster than the tensor object
# (docs/benchmarks.md, measurements behind choices in the code)
_NUMPY_DTYPES = {torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16,
                 torch.int8, torch.uint8, torch.bool}  # fmt: skip


def _parts(td: Any, shm_min_bytes: int, prefix: tuple = ()) -> tuple[dict, dict]:
    """``(small, large)``: the TensorDict as plain data, with the large tensors set apart (by key
    path) to travel through shared memory."""
    from tensordict import NonTensorData, NonTensorStack, TensorDictBase

    entries: dict[str, Any] = {}
    large: dict[tuple, torch.Tensor] = {}
    for k, v in td.items():
        if isinstance(v, NonTensorStack):
            entries[k] = ("list", v.tolist())
        elif isinstance(v, NonTensorData):
            entries[k] = ("data", v.data)
        elif isinstance(v, TensorDictBase):
            nested, nested_large = _parts(v, shm_min_bytes, (*prefix, k))
            entries[k] = ("td", nested)
            large.update(nested_large)
        elif v.numel() * v.element_size() >= shm_min_bytes:
            large[(*prefix, k)] = v
        elif v.device.type == "cpu" and v.dtype in _NUMPY_DTYPES and not v.requires_grad:
            entries[k] = ("numpy", v.numpy())
        else:
            entries[k] = ("tensor", v)
    return {"batch_size": tuple(td.batch_size), "device": td.device, "entries": entries}, large


def _rebuild(small: dict) -> Any:
    from tensordict import NonTensorData, TensorDict

    values: dict[str, Any] = {}
    for k, (kind, v) in small["entries"].items():
        if kind == "td":
            values[k] = _rebuild(v)
        elif kind == "numpy":
            values[k] = torch.from_numpy(v)
        elif kind == "data":
            values[k] = NonTensorData(v)
        else:
            values[k] = v  # a tensor, or a list TensorDict stacks into a NonTensorStack
    return TensorDict(values, batch_size=small["batch_size"], device=small["device"])


def decode(data: bytes) -> Any:
    kind, *rest = pickle.loads(data)
    if kind == "msg":
        (key, turn, origin), payload = rest
        return Message(decode(payload), key, turn, origin)
    if kind == "td":
        small, shared = rest
        td = _rebuild(pickle.loads(small))
        for path, t in shared.items():
            td.set(path, t)
        return td
    return rest[0]
