"""Data-parallel actor training over several ranks: ``ddp`` (replicated) and ``fsdp`` (FSDP2).

The actor stage lives in one worker, so the engine brings its own ranks: ``ranks`` spawned
processes (gloo on CPU, NCCL on GPU, one thread or one GPU each) form a process group, and the
engine in the actor's worker coordinates them. Each ``accumulate`` splits the micro-batch by rows
over the ranks (tensors travel through shared memory), every rank runs the same picklable loss on
its shard and backpropagates the *sum* of its token losses; ``step`` divides by the global token
count once, clips by the global norm and steps. Summing first and dividing once makes the update
independent of how the batch was split, so ``ddp`` and ``fsdp`` on N ranks equal ``single``.

- ``ddp``: every rank holds the full model; gradients are all-reduced (summed) at ``step``.
- ``fsdp``: ``torch.distributed.fsdp.fully_shard`` on each decoder layer and the root, so each rank
  holds 1/N of parameters, gradients and optimizer state (bf16 compute on GPU). Gradients are
  reduce-scattered as sums (divide factor 1).

Weights leave the ranks one tensor at a time (``named_weights``: each gathered, sent, dropped),
so syncing the rollout engine never holds a second full copy. Checkpoints: ``state_dict`` is the
full (rank-count independent) state for the trainer's checkpoint; ``save_sharded``/``load_sharded``
use ``torch.distributed.checkpoint`` (each rank writes its shard; reloadable on any rank count).
Ranks end with the process that started them if it is killed.

Rank memory: glibc serves a freed buffer's size from its heap from then on (its mmap threshold
grows with every large free, up to 32 MiB), and FSDP allocates and frees a layer-sized all-gather
and reduce-scatter buffer per layer per pass, so a rank's heap fragments and its resident memory
grows far past its live tensors (measured at ~100 M parameters: 3.1 GB peak per fsdp rank against
2.8 GB for the whole model in one process). The engine therefore fixes the rank processes' mmap
threshold (``malloc_mmap_threshold_mb``, 4 MiB by default): every buffer at least that large is
mapped on allocation and returned to the OS on free, and the peak drops to ~1.7 GB per rank at
some step-time cost (``benchmarks/train_engines.py`` prints both).
"""

from __future__ import annotations

import ctypes
import os
import platform
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.multiprocessing as mp
from tensordict import TensorDict

from rlinf_lightning.engines.train import TRAIN_ENGINES, TrainEngine
from rlinf_lightning.flow.channel import decode, encode
from rlinf_lightning.flow.lifetime import exit_with_parent
from rlinf_lightning.policies.module import RLModule


class RankError(RuntimeError):
    """A rank of a distributed train engine raised or died; carries its traceback."""

    def __init__(self, rank: int, tb: str) -> None:
        self.rank, self.tb = rank, tb
        super().__init__(f"train engine rank {rank} failed:\n{tb}")

    def __reduce__(self):
        return (RankError, (self.rank, self.tb))


# -- the rank processes ---------------------------------------------------------------------------


class _Rank:
    def __init__(self, rank: int, world: int, mode: str, policy: RLModule, store_path: str) -> None:
        import torch.distributed as dist

        self.rank, self.world, self.mode = rank, world, mode
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(rank % torch.cuda.device_count())
        else:
            torch.set_num_threads(1)
        self.device = torch.device(f"cuda:{torch.cuda.current_device()}" if cuda else "cpu")
        dist.init_process_group(
            "nccl" if cuda else "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world
        )
        self.rss_before_model_mb = _max_rss_mb()
        self.policy = policy
        policy.configure_model()
        policy.train()
        if mode == "fsdp":  # fully_shard moves each layer to the device as it shards it: a GPU never
            # holds the whole model, only one layer in full besides its shards
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mp_policy = (
                MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda else None
            )
            kw = {"mp_policy": mp_policy} if mp_policy else {}
            for layer in _decoder_layers(policy):
                fully_shard(layer, **kw)
            fully_shard(policy.model, **kw)  # the root: forward_logprobs calls the model's forward
        policy.to(self.device)  # ddp's replica; under fsdp, what lies outside the sharded model
        self.optimizer = policy.configure_optimizers()
        self.optimizer.zero_grad(set_to_none=True)

    def accumulate(self, shard: TensorDict, loss_fn: Callable, empty: bool) -> dict[str, float]:
        shard = shard.to(self.device)
        loss_sum, count, metrics = loss_fn(self.policy, shard)
        if empty:  # this rank had no rows: join the collectives with a zero loss
            loss_sum, count, metrics = loss_sum * 0.0, 0, {k: 0.0 for k in metrics}
        loss_sum.backward()
        return {
            "loss_sum": float(loss_sum.detach()),
            "count": float(count),
            **{k: float(v) for k, v in metrics.items()},
        }

    def step(self, total_count: float) -> dict[str, float]:
        import torch.distributed as dist

        params = [p for p in self.policy.parameters()]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if self.mode == "ddp":
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                p.grad.div_(max(total_count, 1.0))
            else:  # FSDP's reduce-scatter averaged over ranks (gloo has no PREMUL_SUM for sums)
                p.grad.mul_(self.world / max(total_count, 1.0))
        max_norm = getattr(self.policy, "max_grad_norm", 0.0) or float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": float(grad_norm)}

    def full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, p in self.policy.model.named_parameters():
            t = p.detach()
            if hasattr(t, "full_tensor"):
                t = t.full_tensor()  # every rank takes part in the all-gather of this one tensor
            yield name, t.to("cpu", copy=True)  # a snapshot: the parameter keeps training

    def full_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model, optim = get_state_dict(self.policy.model, self.optimizer, options=opts)
        return {"model": model, "optimizer": optim}

    def load_full_state(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        set_state_dict(
            self.policy.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
        )

    def _dcp_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.policy.model, self.optimizer)
        return {"model": model, "optimizer": optim}

    def save_sharded(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self._dcp_state(), checkpoint_id=path)

    def load_sharded(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self._dcp_state()
        dcp.load(state, checkpoint_id=path)
        set_state_dict(
            self.policy.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )

    def peak_rss_mb(self) -> tuple[float, float]:
        """Peak resident MB of this rank, and that peak above the rank's RSS before the model loaded."""
        peak = _max_rss_mb()
        return peak, peak - self.rss_before_model_mb

    def state_bytes(self) -> int:
        """Bytes of parameters, gradients and optimizer state this rank holds (local shards)."""

        def local(t: torch.Tensor) -> torch.Tensor:
            return t.to_local() if hasattr(t, "to_local") else t

        params = sum(local(p).numel() * local(p).element_size() for p in self.policy.parameters())
        optim = sum(
            local(v).numel() * local(v).element_size()
            for st in self.optimizer.state.values()
            for v in st.values()
            if torch.is_tensor(v) and v.dim()
        )
        return 2 * params + optim  # parameters, their gradients (held from backward to step), Adam state


def _max_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _decoder_layers(policy: RLModule) -> list[torch.nn.Module]:
    model = getattr(policy, "model", policy)
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    return list(layers) if layers is not None else []


def set_mmap_threshold(threshold_mb: float) -> None:
    """Fix glibc's mmap threshold for this process (``mallopt(M_MMAP_THRESHOLD)``; see the module doc).

    Raises where the C library is not glibc, since the setting would silently do nothing there.
    """
    if platform.libc_ver()[0] != "glibc":
        raise RuntimeError(
            f"malloc_mmap_threshold_mb={threshold_mb} needs glibc; this C library is "
            f"{platform.libc_ver()[0] or 'unknown'}: set malloc_mmap_threshold_mb=None"
        )
    m_mmap_threshold = -3
    if ctypes.CDLL(None).mallopt(m_mmap_threshold, int(threshold_mb * 2**20)) != 1:
        raise RuntimeError(f"mallopt(M_MMAP_THRESHOLD, {threshold_mb} MiB) was refused (the limit is 32 MiB)")


def _rank_main(
    rank: int,
    world: int,
    mode: str,
    policy: RLModule,
    store: str,
    commands: Any,
    replies: Any,
    parent: int,
    mmap_threshold_mb: float | None,
) -> None:
    exit_with_parent(parent)
    try:
        if mmap_threshold_mb is not None:
            set_mmap_threshold(mmap_threshold_mb)
        r = _Rank(rank, world, mode, policy, store)
    except BaseException:
        replies.put((rank, "error", traceback.format_exc()))
        return
    replies.put((rank, "ok", None))
    while True:
        cmd, args = commands.get()
        try:
            if cmd == "shutdown":
                import torch.distributed as dist

                dist.destroy_process_group()
                replies.put((rank, "ok", None))
                return
            if cmd == "accumulate":
                data, loss_fn, empty = args
                out: Any = r.accumulate(decode(data), loss_fn, empty)
            elif cmd == "weights":
                for name, t in r.full_tensors():
                    if rank == 0:
                        replies.put((rank, "tensor", (name, t)))
                out = None
            else:
                out = getattr(r, cmd)(*args)
            per_rank = ("accumulate", "step", "state_bytes", "peak_rss_mb")
            replies.put((rank, "ok", out if rank == 0 or cmd in per_rank else None))
        except BaseException:
            replies.put((rank, "error", traceback.format_exc()))


# -- the coordinator in the actor's worker ------------------------------------------------------------


class DistributedTrainEngine(TrainEngine):
    """Coordinates ``ranks`` rank processes (see the module docstring).

    Args:
        ranks: number of rank processes (the trainer passes ``devices x num_nodes``).
        timeout_s: longest wait for any rank's answer before the fit fails.
        malloc_mmap_threshold_mb: glibc mmap threshold fixed in the rank processes, in MiB (at most
            32); ``None`` keeps glibc's growing default. See the module docstring.
    """

    mode = "ddp"

    def __init__(
        self, ranks: int = 2, timeout_s: float = 600.0, malloc_mmap_threshold_mb: float | None = 4.0
    ) -> None:
        if ranks < 1:
            raise ValueError(f"train engine {self.mode!r}: ranks must be >= 1, got {ranks}")
        if malloc_mmap_threshold_mb is not None and not 0 < malloc_mmap_threshold_mb <= 32:
            raise ValueError(
                f"train engine {self.mode!r}: malloc_mmap_threshold_mb must be in (0, 32] MiB or None, "
                f"got {malloc_mmap_threshold_mb}"
            )
        self.ranks, self.timeout_s = ranks, timeout_s
        self.malloc_mmap_threshold_mb = malloc_mmap_threshold_mb
        self.procs: list[Any] = []

    def setup(self, policy: RLModule, device: str) -> None:
        ctx = mp.get_context("spawn")
        self._dir = tempfile.mkdtemp(prefix=f"rlinf-{self.mode}-")
        store = os.path.join(self._dir, "store")
        self.replies = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(self.ranks)]
        self.procs = [
            ctx.Process(
                target=_rank_main,
                args=(
                    *(r, self.ranks, self.mode, policy, store, self.commands[r], self.replies),
                    *(os.getpid(), self.malloc_mmap_threshold_mb),
                ),
                daemon=True,
                name=f"rlinf-{self.mode}-rank{r}",
            )
            for r in range(self.ranks)
        ]
        for p in self.procs:
            p.start()
        self._gather()
        self._count = 0.0

    # protocol ---------------------------------------------------------------------------------------
    def _next(self) -> tuple[int, str, Any]:
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return self.replies.get(timeout=0.2)
            except queue.Empty:
                for r, p in enumerate(self.procs):
                    if not p.is_alive():
                        raise RankError(r, f"rank process exited with code {p.exitcode}") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"train engine {self.mode!r}: no answer within {self.timeout_s} s"
                    ) from None

    def _gather(self) -> list[Any]:
        out: list[Any] = [None] * self.ranks
        pending = set(range(self.ranks))
        while pending:
            rank, status, value = self._next()
            if status == "error":
                raise RankError(rank, value)
            pending.discard(rank)
            out[rank] = value
        return out

    def _all(self, cmd: str, *args: Any) -> list[Any]:
        for q in self.commands:
            q.put((cmd, args))
        return self._gather()

    # TrainEngine ----------------------------------------------------------------------------------------
    def accumulate(self, batch: TensorDict, loss_fn: Callable) -> dict:
        n = len(batch)
        bounds = [n * r // self.ranks for r in range(self.ranks + 1)]
        for r, q in enumerate(self.commands):
            lo, hi = bounds[r], bounds[r + 1]
            empty = hi <= lo
            shard = batch[:1] if empty else batch[lo:hi]
            q.put(("accumulate", (encode(shard), loss_fn, empty)))
        results = self._gather()
        total = {"loss_sum": sum(m["loss_sum"] for m in results), "count": sum(m["count"] for m in results)}
        rows = [bounds[r + 1] - bounds[r] for r in range(self.ranks)]
        for k in results[0]:
            if k not in total:
                total[k] = sum(m[k] * w for m, w in zip(results, rows)) / max(n, 1)
        self._count += total["count"]
        return total

    def step(self) -> dict[str, float]:
        out = self._all("step", self._count)[0]
        self._count = 0.0
        return out

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for q in self.commands:
            q.put(("weights", ()))
        pending = set(range(self.ranks))
        while pending:
            rank, status, value = self._next()
            if status == "error":
                raise RankError(rank, value)
            if status == "tensor":
                yield value
            else:
                pending.discard(rank)

    def state_dict(self) -> dict[str, Any]:
        return self._all("full_state")[0]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._all("load_full_state", state)

    def save_sharded(self, path: str) -> None:
        """Each rank writes its shards with ``torch.distributed.checkpoint``; atomic (tmp + rename)."""
        tmp = f"{path}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        self._all("save_sharded", tmp)
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(tmp, path)

    def load_sharded(self, path: str) -> None:
        """Load a sharded checkpoint written with any number of ranks."""
        self._all("load_sharded", path)

    def state_bytes(self) -> list[int]:
        return self._all("state_bytes")

    def peak_rss_mb(self) -> list[tuple[float, float]]:
        """Per rank: peak resident MB, and that peak above the rank's RSS before the model loaded."""
        return self._all("peak_rss_mb")

    def shutdown(self) -> None:
        if not self.procs:
            return
        for p, q in zip(self.procs, self.commands):
            if p.is_alive():
                q.put(("shutdown", ()))
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        self.procs = []
        shutil.rmtree(self._dir, ignore_errors=True)

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass


@TRAIN_ENGINES.register("ddp")
class DDPTrainEngine(DistributedTrainEngine):
    """Data parallel over rank processes: full replicas, gradients summed once per global batch."""

    mode = "ddp"


@TRAIN_ENGINES.register("fsdp")
class FSDPTrainEngine(DistributedTrainEngine):
    """FSDP2 (``fully_shard``) over rank processes: parameters, gradients and Adam state sharded."""

    mode = "fsdp"
