"""Ray launcher: one Ray actor per worker (replica) of the plan, on this machine or a Ray cluster.

``ray.init()`` starts a local Ray unless one is running; ``address="auto"`` (or ``ray://...``)
joins an existing cluster. The plan's slots become placement-group bundles: plan node ``i`` is the
``i``-th alive Ray node (the driver's node first), and its replicas' bundles form one placement
group pinned to that node (``STRICT_PACK``, label ``ray.io/node-id``), one bundle per replica of
``slots_per_replica`` CPUs or GPUs; each worker actor is scheduled into its bundle. Channels
between workers carry ``ObjectRef``\\ s through Ray queues, so payloads travel through Ray's object
store (zero-copy for tensors on the same node). A data-parallel group's replicas meet at a TCP
store on its first replica's node. A stage that raises comes back as a :class:`StageError` with
the worker's traceback; an actor that dies ends the run with :class:`WorkerDied`; a failure
releases every other worker's channel waits through the actors' ``control`` thread.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

from rlinf_lightning.flow.channel import Channel, ChannelTimeout
from rlinf_lightning.flow.collective import Rendezvous, free_port, node_address
from rlinf_lightning.flow.plan import ExecutionPlan, WorkerGroup
from rlinf_lightning.flow.sharing import slot_shares
from rlinf_lightning.flow.worker import StageError
from rlinf_lightning.flow.workflow import Workflow
from rlinf_lightning.launchers.base import (
    ABORT_GRACE_S,
    REPLY_MARGIN_S,
    Launcher,
    Runtime,
    WorkerDied,
    first_cause,
    noted,
    setup_deadline,
)
from rlinf_lightning.launchers.processes import build_worker

# How long Ray may take to reserve the plan's resources; past it, the cluster cannot hold the plan
# (nodes or GPUs missing) and the run says so instead of waiting for ever.
PLACEMENT_TIMEOUT_S = 60.0


class RayChannel(Channel):
    """A Ray queue of object references: ``put`` stores the item in the object store."""

    transport = "ray-object-store"

    def __init__(self, name: str, timeout_s: float) -> None:
        from ray.util.queue import Queue

        super().__init__(name, timeout_s, q=Queue(actor_options={"num_cpus": 0}))

    def __getstate__(self) -> dict:  # the abort event belongs to each process (see _RayWorker.abort)
        return {k: v for k, v in self.__dict__.items() if k != "abort"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, abort=threading.Event())

    def put(self, item: Any) -> None:
        import ray

        self._q.put([ray.put(item)])  # in a list, so the queue actor keeps the reference unresolved

    def get(self, timeout: float | None = None) -> Any:
        import ray

        return ray.get(super().get(timeout)[0])

    def poll(self, timeout: float = 0.0) -> tuple[bool, Any]:
        import ray

        got, item = super().poll(timeout)
        return (True, ray.get(item[0])) if got else (False, None)


class _RayWorker:
    """Body of the Ray actor hosting one worker (its commands run on one thread, ``abort`` on another)."""

    def __init__(self, build: dict[str, Any]) -> None:
        self.build = build
        self.abort_event = threading.Event()

    def address(self) -> tuple[str, int]:
        """Where this actor's node can host a TCP store (for its group's rendezvous)."""
        host = node_address()
        return host, free_port(host)

    def start(self, rendezvous: Rendezvous | None, sync_meet: dict[str, Rendezvous]) -> None:
        build = self.build
        build["ctx"].rendezvous = rendezvous
        build["sync_meet"] = sync_meet
        for ch in build["queues"].values():
            ch.abort = self.abort_event
        build["abort"] = self.abort_event
        self.worker = build_worker(build)

    def handle(self, cmd: str, args: tuple) -> Any:
        try:
            return self.worker.handle(cmd, args)
        except BaseException:
            self.abort_event.set()
            raise

    def abort(self) -> None:
        self.abort_event.set()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


class RayRuntime(Runtime):
    def __init__(
        self, workflow: Workflow, plan: ExecutionPlan, timeout_s: float, address: str | None
    ) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            path = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
            ray.init(
                address=address,
                include_dashboard=False,
                log_to_driver=True,
                runtime_env={"env_vars": {"PYTHONPATH": path}} if address is None else None,
            )
            if address is None:  # the local Ray we just started ends with this process, even killed
                from rlinf_lightning.launchers.ray_reaper import start_reaper

                start_reaper(os.getpid())
        super().__init__(workflow, plan, timeout_s)
        self.queues = {n: RayChannel(n, timeout_s) for n in self.queue_names()}
        # workers that take turns on a slot reserve a share of it each (Ray picks which GPU)
        self.shares = slot_shares(plan)
        self.actors: dict[str, Any] = {}
        self._group_name = {g.worker_name(r): g.name for g, r in plan.workers}
        self.placement_groups: list[Any] = []
        try:
            bundles = self._place()
            actor_cls = ray.remote(concurrency_groups={"control": 1})(_RayWorker)
            gpu = plan.accelerator != "cpu"
            for g, r in plan.workers:
                name = g.worker_name(r)
                pg, index = bundles[name]
                build = {
                    **self.worker_build(g, r, one_machine=len({plan.node_of(s) for s in g.slots}) == 1),
                    "abort": None,
                }
                k = self.shares[name]
                self.actors[name] = actor_cls.options(
                    name=None,
                    max_restarts=0,
                    num_cpus=k,
                    num_gpus=k if gpu else 0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        pg, placement_group_bundle_index=index
                    ),
                ).remote(build)
            # the first call on an actor waits for its process to start: as long as setup may take
            self.setup_s = setup_deadline(timeout_s)
            deadline = time.monotonic() + self.setup_s
            meet = {
                g.name: Rendezvous(g.name, *self._address(g, deadline)) for g in plan.groups if g.replicas > 1
            }
            sync_meet = {  # hosted by the sending group's first replica
                ch: Rendezvous(f"sync:{ch}", *self._address(plan.group_of(link.edge.src), deadline))
                for ch, link in self.links.items()
                if link.broadcast
            }
            starts = {
                w: a.start.remote(meet.get(self._group_name[w]), sync_meet) for w, a in self.actors.items()
            }
            self._wait(starts, setup_deadline(timeout_s))
        except BaseException:
            self._close()
            raise
        self._setup()

    def _address(self, group: WorkerGroup, deadline: float) -> tuple[str, int]:
        """Where ``group``'s first replica's node can host a TCP store, once its actor has started
        (by ``deadline``)."""
        import ray
        from ray.exceptions import GetTimeoutError

        worker = group.worker_name(0)
        try:
            ref = self.actors[worker].address.remote()
            return ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))
        except GetTimeoutError:
            raise TimeoutError(
                f"Ray worker {worker!r} did not start within {self.setup_s:.0f} s; the machine may be "
                "oversubscribed (see `uptime`): run fewer jobs beside it or raise trainer.timeout_s"
            ) from None

    def _place(self) -> dict[str, tuple[Any, int]]:
        """One placement group per plan node, pinned to a distinct Ray node: worker -> (group, bundle)."""
        import ray
        from ray.util.placement_group import placement_group

        here = ray.get_runtime_context().get_node_id()
        nodes = sorted((n["NodeID"] for n in ray.nodes() if n["Alive"]), key=lambda n: n != here)
        per_node: dict[int, list[tuple[str, float]]] = {}
        for g, r in self.plan.workers:
            node = self.plan.node_of(g.replica_slots(r)[0])
            per_node.setdefault(node, []).append((g.worker_name(r), self.shares[g.worker_name(r)]))
        if max(per_node) >= len(nodes):
            raise RuntimeError(
                f"the plan uses {max(per_node) + 1} nodes but the Ray cluster has {len(nodes)} alive; "
                "lower trainer.num_nodes or add nodes"
            )
        kind = "CPU" if self.plan.accelerator == "cpu" else "GPU"
        out: dict[str, tuple[Any, int]] = {}
        for node, workers in sorted(per_node.items()):
            specs = [{"CPU": k, **({"GPU": k} if kind == "GPU" else {})} for _, k in workers]
            pg = placement_group(
                specs,
                strategy="STRICT_PACK",
                bundle_label_selector=[{"ray.io/node-id": nodes[node]}] * len(specs),
            )
            self.placement_groups.append(pg)
            try:
                ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
            except Exception as exc:
                need = sum(k for _, k in workers)
                raise RuntimeError(
                    f"Ray could not reserve {need:g} {kind} slot(s) on node {node} ({nodes[node][:8]}) for "
                    f"workers {[w for w, _ in workers]} within {PLACEMENT_TIMEOUT_S:.0f} s: "
                    f"{type(exc).__name__}; lower trainer.devices or give the node more {kind}s"
                ) from None
            for i, (w, _) in enumerate(workers):
                out[w] = (pg, i)
        return out

    def _wait(self, futures: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        """Results per worker; after a failure the others are released and get ``ABORT_GRACE_S``."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        by_ref = {ref: name for name, ref in futures.items()}
        out: dict[str, Any] = {}
        errors: list[BaseException] = []
        wait_s = timeout_s or self.timeout_s + REPLY_MARGIN_S
        deadline = time.monotonic() + wait_s
        while by_ref:
            ready, _ = ray.wait(list(by_ref), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                if errors:
                    break
                self._abort()
                silent = sorted(by_ref.values())
                late = TimeoutError(f"workers {silent} did not answer within {wait_s:.0f} s")
                raise noted(late, silent, out)
            name = by_ref.pop(ready[0])
            try:
                out[name] = ray.get(ready[0])
                continue
            except RayActorError as exc:
                errors.append(WorkerDied(name, self.stages_of[name], None, reason=f"Ray actor died ({exc})"))
            except RayTaskError as exc:
                cause = exc.as_instanceof_cause()
                errors.append(
                    cause if isinstance(cause, BaseException) else StageError("<worker>", name, str(exc))
                )
            if len(errors) == 1:
                self._abort()
                deadline = min(deadline, time.monotonic() + ABORT_GRACE_S)
        if errors:
            raise noted(_plain(first_cause(errors)), by_ref.values(), out)
        return out

    def _submit(self, workers: list[str], cmd: str, *args: Any) -> dict[str, Any]:
        return {w: self.actors[w].handle.remote(cmd, args) for w in workers}

    def _collect(self, futures: dict[str, Any], deadline_s: float | None = None) -> dict[str, Any]:
        return self._wait(futures, deadline_s)

    def _abort(self) -> None:
        for a in self.actors.values():
            a.abort.options(concurrency_group="control").remote()

    def _close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for a in self.actors.values():
            ray.kill(a)
        for ch in self.queues.values():
            ch._q.shutdown()
        for pg in self.placement_groups:
            remove_placement_group(pg)


def _plain(exc: BaseException) -> BaseException:
    """Ray wraps a remote exception in a subclass of its own; give callers the original type."""
    if isinstance(exc, StageError):
        return StageError(exc.stage, exc.worker, exc.tb, exc.kind, exc.line)
    if isinstance(exc, ChannelTimeout):
        return ChannelTimeout(*getattr(exc, "cause", exc).args)
    return exc


class RayLauncher(Launcher):
    """Workers as Ray actors in placement groups; channels through Ray's object store.

    Args:
        address: ``None`` starts (or reuses) a local Ray; ``"auto"`` or ``"ray://host:port"`` joins
            an existing cluster.
    """

    multi_node = True
    background_start = False  # ray.init off the main thread leaves the driver without its SIGTERM handler

    def __init__(self, address: str | None = None) -> None:
        self.address = address

    def launch(self, workflow: Workflow, plan: ExecutionPlan, *, timeout_s: float) -> Runtime:
        try:
            import ray  # noqa: F401
        except ImportError as exc:
            raise ImportError("launcher 'ray' needs Ray: pip install 'rlinf-lightning[ray]'") from exc
        return RayRuntime(workflow, plan, timeout_s, self.address)
