"""TrainStage: a stage that trains a policy with a train engine whose ranks are its group's replicas.

What every learning stage shares, whatever its loss: building the engine named by
``train_engine`` for the replicas the plan gives it (and refusing placements the engine cannot
train on, before anything starts), handing its weights to sync targets, and checkpointing (full
state on replica 0, or ``torch.distributed.checkpoint`` shards for a sharded engine), and
checking that no sample it trains on is staler than the run allows (:meth:`check_staleness`),
and guarding every optimizer step against non-finite numbers (:meth:`step`). Subclasses say what
to do with micro-batches (``process``) and when to step (``end_iteration``, through :meth:`step`).
"""

from __future__ import annotations

import copy
import inspect
import logging
from typing import Any

import torch
from tensordict import TensorDict

from rlinf_lightning.engines.precision import resolve_precision
from rlinf_lightning.engines.train import (
    TRAIN_ENGINES,
    TrainSpec,
    build_train_engine,
    resolve_train_engine,
)
from rlinf_lightning.errors import NonFiniteError
from rlinf_lightning.flow.memory import count_text, dtype_bytes
from rlinf_lightning.flow.metrics import Metrics
from rlinf_lightning.flow.stage import MemoryPart, Stage, StageContext
from rlinf_lightning.policies.lora import lora_of, lora_record, merged_weights, sync_names
from rlinf_lightning.policies.module import RLModule

log = logging.getLogger(__name__)


def policy_dtype(policy: RLModule) -> str:
    """The dtype name a policy's weights are built in (``RLModule.dtype``)."""
    return policy.dtype


class TrainStage(Stage):
    """Hosts ``policy`` in the train engine and precision ``train`` names; its samples may be up
    to ``max_staleness`` versions behind the weights it trains (``trainer.max_staleness``)."""

    def __init__(self, policy: RLModule, train: TrainSpec | None = None, max_staleness: int = 0) -> None:
        train = train or TrainSpec()
        self.policy, self.train_engine, self.precision = policy, train.engine, train.precision
        self.train_engine_options, self.compile = dict(train.options), train.compile
        self.on_nonfinite = train.on_nonfinite
        self.max_consecutive_nonfinite = train.max_consecutive_nonfinite
        self.max_staleness = max_staleness
        self.nonfinite_steps, self.nonfinite_in_a_row = 0, 0

    def begin_iteration(self, iteration: int) -> None:
        """Subclasses call this first: the engine measures the device's peak for MFU at torch's
        current threads here, outside any stage call's span, when a re-plan changed them (auto
        widening its worker), so the call auto times for the speed-up does not carry it."""
        self.iteration = iteration
        self.engine.peak_flops()

    def step(self, metrics: Metrics) -> None:
        """One optimizer step of the engine over what was accumulated, its metrics merged into
        ``metrics``. A step whose loss or gradient norm is not finite is not taken (the engine
        drops its gradients) and is counted (``nonfinite_steps``, logged as ``<stage>/nonfinite_steps``);
        the first is warned about. The run stops with :class:`NonFiniteError` naming the stage,
        iteration and metric at the first such step under ``trainer.on_nonfinite=stop``, else
        after ``trainer.max_consecutive_nonfinite`` in a row, before any checkpoint of this
        iteration is written, so the last checkpoint holds the weights from before."""
        out = self.engine.step()
        bad = self.engine.nonfinite
        if bad is None:
            self.nonfinite_in_a_row = 0
            metrics.merge(out)
        else:
            self.nonfinite_steps += 1
            self.nonfinite_in_a_row += 1
            what = f"non-finite {bad} at iteration {self.iteration}"
            if self.on_nonfinite == "stop" or self.nonfinite_in_a_row >= self.max_consecutive_nonfinite:
                why = (
                    "(trainer.on_nonfinite=stop)"
                    if self.on_nonfinite == "stop"
                    else f"{self.nonfinite_in_a_row} optimizer steps in a row "
                    f"(trainer.max_consecutive_nonfinite={self.max_consecutive_nonfinite})"
                )
                raise NonFiniteError(
                    f"stage {self.name!r} stopped the run: {what}, {why}; no step was taken on it "
                    "(lower policy.lr, or check the rewards and the policy's outputs)"
                )
            if self.nonfinite_steps == 1 and self.ctx.replica == 0:
                log.warning(
                    "%s: %s: optimizer step skipped, its gradients dropped (counted as %s/nonfinite_steps; "
                    "%d in a row stop the run: trainer.max_consecutive_nonfinite)",
                    self.name, what, self.name, self.max_consecutive_nonfinite,
                )  # fmt: skip
        metrics.max("nonfinite_steps", self.nonfinite_steps)

    def check_staleness(self, iteration: int, versions: torch.Tensor, metrics: Metrics) -> None:
        """Record ``async/staleness`` (mean, std, max) of samples produced by weight ``versions``
        that the update of ``iteration`` trains on (it starts from version ``iteration - 1``);
        raise when one is staler than ``max_staleness`` allows, or newer than the learner."""
        staleness = (iteration - 1) - versions.long()
        if len(staleness) and not 0 <= int(staleness.min()) <= int(staleness.max()) <= self.max_staleness:
            raise RuntimeError(
                f"iteration {iteration} got samples of weight versions {sorted(set(versions.tolist()))}: "
                f"staleness {int(staleness.min())}..{int(staleness.max())} outside 0..{self.max_staleness} "
                "(trainer.max_staleness)"
            )
        metrics.distribution("async/staleness", staleness.float())

    def check_placement(self, replicas: int, own_process: bool) -> list[tuple[str, str]]:
        name = resolve_train_engine(self.train_engine, replicas)
        accepted = sorted(inspect.signature(TRAIN_ENGINES.get(name)).parameters)
        unknown = sorted(set(self.train_engine_options) - set(accepted))
        if unknown:
            return [
                (
                    f"trainer.train_engine_options.{key}",
                    f"train engine {name!r} (on {replicas} replica(s)) takes no option {key!r}; "
                    f"it takes {accepted or 'none'}",
                )
                for key in unknown
            ]
        try:
            engine = build_train_engine(self.train_engine, replicas, self.train_engine_options)
        except (TypeError, ValueError) as exc:
            return [("trainer.train_engine_options", str(exc))]
        problem = engine.check(replicas, own_process)
        return [problem] if problem else []

    def memory(self, device: str, replicas: int, micro_batch: int) -> list[MemoryPart] | None:
        """The train engine's state: weights, gradients and the two Adam moments, four tensors per
        parameter in the weights' dtype (the policy's ``dtype``, float32 unless it says otherwise;
        bfloat16 under ``bf16-true``): 16 bytes per parameter in float32, 8 in bfloat16. Under
        ``bf16-mixed`` add 2: the bfloat16 copies of the weights autocast keeps from the forward for
        the backward. An ``fsdp`` engine holds 1/replicas of it on each replica. With LoRA only the
        trainable parameters (:meth:`RLModule.trainable_parameter_count`) have gradients and Adam
        moments: the frozen base costs its weights (and autocast copies) alone.

        Not counted: activations (they depend on the sequence lengths, the attention kernel and
        recomputation), an optimizer outside Adam's family; so this is a floor."""
        n, trained = self.policy.parameter_count(), self.policy.trainable_parameter_count()
        if n is None or trained is None:
            return None
        precision = resolve_precision(self.precision, device)
        dtype = "bfloat16" if precision == "bf16-true" else policy_dtype(self.policy)
        size = dtype_bytes(dtype)
        weights = size + (2 if precision == "bf16-mixed" and size > 2 else 0)
        per = weights + 3 * size
        shards = replicas if resolve_train_engine(self.train_engine, replicas) == "fsdp" else 1
        sharded = f" / {shards} fsdp shards" if shards > 1 else ""
        copies = "; bfloat16 weight copies for autocast" if weights > size else ""
        fix = f"trainer.precision=bf16-true (8 bytes per parameter instead of {per})" if size > 2 else None
        if trained == n:
            what = f"{count_text(n)} parameters x {per} bytes{sharded}"
            what += f" ({dtype} weights, gradients, 2 Adam moments{copies})"
            return [MemoryPart(-(-n * per // shards), what, fix)]
        frozen = f"{count_text(n)} parameters x {weights} bytes{sharded} ({dtype} weights{copies})"
        state = f"LoRA: {count_text(trained)} trainable parameters x {3 * size} bytes{sharded}"
        return [
            MemoryPart(-(-n * weights // shards), frozen, fix),
            MemoryPart(-(-trained * 3 * size // shards), f"{state} (gradients, 2 Adam moments)"),
        ]

    def step_dtype_bytes(self, device: str) -> tuple[int, int]:
        """Bytes of an element of the weights' dtype and of the matmuls' (2 under bf16 autocast) in
        this stage's precision on ``device``: what ``flow.budget``'s cost models read."""
        precision = resolve_precision(self.precision, device)
        residual = dtype_bytes("bfloat16" if precision == "bf16-true" else policy_dtype(self.policy))
        return residual, 2 if precision.startswith("bf16") else residual

    def setup(self, ctx: StageContext) -> None:
        self.ctx = ctx
        self.engine = build_train_engine(self.train_engine, ctx.replicas, self.train_engine_options)
        self.engine.setup(copy.deepcopy(self.policy), ctx, resolve_precision(self.precision, ctx.device))
        if self.compile:
            self.engine.compile()

    def engine_info(self) -> dict[str, Any]:
        """Which engine trains here, in which precision, and this replica's rank among how many."""
        name = resolve_train_engine(self.train_engine, self.ctx.replicas)
        return {
            "engine": name,
            "precision": self.engine.precision,
            "rank": self.ctx.replica,
            "world_size": self.ctx.replicas,
        }

    def sync_state(self) -> TensorDict:
        """Every weight; with LoRA the merged weights that differ from the base (see
        ``policies.lora``: the frozen base is neither gathered nor sent)."""
        lora = lora_of(self.policy)
        if lora is None:
            return TensorDict(dict(self.engine.named_weights()), batch_size=[])
        named = self.engine.named_weights(sync_names(self.engine.policy.model))
        return TensorDict(dict(merged_weights(named, lora.scaling)), batch_size=[])

    def onload(self) -> None:
        self.engine.onload()

    def offload(self) -> None:
        self.engine.offload()

    def teardown(self) -> None:
        if hasattr(self, "engine"):  # not when building it failed
            self.engine.shutdown()

    @property
    def sharded(self) -> bool:
        """Whether the engine checkpoints as ``torch.distributed.checkpoint`` shards."""
        return hasattr(self.engine, "save_sharded")

    def state_dict(self) -> dict[str, Any]:
        """The full state on replica 0 (the others return ``{}``, or join the gather if sharded)."""
        if self.sharded:  # full weights for export (a collective); the optimizer lives in the shards
            model = self.engine.policy.model
            lora = lora_of(self.policy)
            names = {n for n, p in model.named_parameters() if p.requires_grad} if lora else None
            state = {"model": dict(self.engine.named_weights(names)), "optimizer": None}
        else:
            state = self.engine.state_dict()
        if self.ctx.replica != 0:
            return {}
        return {**state, "lora": lora_record(self.policy)} if lora_of(self.policy) else state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.engine.load_state_dict(state)

    def save_sharded(self, path: str) -> bool:
        """Write the engine's shards under ``path``; False when the engine is not sharded."""
        if not self.sharded:
            return False
        self.engine.save_sharded(path)
        return True

    def load_sharded(self, path: str) -> None:
        if not self.sharded:
            raise ValueError(
                f"checkpoint {path} holds sharded train state; resume it with trainer.train_engine "
                "fsdp (any number of devices)"
            )
        self.engine.load_sharded(path)
