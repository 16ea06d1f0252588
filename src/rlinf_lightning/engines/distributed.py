"""Data-parallel train engines whose ranks are the actor group's replicas: ``ddp`` and ``fsdp``.

Each replica of the worker group hosting the actor runs one rank (the plan decides how many and on
which slots; the engine starts no process of its own). A rank backpropagates the *sum* of its
micro-batches' token losses; ``step`` adds up gradients, token counts and loss sums over the ranks
and divides once by the global count, so ``ddp`` and ``fsdp`` on N replicas equal ``single`` on
one, whichever replica got which micro-batch.

- ``ddp``: every rank holds the full model; gradients are summed at ``step`` over the group
  (``StageContext.all_reduce``: shared memory between CPU replicas of one machine, else the
  group's process group, gloo or NCCL). Checkpoints are the full state (every rank holds it).
- ``fsdp``: ``torch.distributed.fsdp.fully_shard`` on each repeated block (a decoder's layers:
  ``policies.module.repeated_blocks``) and the root, so each rank holds 1/N of parameters,
  gradients and optimizer state (bf16 compute on GPU). Its forward and
  backward passes are collectives, so every rank must run the same number of them: micro-batches
  are kept until ``step``, where the ranks agree on the largest count and a rank with fewer runs
  zero-weighted passes over a template row. Needs one process per replica (``processes`` or
  ``ray`` launcher). Checkpoints: ``torch.distributed.checkpoint`` shards, loadable on any rank count.

Rank memory: glibc serves a freed buffer's size from its heap from then on (its mmap threshold
grows with every large free, up to 32 MiB), and FSDP allocates and frees a layer-sized all-gather
and reduce-scatter buffer per layer per pass, so a rank's heap fragments and its resident memory
grows far past its live tensors (past the whole model's in one process: docs/benchmarks.md).
An fsdp rank that is its own process therefore fixes the process's mmap threshold
(``malloc_mmap_threshold_mb``, 4 MiB by default): every buffer at least that large is mapped on
allocation and returned to the OS on free. A ddp rank makes no such buffers, so by default it keeps
the launcher's setting (:mod:`rlinf_lightning.malloc`, as ``single`` does): at 4 MiB every larger
activation and bf16 weight copy is faulted in again each pass, which is markedly slower
(docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from typing import Any

import torch
from tensordict import TensorDict

from rlinf_lightning.engines.precision import autocast
from rlinf_lightning.engines.train import TRAIN_ENGINES, LossFn, SingleTrainEngine
from rlinf_lightning.flow.metrics import Metrics
from rlinf_lightning.flow.stage import StageContext
from rlinf_lightning.malloc import set_mmap_threshold
from rlinf_lightning.policies.lora import attach_lora, lora_of
from rlinf_lightning.policies.module import RLModule, repeated_blocks


@TRAIN_ENGINES.register("ddp")
class DDPTrainEngine(SingleTrainEngine):
    """Data parallel over the actor group's replicas: full replicas, gradients summed at ``step``.

    Args:
        malloc_mmap_threshold_mb: glibc mmap threshold fixed in a rank that is its own process, in
            MiB (at most 32); ``None`` (ddp's default) keeps the launcher's. See the module docstring.
    """

    name = "ddp"

    def __init__(self, malloc_mmap_threshold_mb: float | None = None) -> None:
        if malloc_mmap_threshold_mb is not None and not 0 < malloc_mmap_threshold_mb <= 32:
            raise ValueError(
                f"train engine {self.name!r}: malloc_mmap_threshold_mb must be in (0, 32] MiB or None, "
                f"got {malloc_mmap_threshold_mb}"
            )
        self.malloc_mmap_threshold_mb = malloc_mmap_threshold_mb

    def check(self, replicas: int, own_process: bool) -> tuple[str, str] | None:
        return None

    def setup(self, policy: RLModule, ctx: StageContext, precision: str = "32-true") -> None:
        if ctx.own_process and self.malloc_mmap_threshold_mb is not None:
            set_mmap_threshold(self.malloc_mmap_threshold_mb)
        super().setup(policy, ctx, precision)

    def _reduce(self, params: list[torch.nn.Parameter], totals: torch.Tensor) -> None:
        self.ctx.all_reduce([totals])  # the group is made on first use (thread replicas set up one by one)
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():  # one flat buffer per dtype: one collective, not one per tensor
            flat = torch.cat([g.reshape(-1) for g in grads])
            self.ctx.all_reduce([flat])
            for g, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(reduced)


@TRAIN_ENGINES.register("fsdp")
class FSDPTrainEngine(DDPTrainEngine):
    """FSDP2 (``fully_shard``) over the actor group's replicas: parameters, gradients and Adam
    state sharded; micro-batches run in lockstep at ``step`` (see the module docstring).

    Args:
        malloc_mmap_threshold_mb: as ddp's, but 4 MiB by default: what keeps an fsdp rank's heap
            from fragmenting (see the module docstring).
    """

    name = "fsdp"

    def __init__(self, malloc_mmap_threshold_mb: float | None = 4.0) -> None:
        super().__init__(malloc_mmap_threshold_mb)

    def check(self, replicas: int, own_process: bool) -> tuple[str, str] | None:
        if replicas > 1 and not own_process:
            return (
                "trainer.launcher",
                f"train_engine 'fsdp' over {replicas} replicas needs one process per replica: "
                "use launcher 'processes' or 'ray' (or train_engine 'ddp')",
            )
        return None

    def setup(self, policy: RLModule, ctx: StageContext, precision: str = "32-true") -> None:
        import torch.distributed as dist
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if ctx.own_process and self.malloc_mmap_threshold_mb is not None:
            set_mmap_threshold(self.malloc_mmap_threshold_mb)
        self.policy, self.ctx, self.precision = policy, ctx, precision
        self.group = ctx.process_group()
        self._own_world = False
        cuda = ctx.device.startswith("cuda")
        if self.group is None and not dist.is_initialized():  # one rank: a world of one
            # fully_shard's collectives run on the parameters' device: NCCL for CUDA tensors (gloo
            # has no reduce-scatter of them), gloo for the CPU-side counts exchanged at step
            backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            self._own_world = True
        policy.configure_model()
        attach_lora(policy)
        policy.train()
        if cuda and torch.device(ctx.device).index is not None:
            torch.cuda.set_device(torch.device(ctx.device))
        # fully_shard moves each layer to the device as it shards it: a GPU never holds the whole
        # model, only one layer in full besides its shards. bf16-mixed on a GPU is FSDP's mixed
        # precision (float32 sharded master weights, bf16 gathered for compute, gradients reduced in
        # float32); on CPU, where gloo reduces no bf16, it is autocast around each pass
        if precision == "bf16-true":
            policy.to(dtype=torch.bfloat16)
        self._autocast = precision if not (cuda and precision == "bf16-mixed") else "32-true"
        kw = (
            {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
            if cuda and precision == "bf16-mixed"
            else {}
        )
        for layer in repeated_blocks(policy.model):
            fully_shard(layer, **kw)
        fully_shard(policy.model, **kw)  # the root: forward_logprobs calls the model's forward
        policy.to(ctx.device)  # what lies outside the sharded model
        self._start_training()
        self._pending: list[tuple[TensorDict, LossFn]] = []

    def accumulate(self, batch: TensorDict, loss_fn: LossFn) -> dict[str, float]:
        self._count_flops(batch)
        self._pending.append((batch, loss_fn))  # passes run in lockstep at step()
        return {}

    def _in_lockstep(self, items: list[tuple[TensorDict, Any]]) -> Iterator[tuple[TensorDict, Any, bool]]:
        """``(batch, fn, real)`` for as many passes as the rank with the most ``items`` has: every
        forward of a sharded model is a collective, so a rank with fewer joins with a borrowed row
        (``real`` False; a rank with none borrows it from a rank that has some)."""
        import torch.distributed as dist

        world = dist.get_world_size()
        counts = torch.tensor([len(items)], dtype=torch.long)
        gathered = [torch.zeros_like(counts) for _ in range(world)]
        dist.all_gather(gathered, counts)
        counts_all = [int(c) for c in gathered]
        template = [(items[0][0][:1], items[0][1]) if items else None]
        if min(counts_all) == 0 < max(counts_all):
            dist.broadcast_object_list(template, src=next(r for r, c in enumerate(counts_all) if c))
        for i in range(max(counts_all)):
            real = i < len(items)
            batch, fn = items[i] if real else template[0]
            yield batch.to(self.ctx.device), fn, real

    def _lockstep(self) -> Metrics:
        """Every rank runs as many forward/backward passes as the rank with the most micro-batches."""
        metrics = Metrics()
        for batch, fn, real in self._in_lockstep(self._pending):
            with autocast(self._autocast, self.ctx.device):
                loss_sum, count, m = fn(self.policy, batch)
            if not real:  # join the collectives with a zero loss
                loss_sum, count = loss_sum * 0.0, 0
            loss_sum.backward()
            if real:
                self._count += float(count)
                self._loss_sum += float(loss_sum.detach())
                for k, v in m.items():
                    metrics.mean(k, float(v), len(batch))
        self._pending = []
        return metrics

    def forward_all(self, batches: list[TensorDict], fn: Any) -> list[Any]:
        out = []
        with torch.no_grad(), autocast(self._autocast, self.ctx.device):
            for batch, f, real in self._in_lockstep([(b, fn) for b in batches]):
                result = f(self.policy, batch)
                if real:
                    out.append(result)
        return out

    def _reduce(self, params: list[torch.nn.Parameter], totals: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.all_reduce(totals)  # gradients were reduce-scattered in backward (averaged over ranks)
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            else:
                p.grad.mul_(dist.get_world_size())  # back to sums (gloo has no PREMUL_SUM)

    def step(self) -> Metrics:
        return self._lockstep().merge(super().step())

    def named_weights(self, names: Collection[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        for name, p in self.policy.model.named_parameters():
            if names is not None and name not in names:
                continue
            t = p.detach()
            if hasattr(t, "full_tensor"):
                t = t.full_tensor()  # every rank takes part in the all-gather of this one tensor
            yield name, t.to("cpu", copy=True)  # a snapshot: the parameter keeps training

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model, optim = get_state_dict(self.policy.model, self.optimizer, options=opts)
        if lora_of(self.policy):  # the frozen base is not part of the training state
            trainable = {n for n, p in self.policy.model.named_parameters() if p.requires_grad}
            model = {k: v for k, v in model.items() if k in trainable}
        return self._with_scheduler({"model": model, "optimizer": optim})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        set_state_dict(
            self.policy.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=StateDictOptions(
                full_state_dict=True, broadcast_from_rank0=True, strict=not lora_of(self.policy)
            ),
        )
        self._load_scheduler(state)

    def _dcp_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.policy.model, self.optimizer)
        return self._with_scheduler({"model": model, "optimizer": optim})

    def save_sharded(self, path: str) -> None:
        """Each rank writes its shards with ``torch.distributed.checkpoint`` (a collective)."""
        import torch.distributed.checkpoint as dcp

        dcp.save(self._dcp_state(), checkpoint_id=path)

    def load_sharded(self, path: str) -> None:
        """Load shards written with any number of ranks (a collective)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        from rlinf_lightning.checkpoint import SafeLoadPlanner, SafeShardReader

        state = self._dcp_state()
        dcp.load(state, storage_reader=SafeShardReader(path), planner=SafeLoadPlanner())
        set_state_dict(
            self.policy.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )
        self._load_scheduler(state)

    def state_bytes(self) -> int:
        """Bytes of parameters, gradients and optimizer state this rank holds (local shards)."""

        def local(t: torch.Tensor) -> torch.Tensor:
            return t.to_local() if hasattr(t, "to_local") else t

        def nbytes(tensors) -> int:
            return sum(local(t).numel() * local(t).element_size() for t in tensors)

        params = nbytes(self.policy.parameters())
        grads = nbytes(p for p in self.policy.parameters() if p.requires_grad)  # held from backward to step
        moments = [v for st in self.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
        optim = nbytes(v for v in moments if v.dim())
        return params + grads + optim

    def shutdown(self) -> None:
        import torch.distributed as dist

        if self._own_world and dist.is_initialized():
            dist.destroy_process_group()
            self._own_world = False
