"""Train engines: how the actor's policy trains (``single`` here; ``ddp``/``fsdp`` register alike).

An engine runs in every replica of the actor's worker group; the replicas are its ranks. The actor
stage hands it micro-batches and a picklable ``loss_fn(policy, batch) -> (loss_sum, count,
metrics)``; the engine backpropagates the *sum*, and once per global batch (``step``) the ranks
add up their gradients and counts, divide once by the global count, clip by the global norm and
step. Summing first and dividing once makes the update independent of how the batch was split
into micro-batches and over replicas, so every plan computes the same update.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict

from rlinf_lightning.engines.flops import peak_matmul_flops
from rlinf_lightning.engines.offload import Offloader
from rlinf_lightning.engines.precision import autocast, param_dtype
from rlinf_lightning.flow.metrics import Metrics
from rlinf_lightning.flow.stage import StageContext
from rlinf_lightning.policies.lora import attach_lora, load_trainable_state, lora_of, trainable_state
from rlinf_lightning.policies.module import RLModule
from rlinf_lightning.registry import Registry

LossFn = Callable[[RLModule, TensorDict], tuple]


@dataclass(frozen=True)
class TrainSpec:
    """How a learning stage trains: the trainer's ``train_engine`` (an engine name),
    ``train_engine_options``, ``precision`` (see ``engines.precision``), ``compile``, and what it
    does with a non-finite step (``on_nonfinite``: ``skip`` or ``stop``; under ``skip`` the run
    stops after ``max_consecutive_nonfinite`` skipped steps in a row)."""

    engine: str = "auto"
    options: dict[str, Any] = field(default_factory=dict)
    precision: str = "32-true"
    compile: bool = False
    on_nonfinite: str = "skip"
    max_consecutive_nonfinite: int = 3


class TrainEngine:
    """Interface: ``setup`` -> (``accumulate`` ...) -> ``step`` per global batch, on every rank."""

    def check(self, replicas: int, own_process: bool) -> tuple[str, str] | None:
        """``(config key, problem)`` if this engine cannot train over ``replicas`` replicas."""
        return None

    def setup(self, policy: RLModule, ctx: StageContext) -> None:
        raise NotImplementedError

    def accumulate(self, batch: TensorDict, loss_fn: LossFn) -> dict[str, float]:
        """Backward of the loss sum of ``batch``; returns the micro-batch's metrics (e.g. clip_frac)."""
        raise NotImplementedError

    def step(self) -> Metrics:
        """One optimizer step over everything accumulated on every rank; returns ``grad_norm`` and
        the global ``loss`` (loss sum over count), among others. A step whose global loss or
        gradient norm is not finite is not taken: the gradients are dropped and :attr:`nonfinite`
        names the culprit until the next step (every rank agrees: both are global)."""
        raise NotImplementedError

    #: ``"loss"`` or ``"grad_norm"`` when the last :meth:`step` was skipped as non-finite, else ``None``
    nonfinite: str | None = None

    def forward_all(self, batches: list[TensorDict], fn: Callable[[RLModule, TensorDict], Any]) -> list[Any]:
        """``fn(policy, batch)`` for each batch without gradient, with the current weights (e.g. the
        behaviour log-probs before the first of several steps; a collective where sharded)."""
        raise NotImplementedError

    def shutdown(self) -> None:
        """Release what ``setup`` acquired; safe to call twice."""

    def compile(self) -> None:
        """Run the policy's training forward (and with it, through AOTAutograd, its backward) under
        ``torch.compile`` (:meth:`RLModule.compile_model`); the compile itself happens at the first
        micro-batch of each new shape and is reported per step as ``compile_s``."""
        self.policy.compile_model()
        self._compile_mark = compile_seconds()

    def onload(self) -> None:
        """Bring weights and optimizer state back onto the device (collocated context switch)."""

    def offload(self) -> None:
        """Move weights and optimizer state off the device while other stages run."""

    def named_weights(self, names: Collection[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) weights, one tensor at a time (a collective where sharded: every rank);
        only those in ``names`` when given (a LoRA actor's sync skips the frozen base)."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """The full, rank-count independent state (a collective where sharded: every rank)."""
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError


TRAIN_ENGINES: Registry[type[TrainEngine]] = Registry("train engine")


def compile_seconds() -> float:
    """Seconds ``torch.compile`` has spent in this process so far: Dynamo's frame compiles (the
    forward graphs, lowered by Inductor inside them) plus the backward graphs compiled lazily at
    the first backward (``torch._dynamo.utils.compilation_time_metrics``; torch has no public
    counter of this). Only these two outermost timers: a graph with dynamic shapes (a micro-batch's
    second shape) has its backward compiled inside the frame's compile, not lazily, so adding
    Inductor's own ``bw_compiler`` timer would count that backward twice."""
    from torch._dynamo.utils import compilation_time_metrics as spent

    return sum(spent.get("_compile.compile_inner", [])) + sum(spent.get("backward._backward_impl", []))


def split_optimizers(configured: Any) -> tuple[torch.optim.Optimizer, Any]:
    """``(optimizer, lr_scheduler or None)`` from what ``configure_optimizers`` returned, in
    Lightning's forms: an optimizer; ``{"optimizer": opt, "lr_scheduler": sched}`` (``sched`` may be
    ``{"scheduler": sched, ...}``); or ``([opt], [sched])``. RL trains one optimizer, stepped once
    per iteration (or ``ppo_epochs x num_mini_batches`` times), and the scheduler steps with it."""
    if isinstance(configured, torch.optim.Optimizer):
        return configured, None
    if isinstance(configured, dict) and "optimizer" in configured:
        sched = configured.get("lr_scheduler")
        return configured["optimizer"], sched["scheduler"] if isinstance(sched, dict) else sched
    if isinstance(configured, (tuple, list)) and len(configured) == 2 and len(configured[0]) == 1:
        scheds = configured[1]
        sched = scheds[0] if scheds else None
        return configured[0][0], sched["scheduler"] if isinstance(sched, dict) else sched
    raise TypeError(
        "configure_optimizers() must return an optimizer, {'optimizer': ..., 'lr_scheduler': ...} or "
        f"([optimizer], [lr_scheduler]); got {type(configured).__name__}"
    )


def resolve_train_engine(name: str, replicas: int) -> str:
    """``auto`` is ``single`` on one replica and ``ddp`` on more; other names are themselves."""
    if name == "auto":
        return "single" if replicas == 1 else "ddp"
    return name


def build_train_engine(name: str, replicas: int, options: dict[str, Any]) -> TrainEngine:
    """The registered engine ``name`` (``auto`` resolved for ``replicas``) with ``options``.
    Building acquires nothing: that is ``setup``'s job on each rank."""
    return TRAIN_ENGINES.get(resolve_train_engine(name, replicas))(**options)


@TRAIN_ENGINES.register("single")
class SingleTrainEngine(TrainEngine):
    """One replica of the model; the base of the data-parallel engines, which add ``_reduce``."""

    name = "single"

    def check(self, replicas: int, own_process: bool) -> tuple[str, str] | None:
        if replicas > 1:
            return (
                "trainer.train_engine",
                f"'single' trains one replica, but the plan runs the actor on {replicas} replicas; "
                "use 'ddp', 'fsdp' or 'auto'",
            )
        return None

    def setup(self, policy: RLModule, ctx: StageContext, precision: str = "32-true") -> None:
        self.policy, self.ctx, self.precision = policy, ctx, precision
        policy.configure_model()
        attach_lora(policy)
        policy.to(ctx.device, dtype=param_dtype(precision))
        policy.train()
        self._start_training()
        self._offloader = Offloader(ctx.device)

    def _start_training(self) -> None:
        """The end of set-up on every engine: the optimizer, the step's counters, and this device's
        peak in the training dtype, measured now (part of the workers' start-up, not of the first
        step, where it would be charged to the first iteration and to auto's profile of it)."""
        self.optimizer, self.scheduler = split_optimizers(self.policy.configure_optimizers())
        self.optimizer.zero_grad(set_to_none=True)
        self._count, self._loss_sum, self._flops = 0.0, 0.0, 0.0
        self.peak_flops()

    def peak_flops(self) -> float:
        """This device's peak in the training dtype with torch's current threads (measured once
        per process and thread count)."""
        dtype = torch.bfloat16 if self.precision.startswith("bf16") else torch.float32
        return peak_matmul_flops(self.ctx.device, dtype, torch.get_num_threads())

    def _count_flops(self, batch: TensorDict) -> None:
        flops = self.policy.train_flops(batch)
        if flops is not None:
            self._flops += flops

    def _record_flops(self, metrics: Metrics) -> None:
        """This step's model FLOPs (summed over steps and replicas, per second as
        ``perf/flops_per_s``) and this device's measured peak in the training dtype: with the train
        stage's busy seconds, the trainer's ``perf/mfu``."""
        if not self._flops:
            return
        metrics.sum("flops_total", self._flops)
        metrics.mean("peak_flops", self.peak_flops())
        self._flops = 0.0

    def onload(self) -> None:
        self._offloader.onload(self.policy, self.optimizer)

    def offload(self) -> None:
        self._offloader.offload(self.policy, self.optimizer)

    def accumulate(self, batch: TensorDict, loss_fn: LossFn) -> dict[str, float]:
        self._count_flops(batch)
        batch = batch.to(self.ctx.device)  # channels carry host tensors; the policy is on the device
        with autocast(self.precision, self.ctx.device):
            loss_sum, count, metrics = loss_fn(self.policy, batch)
        loss_sum.backward()
        self._count += float(count)
        self._loss_sum += float(loss_sum.detach())
        return {k: float(v) for k, v in metrics.items()}

    def forward_all(self, batches: list[TensorDict], fn: Callable[[RLModule, TensorDict], Any]) -> list[Any]:
        with torch.no_grad(), autocast(self.precision, self.ctx.device):
            return [fn(self.policy, b.to(self.ctx.device)) for b in batches]

    def _reduce(self, params: list[torch.nn.Parameter], totals: torch.Tensor) -> None:
        """Sum gradients and ``totals`` (count, loss sum) over the ranks; one rank: nothing to do."""

    def step(self) -> Metrics:
        params = [p for p in self.policy.parameters() if p.requires_grad]
        totals = torch.tensor([self._count, self._loss_sum], dtype=torch.float64)
        self._reduce(params, totals)
        count, loss_sum = totals.tolist()
        for p in params:
            if p.grad is not None:
                p.grad.div_(max(count, 1.0))
        max_norm = getattr(self.policy, "max_grad_norm", 0.0) or float("inf")
        with_grad = [p for p in params if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(with_grad, max_norm) if with_grad else torch.tensor(0.0)
        if hasattr(grad_norm, "full_tensor"):  # sharded parameters: the norm over every shard
            grad_norm = grad_norm.full_tensor()
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step used
        loss = loss_sum / max(count, 1.0)
        self.nonfinite = next(
            (name for name, v in (("loss", loss), ("grad_norm", float(grad_norm))) if not math.isfinite(v)),
            None,
        )
        if self.nonfinite is None:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None and self.nonfinite is None:  # step-wise schedules
            self.scheduler.step()
        self._count, self._loss_sum = 0.0, 0.0
        metrics = Metrics.of_means(self.policy.pop_logged(), 1.0)
        self._record_flops(metrics)
        if hasattr(self, "_compile_mark"):  # seconds torch.compile spent in this step's passes
            now = compile_seconds()
            metrics.sum("compile_s", now - self._compile_mark)
            self._compile_mark = now
        if self.nonfinite is None:  # a skipped step's NaN would hide the iteration's other steps
            metrics.mean("grad_norm", float(grad_norm))
            metrics.mean("loss", loss)
        metrics.mean("lr", lr)
        return metrics

    def named_weights(self, names: Collection[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        for name, p in self.policy.model.named_parameters():
            if names is None or name in names:
                yield name, p.detach()

    def state_dict(self) -> dict[str, Any]:
        """Weights (a LoRA policy's trainable tensors only: adapters and fully trained modules),
        optimizer and scheduler state."""
        model = self.policy.model
        weights = trainable_state(model) if lora_of(self.policy) else model.state_dict()
        return self._with_scheduler({"model": weights, "optimizer": self.optimizer.state_dict()})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if lora_of(self.policy):
            load_trainable_state(self.policy.model, state["model"])
        else:
            self.policy.model.load_state_dict(state["model"])
        # a copy: load_state_dict keeps the given tensors where dtype and device match, and thread
        # replicas are handed one loaded checkpoint, so they would step shared moments twice
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        self._load_scheduler(state)

    def _with_scheduler(self, state: dict[str, Any]) -> dict[str, Any]:
        return {**state, "lr_scheduler": self.scheduler.state_dict()} if self.scheduler is not None else state

    def _load_scheduler(self, state: dict[str, Any]) -> None:
        if self.scheduler is not None and state.get("lr_scheduler") is not None:
            self.scheduler.load_state_dict(state["lr_scheduler"])
