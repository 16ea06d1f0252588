"""Process groups over a worker group's replicas (the ranks of a data-parallel stage).

The launcher gives each multi-replica group a :class:`Rendezvous`; a stage that needs collectives
asks its :class:`~rlinf_lightning.flow.stage.StageContext` for the group (every replica must), and
gets a ``torch.distributed`` process group whose ranks are exactly the plan's replicas:

- replicas that are processes (``processes`` and ``ray`` launchers) meet at a TCP store hosted by
  replica 0 and initialise the default (world) group: gloo on CPU, NCCL on GPU. FSDP2 and
  ``torch.distributed.checkpoint`` work there.
- replicas that are threads of one process (``inprocess`` launcher) share an in-memory store and
  each builds its own gloo group object, since a process has only one default group. Enough for
  gradient all-reduce (``ddp``), not for FSDP.

Sums of CPU tensors between replicas on one machine go through shared memory instead
(:class:`SharedSum`: each replica writes its slot, one barrier, each adds the slots up in the same
order), several times faster than gloo's loopback TCP for the gradient all-reduce of a
data-parallel actor, and bitwise identical on every replica.

Every collective waits at most the run's ``timeout_s``.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any


@dataclass
class Rendezvous:
    """Where a group's replicas meet: a TCP store at ``host:port`` (hosted by replica 0), or an
    in-process ``store`` shared by thread replicas."""

    name: str
    host: str = "127.0.0.1"
    port: int = 0
    store: Any = None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host`` (the store binds it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def node_address() -> str:
    """This machine's address as other nodes of a cluster reach it."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return socket.gethostbyname(socket.gethostname())


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def init_group(ctx: Any) -> Any:
    """The process group of ``ctx``'s replicas (see the module docstring)."""
    import torch.distributed as dist

    rv: Rendezvous | None = ctx.rendezvous
    if rv is None:
        raise RuntimeError("this group has several replicas but its launcher gave it no rendezvous")
    timeout = timedelta(seconds=ctx.timeout_s)
    if rv.store is not None:  # thread replicas: a private gloo group each, on the shared store
        store = dist.PrefixStore(rv.name, rv.store)
        return dist.ProcessGroupGloo(store, ctx.replica, ctx.replicas, timeout)
    store = dist.TCPStore(rv.host, rv.port, ctx.replicas, is_master=ctx.replica == 0, timeout=timeout)
    dist.init_process_group(
        backend_for(ctx.device), store=store, rank=ctx.replica, world_size=ctx.replicas, timeout=timeout
    )
    return dist.group.WORLD


def private_group(rv: Rendezvous, rank: int, size: int, device: str, timeout_s: float) -> Any:
    """A process group object of its own (not the default group), e.g. between the actor's first
    replica and the rollout's replicas for a weight broadcast: NCCL on GPU, gloo on CPU."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if rv.store is not None:
        store = dist.PrefixStore(rv.name, rv.store)
    else:
        store = dist.TCPStore(rv.host, rv.port, size, is_master=rank == 0, timeout=timeout)
    if backend_for(device) == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


BUCKET_BYTES = 64 * 2**20  # a broadcast moves at most this much at once (one flat buffer per bucket)


def buckets(meta: list[tuple[str, tuple, Any]]) -> list[list[int]]:
    """Indices of ``(name, shape, dtype)`` entries grouped into same-dtype runs of at most
    ``BUCKET_BYTES`` (an entry larger than that is a bucket of its own). Sender and receivers
    compute the same buckets from the same list."""
    import torch

    out: list[list[int]] = []
    size, dtype = 0, None
    for i, (_, shape, dt) in enumerate(meta):
        n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dt).element_size()
        if out and dt == dtype and size + n <= BUCKET_BYTES:
            out[-1].append(i)
            size += n
        else:
            out.append([i])
            size, dtype = n, dt
    return out


def broadcast_tensors(group: Any, tensors: list[Any] | None, meta: list[tuple], device: str) -> list[Any]:
    """Rank 0 sends ``tensors``; every other rank receives tensors shaped as ``meta`` on ``device``.
    One broadcast per bucket of a flat buffer. Returns the tensors (rank 0: its own)."""
    import torch
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    out: list[Any] = list(tensors) if tensors is not None else [None] * len(meta)
    for idx in buckets(meta):
        shapes = [torch.Size(meta[i][1]) for i in idx]
        if tensors is not None:
            flat = torch.cat([tensors[i].detach().reshape(-1) for i in idx]).to(device)
        else:
            flat = torch.empty(sum(s.numel() for s in shapes), dtype=meta[idx[0]][2], device=device)
        group.broadcast([flat], opts).wait()
        if tensors is None:
            for i, shape, piece in zip(idx, shapes, flat.split([s.numel() for s in shapes])):
                out[i] = piece.view(shape)
    return out


def destroy_group(ctx: Any, group: Any) -> None:
    import torch.distributed as dist

    if ctx.rendezvous is not None and ctx.rendezvous.store is None and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce(group: Any, tensors: list[Any], op: str = "sum") -> None:
    """Reduce ``tensors`` in place over ``group`` (no-op for ``None``, a one-replica group).

    Works on both kinds of group: the default group (own processes) and a private gloo group
    (threads), through the process-group object's own ``allreduce``.
    """
    if group is None:
        return
    import torch.distributed as dist

    if group is dist.group.WORLD:
        group = dist.distributed_c10d._get_default_group()
    opts = dist.AllreduceOptions()
    opts.reduceOp = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
    group.allreduce(tensors, opts).wait()


SHM_DIR = "/dev/shm"


class SharedSum:
    """In-place sum of a CPU tensor over the replicas of one machine, through a shared file.

    The file holds two buffers of one slot per replica (alternating between calls, so one barrier
    per call suffices: a replica can only overwrite a buffer after every replica passed the next
    call's barrier, i.e. finished reading it). It is unlinked as soon as every replica mapped it,
    so nothing is left in ``/dev/shm`` however the run ends.
    """

    def __init__(self, ctx: Any, group: Any, numel: int, dtype: Any) -> None:
        self.ctx, self.group, self.numel, self.dtype = ctx, group, numel, dtype
        self.buf: Any = None
        self.calls = 0

    @staticmethod
    def available() -> bool:
        return os.path.isdir(SHM_DIR)

    def _barrier(self) -> None:
        import torch

        all_reduce(self.group, [torch.zeros(1)])

    def _map(self) -> None:
        """Replica 0 makes the file, every replica maps it, replica 0 unlinks it (two barriers)."""
        import torch

        rv, replicas = self.ctx.rendezvous, self.ctx.replicas
        tag = rv.port if rv.store is None else id(rv.store)
        name = f"rlinf-sum-{os.getuid()}-{rv.name}-{tag}-{str(self.dtype)[6:]}-{self.numel}"
        path = os.path.join(SHM_DIR, name)
        size = 2 * replicas * self.numel
        if self.ctx.replica == 0:
            with open(path, "wb") as f:
                f.truncate(size * torch.empty((), dtype=self.dtype).element_size())
        self._barrier()
        self.buf = torch.from_file(path, shared=True, size=size, dtype=self.dtype).view(2, replicas, -1)
        self._barrier()
        if self.ctx.replica == 0:
            os.unlink(path)

    def __call__(self, t: Any) -> None:
        import torch

        if self.buf is None:
            self._map()
        slots = self.buf[self.calls % 2]
        self.calls += 1
        slots[self.ctx.replica].copy_(t.reshape(-1))
        self._barrier()
        torch.sum(slots, dim=0, out=t.view(-1))
