"""Stage: one named step of a workflow.

A stage is built on the driver from configuration only (cheap, picklable) and comes alive on each
replica of the worker group that hosts it: ``setup()`` builds its models there. It then sees
micro-batches one at a time through ``process`` and, when the iteration's last micro-batch has
passed, ``end_iteration``. ``onload``/``offload`` bracket its turn on a shared device under a
collocated plan (context switching). A stage never learns which strategy, launcher or transport
runs it; a data-parallel stage learns its replica index and may ask for a process group over its
group's replicas (:meth:`StageContext.process_group`), which is how a train engine's ranks are the
replicas the plan placed. Before anything starts, a stage may say how much device memory it will
hold (:meth:`Stage.memory`, from its configuration), so that a plan that cannot fit is refused up
front (``flow.memory``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tensordict import TensorDict

from rlinf_lightning.flow.channel import DEFAULT_TIMEOUT_S
from rlinf_lightning.flow.metrics import Metrics


@dataclass(frozen=True)
class MemoryPart:
    """Part of what a stage holds on its device: ``nbytes``, ``what`` they are (for messages, e.g.
    ``"0.49 B parameters x 16 bytes (float32 weights, gradients, 2 Adam moments)"``), and a
    configuration change that would shrink it, if there is one (``fix``). ``working``: held only
    during a call (activations, logits), so a worker, which calls one hosted stage at a time, holds
    the largest of its stages' working parts, not their sum."""

    nbytes: int
    what: str
    fix: str | None = None
    working: bool = False


class Stage:
    """Base class; subclasses override the hooks they need.

    Class attributes:
        name: the stage's name in the workflow.
        in_keys / out_keys: batch keys the stage reads and writes (checked when the workflow is
            built; empty: not checked).
        sticky: keep state per input micro-batch (e.g. an env stage owning its envs): micro-batch
            ``k`` of an iteration always goes to replica ``k % replicas`` instead of whichever
            replica asks first.
        cost_hint: the stage's share of an iteration's work relative to the workflow's other
            stages, before anything is measured (e.g. generation 1.0, a reward 0.15): how the
            hybrid strategy splits the stages over two halves of the slots without a placement.
            The auto strategy measures instead.
        end_per_sample: ``end_iteration`` works on every sample the replica received (a learner
            that keeps its batch and trains at the end), so a replica holding half the samples
            takes half the time there; ``False``: a fixed cost per iteration (an optimizer step).
            The auto strategy's simulator scales the measured end of iteration by it.

    Attribute set by the worker:
        policy_version: the version of the sync state this stage last applied (how many
            iterations the source had finished: 0 before the first); a rollout stage stamps it on
            its samples, so the learner sees how stale each sample is.
    """

    name: str = "stage"
    in_keys: tuple[str, ...] = ()
    out_keys: tuple[str, ...] = ()
    sticky: bool = False
    cost_hint: float = 0.1
    end_per_sample: bool = False
    policy_version: int = 0

    def setup(self, ctx: StageContext) -> None:
        """Build heavy state (models, engines) on the hosting worker."""

    def check_placement(self, replicas: int, own_process: bool) -> list[tuple[str, str]]:
        """``(config key, problem)`` pairs if this stage cannot run on ``replicas`` replicas
        (``own_process``: each replica is its own process). Called before anything starts."""
        return []

    def memory(self, device: str, replicas: int, micro_batch: int) -> list[MemoryPart] | None:
        """What this stage holds on one replica's device while it runs, estimated from its
        configuration only (nothing loaded, no weights read); ``None``: unknown (the default).

        Args:
            device: the replica's torch device (``cpu``, ``cuda:0``).
            replicas: how many replicas its group has (a sharded engine holds 1/replicas each).
            micro_batch: the largest message (samples) the plan sends the stage.
        """
        return None

    def budget(self, micro_batch: int) -> tuple[str, tuple[str, ...]]:
        """What bounds the working memory :meth:`memory` cannot count (activations), for an
        out-of-memory message: the budget in force and the config keys that lower it; by default
        the messages of ``micro_batch`` samples the plan sends the stage."""
        return f"messages of {micro_batch} samples", ("trainer.micro_batch_size",)

    def memory_bytes(self, device: str = "cpu", replicas: int = 1, micro_batch: int = 1) -> int | None:
        """The sum of :meth:`memory` (``None``: unknown)."""
        parts = self.memory(device, replicas, micro_batch)
        return None if parts is None else sum(p.nbytes for p in parts)

    def onload(self) -> None:
        """Bring this stage's state onto its device before its turn (collocated plans)."""

    def offload(self) -> None:
        """Release device memory after its turn so the next stage on the device has room."""

    def begin_iteration(self, iteration: int) -> None:
        """Called before the iteration's first micro-batch."""

    def process(self, batch: TensorDict) -> TensorDict | None:
        """Transform one micro-batch; the result goes to the stage's output channel."""
        return batch

    def end_iteration(self) -> Metrics | dict[str, float]:
        """Called after the iteration's last micro-batch; returns metrics to log: a
        :class:`~rlinf_lightning.flow.metrics.Metrics` (each merged across replicas by the
        reduction it declares), or a plain dict (means, weighted by the samples each replica
        processed)."""
        return {}

    def sync_state(self) -> TensorDict | None:
        """State this stage hands to its sync targets after ``end_iteration`` (e.g. new weights).
        Called on every replica (a sharded engine gathers collectively)."""
        return None

    def apply_sync(self, source: str, state: TensorDict) -> None:
        """Receive state that stage ``source`` handed over (e.g. load new weights)."""
        raise NotImplementedError(f"stage {self.name!r} does not accept sync state from {source!r}")

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must hold to resume this stage exactly."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`."""

    def extra_state(self) -> dict[str, Any]:
        """State beyond the ``train`` role's :meth:`state_dict` that resuming exactly needs, of any
        stage (an adaptive coefficient; a second model's weights and optimizer state): tensors and
        plain containers, saved with every checkpoint (``stages/<name>.pt``) and handed back to
        every replica on resume and re-plan. Called on the first replica; empty: nothing to save."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`extra_state` (called on every replica)."""

    def teardown(self) -> None:
        """Release what ``setup`` started (engines, process groups) when the run ends."""


class StageContext:
    """What a worker tells the stages it hosts: its device, and its place in a data-parallel group.

    Args:
        device: the torch device of this replica (``cpu``, ``cuda:0``).
        replica: this replica's index in its group (the rank of its process group).
        replicas: how many replicas the group has (the world size).
        num_threads: torch intra-op threads of this replica (CPU).
        slots: the device slots this replica spans (several for a tensor-parallel engine).
        own_process: each replica of the group is its own process (processes / Ray launchers);
            ``False`` when replicas are threads of one process.
        rendezvous: how the group's replicas find each other (see ``flow.collective``).
        timeout_s: longest wait of a collective before it fails.
        one_machine: every replica of the group runs on this machine (sums may use shared memory).
    """

    def __init__(
        self,
        device: str = "cpu",
        replica: int = 0,
        replicas: int = 1,
        num_threads: int = 0,
        slots: list[int] | None = None,
        own_process: bool = True,
        rendezvous: Any = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        one_machine: bool = True,
    ) -> None:
        self.device = device
        self.replica = replica
        self.replicas = replicas
        self.num_threads = num_threads
        self.slots = list(slots or [0])
        self.own_process = own_process
        self.rendezvous = rendezvous
        self.timeout_s = timeout_s
        self.one_machine = one_machine
        self._group: Any = None
        self._shared_sums: dict[tuple, Any] = {}  # (numel, dtype) -> SharedSum

    def process_group(self) -> Any:
        """A ``torch.distributed`` process group over the group's replicas (``None`` for one replica).

        Every replica must call it (the first call is a rendezvous). In a replica that is its own
        process the group is also the default (world) group, which FSDP2 and
        ``torch.distributed.checkpoint`` use; replicas that are threads get a private gloo group,
        and since thread replicas are set up one after another, they must first call it after
        ``setup`` (e.g. at the first ``end_iteration``).
        """
        if self.replicas == 1:
            return None
        if self._group is None:
            from rlinf_lightning.flow.collective import init_group

            self._group = init_group(self)
        return self._group

    def all_reduce(self, tensors: list[Any]) -> None:
        """Sum ``tensors`` in place over the group's replicas (nothing to do for one replica).

        CPU tensors of replicas on one machine go through shared memory, others through the
        process group; either way every replica ends with bitwise the same values. Every replica
        must make the same calls in the same order (the first one is a rendezvous).
        """
        if self.replicas == 1:
            return
        from rlinf_lightning.flow.collective import SharedSum, all_reduce

        group = self.process_group()
        for t in tensors:
            if t.device.type == "cpu" and self.one_machine and t.is_contiguous() and SharedSum.available():
                key = (t.numel(), t.dtype)
                if key not in self._shared_sums:
                    self._shared_sums[key] = SharedSum(self, group, *key)
                self._shared_sums[key](t)
            else:
                all_reduce(group, [t])

    def close(self) -> None:
        """Leave the process group, if one was made."""
        if self._group is not None:
            from rlinf_lightning.flow.collective import destroy_group

            destroy_group(self, self._group)
            self._group = None
