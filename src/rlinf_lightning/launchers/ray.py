"""Ray launcher: one Ray actor per worker of the plan, on this machine or a Ray cluster.

``ray.init()`` starts a local Ray unless one is running; ``address="auto"`` (or ``ray://...``)
joins an existing cluster. Channels between workers carry ``ObjectRef``\\ s through a Ray queue,
so payloads travel through Ray's object store (zero-copy for tensors on the same node).
A stage that raises comes back as a :class:`StageError` with the worker's traceback; an actor
that dies ends the run with :class:`WorkerDied`, and the remaining actors are killed.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

from tensordict import TensorDict

from rlinf_lightning.flow.channel import Channel, EndOfIteration
from rlinf_lightning.flow.plan import ExecutionPlan, WorkerGroupSpec
from rlinf_lightning.flow.stage import StageContext
from rlinf_lightning.flow.worker import Span, StageError
from rlinf_lightning.flow.workflow import Workflow
from rlinf_lightning.launchers.base import Launcher, Runtime
from rlinf_lightning.launchers.processes import WorkerDied, build_worker, placement, remote_channels


class RayChannel(Channel):
    """A Ray queue of object references: ``put`` stores the item in the object store."""

    transport = "ray-object-store"

    def __init__(self, name: str, timeout_s: float) -> None:
        from ray.util.queue import Queue

        super().__init__(name, timeout_s, q=Queue(actor_options={"num_cpus": 0}))

    def __getstate__(self) -> dict:  # the abort event is per process; Ray kills actors on failure
        return {k: v for k, v in self.__dict__.items() if k != "abort"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, abort=threading.Event())

    def put(self, item: Any) -> None:
        import ray

        self._q.put([ray.put(item)])  # in a list, so the queue actor keeps the reference unresolved

    def get(self, timeout: float | None = None) -> Any:
        import ray

        return ray.get(super().get(timeout)[0])

    def poll(self) -> tuple[bool, Any]:
        import ray

        got, item = super().poll()
        return (True, ray.get(item[0])) if got else (False, None)


class _RayWorker:
    """Body of the Ray actor hosting one worker's stages."""

    def __init__(
        self,
        spec: WorkerGroupSpec,
        workflow: Workflow,
        remote: dict,
        index: int,
        world: int,
        timeout_s: float,
    ) -> None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"  # Ray sets CUDA_VISIBLE_DEVICES per actor
        ctx = StageContext(device, index, world, spec.num_threads)
        self.worker = build_worker(spec, workflow, remote, ctx, timeout_s)
        self.worker.setup()

    def pid(self) -> int:
        return os.getpid()

    def run_iteration(self, iteration: int) -> dict[str, dict[str, float]]:
        return self.worker.run_iteration(iteration)

    def call(self, stage: str, method: str, args: tuple, kwargs: dict) -> Any:
        return self.worker.call(stage, method, *args, **kwargs)

    def pop_spans(self) -> list[Span]:
        spans, self.worker.spans = self.worker.spans, []
        return spans

    def teardown(self) -> None:
        self.worker.teardown()


class RayRuntime(Runtime):
    def __init__(
        self, workflow: Workflow, plan: ExecutionPlan, timeout_s: float, address: str | None
    ) -> None:
        import ray

        if not ray.is_initialized():
            path = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
            ray.init(
                address=address,
                include_dashboard=False,
                log_to_driver=True,
                runtime_env={"env_vars": {"PYTHONPATH": path}} if address is None else None,
            )
        self.timeout_s = timeout_s
        self.specs = {w.name: w for w in plan.workers}
        where = placement(workflow, plan)
        self._stage_worker = where
        self.channels = {
            e.channel: RayChannel(e.channel, timeout_s)
            for e in workflow.edges
            if where[e.src] != where[e.dst]
        }
        self.source = self.channels[workflow.input_edge(workflow.order[0]).channel]
        gpu = ray.cluster_resources().get("GPU", 0) > 0
        actor_cls = ray.remote(_RayWorker)
        self.actors: dict[str, Any] = {}
        for i, spec in enumerate(plan.workers):
            remote = remote_channels(workflow, where, self.channels, spec.name)
            opts = (
                {"num_gpus": len(spec.slots)}
                if gpu
                else {"num_cpus": min(len(spec.slots), os.cpu_count() or 1)}
            )
            self.actors[spec.name] = actor_cls.options(name=None, max_restarts=0, **opts).remote(
                spec, workflow, remote, i, len(plan.workers), timeout_s
            )
        self._closed = False
        try:
            self._wait({n: a.pid.remote() for n, a in self.actors.items()}, max(timeout_s, 120.0))
        except BaseException:
            self.shutdown()
            raise

    def _wait(self, futures: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        """Results per worker; the first failure (stage error or dead actor) ends the wait."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        by_ref = {ref: name for name, ref in futures.items()}
        out: dict[str, Any] = {}
        deadline = time.monotonic() + (timeout_s or self.timeout_s + 30.0)
        while by_ref:
            ready, _ = ray.wait(list(by_ref), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"workers {sorted(by_ref.values())} did not answer within {timeout_s} s")
            name = by_ref.pop(ready[0])
            try:
                out[name] = ray.get(ready[0])
            except RayActorError as exc:
                raise WorkerDied(
                    name, self.specs[name].stages, None, reason=f"Ray actor died ({exc})"
                ) from None
            except RayTaskError as exc:
                cause = exc.as_instanceof_cause()
                if isinstance(cause, StageError):
                    raise StageError(cause.stage, cause.worker, cause.tb) from None
                raise StageError("<worker>", name, str(exc)) from None
        return out

    def run_iteration(self, iteration: int, batches: list[TensorDict]) -> dict[str, dict[str, float]]:
        futures = {n: a.run_iteration.remote(iteration) for n, a in self.actors.items()}
        for b in batches:
            self.source.put(b)
        self.source.put(EndOfIteration(iteration))
        metrics: dict[str, dict[str, float]] = {}
        for m in self._wait(futures).values():
            metrics.update(m)
        return metrics

    def call(self, stage: str, method: str, *args: Any, **kwargs: Any) -> Any:
        name = self._stage_worker[stage]
        return self._wait({name: self.actors[name].call.remote(stage, method, args, kwargs)})[name]

    def pop_spans(self) -> list[Span]:
        got = self._wait({n: a.pop_spans.remote() for n, a in self.actors.items()})
        return [s for spans in got.values() for s in spans]

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        import ray

        done = [a.teardown.remote() for a in self.actors.values()]
        ray.wait(done, num_returns=len(done), timeout=10.0)  # best effort: dead actors cannot answer
        for a in self.actors.values():
            ray.kill(a)
        for ch in self.channels.values():
            ch._q.shutdown()


class RayLauncher(Launcher):
    """Workers as Ray actors; channels through Ray's object store.

    Args:
        address: ``None`` starts (or reuses) a local Ray; ``"auto"`` or ``"ray://host:port"`` joins
            an existing cluster.
    """

    def __init__(self, address: str | None = None) -> None:
        self.address = address

    def launch(self, workflow: Workflow, plan: ExecutionPlan, *, timeout_s: float) -> Runtime:
        try:
            import ray  # noqa: F401
        except ImportError as exc:
            raise ImportError("launcher 'ray' needs Ray: pip install 'rlinf-lightning[ray]'") from exc
        return RayRuntime(workflow, plan, timeout_s, self.address)
