"""Whether a plan fits its devices' memory, estimated before anything loads.

Each stage says what it holds on one replica's device while it runs (:meth:`Stage.memory`, from
its configuration: parameter counts come from a model built on the ``meta`` device, nothing is
loaded). A worker (one replica of a group) holds the sum of its stages' shares, or the largest of
them when its group context-switches (``collocated_offload``: each stage offloads after its turn,
to host memory from a GPU, to a spill file on disk from a CPU); context-switching workers of
overlapping groups that take turns on a slot count the largest of them. Then:

* on CPU every worker of a node shares the node's memory: this machine's physical memory, or its
  cgroup's limit where lower (other nodes are taken to be alike);
* on CUDA each worker has the GPU of its first slot (``total_memory``; GPUs of other nodes are
  taken to be like this machine's).

The actor, the critic and the inference stage count a call's peak at their token budgets
(activations and logits, ``flow.budget``) as working memory, which a worker holds for one call
at a time; with no micro-batch size or budget configured the plan carries the budget each chose to
fit :data:`~rlinf_lightning.flow.budget.DEVICE_FRACTION` of its device beside the plan's other
residents (:func:`plan_budgets`, :func:`with_budgets`). Nothing here changes a stage, a policy or
a plan: a planner may check as many candidate plans as it likes. No margin is kept for the
process itself (interpreter, CUDA context, allocator fragmentation) beyond that fraction, and the
other stages leave out what they cannot bound from the configuration (their forwards'
activations, the rollout's transient logits). So a plan it refuses cannot run, while one it lets
through may still run out of memory. A stage that gives no estimate (``None``) counts as nothing
and is named as such in the message.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from rlinf_lightning.flow.budget import DEVICE_FRACTION, Budget, gib
from rlinf_lightning.flow.plan import ExecutionPlan, WorkerGroup
from rlinf_lightning.flow.stage import MemoryPart
from rlinf_lightning.flow.token_budget import TokenBudget
from rlinf_lightning.flow.workflow import Workflow

GIB = 2**30


def count_text(n: int) -> str:
    """A parameter count for messages: ``"2.82 B"``, ``"0.41 M"``, ``"10,057"``."""
    if n >= 10**9:
        return f"{n / 1e9:.2f} B"
    if n >= 10**5:
        return f"{n / 1e6:.2f} M"
    return f"{n:,}"


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a torch dtype name (``float32`` -> 4)."""
    import torch

    return getattr(torch, dtype).itemsize


def weights_part(parameters: int, dtype: str, what: str = "weights", fix: str | None = None) -> MemoryPart:
    """``parameters`` held in ``dtype``: ``"bfloat16 weights (0.49 B parameters x 2 bytes)"``."""
    size = dtype_bytes(dtype)
    return MemoryPart(
        parameters * size, f"{dtype} {what} ({count_text(parameters)} parameters x {size} bytes)", fix
    )


@dataclass
class WorkerMemory:
    """What one worker (a replica of a group) holds: its stages' parts, and which stages gave none."""

    group: WorkerGroup
    replica: int
    device: str
    node: int
    parts: dict[str, list[MemoryPart]] = field(default_factory=dict)
    unknown: list[str] = field(default_factory=list)

    def stage_bytes(self, stage: str, working: bool = True) -> int:
        """What ``stage`` holds while it runs (without its working memory: ``working=False``)."""
        return sum(p.nbytes for p in self.parts.get(stage, []) if working or not p.working)

    @property
    def nbytes(self) -> int:
        """The largest of its stages' shares when they take turns (context switching); else what
        they hold between calls, summed, and the largest working memory of one call (a worker calls
        one stage at a time)."""
        shares = [self.stage_bytes(s) for s in self.parts] or [0]
        if self.group.context_switch:
            return max(shares)
        held = [self.stage_bytes(s, working=False) for s in self.parts] or [0]
        return sum(held) + max(a - b for a, b in zip(shares, held))


def stage_micro_batch(workflow: Workflow, plan: ExecutionPlan, stage: str) -> int:
    """Samples per message into ``stage`` (a loop body gets its head's messages)."""
    loop = workflow.loop_of(stage)
    edge = workflow.input_edge(loop.head if loop is not None and loop.body == stage else stage)
    if edge is not None and edge.channel in plan.micro_batch_size:
        return plan.micro_batch_size[edge.channel]
    return max(plan.micro_batch_size.values(), default=1)


def worker_memory(
    workflow: Workflow, plan: ExecutionPlan, budgets: dict[str, Budget] | None = None
) -> list[WorkerMemory]:
    """Every worker's estimated memory, in plan order, its stages under ``budgets`` (by default
    the plan's own)."""
    budgets = plan.budgets if budgets is None else budgets
    out = []
    for group, replica in plan.workers:
        slots = group.replica_slots(replica)
        w = WorkerMemory(group, replica, plan.device_of(slots), plan.node_of(slots[0]))
        for name in group.stages:
            size = (w.device, group.replicas, stage_micro_batch(workflow, plan, name))
            if name in budgets:
                parts = workflow.stages[name].memory(*size, budget=budgets[name])
            else:
                parts = workflow.stages[name].memory(*size)
            if parts is None:
                w.unknown.append(name)
            else:
                w.parts[name] = parts
        out.append(w)
    return out


def unestimated_stages(workflow: Workflow, plan: ExecutionPlan) -> list[str]:
    """The stages whose memory is unknown before they load (``Stage.memory`` gave ``None``, e.g. a
    policy that cannot be built on the meta device): the memory check cannot count them."""
    return sorted({s for w in worker_memory(workflow, plan) for s in w.unknown})


def host_memory() -> int:
    """This machine's physical memory, or its cgroup's memory limit where that is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            total = min(total, int(Path(limit).read_text().strip()))
        except (OSError, ValueError):  # absent, or "max" (no limit)
            pass
    return total


def gpu_memory(index: int) -> int | None:
    """Total memory of this machine's GPU ``index``; ``None`` where torch sees no such GPU."""
    import torch

    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        return None
    return torch.cuda.get_device_properties(index).total_memory


def _places(
    workflow: Workflow, plan: ExecutionPlan, budgets: dict[str, Budget]
) -> tuple[dict[str, list[WorkerMemory]], dict]:
    """The workers of ``plan`` (its stages under ``budgets``) by the device memory they share, and
    each device's size (``None`` where this machine cannot see it)."""
    places: dict[str, list[WorkerMemory]] = {}
    have: dict[str, int | None] = {}
    host = host_memory() if plan.accelerator == "cpu" else 0
    for w in worker_memory(workflow, plan, budgets):
        if plan.accelerator == "cpu":
            place, size = f"node {w.node} (CPU memory)", host
        else:
            gpu = int(w.device.split(":")[1]) if ":" in w.device else 0
            place, size = f"GPU {gpu} of node {w.node}", gpu_memory(gpu)
        places.setdefault(place, []).append(w)
        have[place] = size
    return places, have


def plan_budgets(workflow: Workflow, plan: ExecutionPlan) -> tuple[dict[str, Budget], list[tuple[str, str]]]:
    """The token budget of every stage that sizes its own micro-batches (``choose_budget``: the
    actor, the critic and the inference stage, when no micro-batch size or token budget is
    configured for them) under ``plan``, and the ``(key, problem)`` of any that cannot fit one
    sample. Each gets the usable share of its device (``flow.budget.DEVICE_FRACTION``) less what
    the plan's workers hold there besides its own state (the smallest such room over its
    replicas' devices). Stages of one worker run one at a time, so each may use all of that room;
    workers that run at once on one device (every worker of a CPU node) split it evenly between
    those of them that choose. Changes nothing: a pure function of the workflow's configuration
    and the plan's placement (budgets the plan already carries are not counted)."""
    fitting = {n: s for n, s in workflow.stages.items() if isinstance(s, TokenBudget) and s.chooses_budget()}
    if not fitting:
        return {}, []
    places, have = _places(workflow, plan, {})
    room: dict[str, tuple[float, WorkerMemory]] = {}
    for place, workers in places.items():
        if have[place] is None:
            continue
        free = have[place] * DEVICE_FRACTION - _need(workers)
        choosing = [w for w in workers if fitting.keys() & w.parts.keys()]
        # context-switching workers take turns: one share between them all
        shares = len([w for w in choosing if not w.group.context_switch])
        shares += any(w.group.context_switch for w in choosing)
        for w in choosing:
            for name in fitting.keys() & w.parts.keys():
                usable = free / max(shares, 1) + w.stage_bytes(name)
                if name not in room or usable < room[name][0]:
                    room[name] = (usable, w)
    budgets, problems = {}, []
    for name, (usable, w) in sorted(room.items()):
        micro = stage_micro_batch(workflow, plan, name)
        chosen = fitting[name].choose_budget(w.device, usable, w.group.replicas, micro)
        if isinstance(chosen, Budget):
            budgets[name] = chosen
        elif chosen is not None:
            problems.append(chosen)
    return budgets, problems


def with_budgets(workflow: Workflow, plan: ExecutionPlan) -> tuple[ExecutionPlan, list[tuple[str, str]]]:
    """``plan`` carrying its stages' token budgets (:func:`plan_budgets`): a new plan, ``plan``
    itself unchanged; and the problems of stages that cannot fit one sample."""
    budgets, problems = plan_budgets(workflow, plan)
    return replace(plan, budgets=budgets), problems


def memory_problems(workflow: Workflow, plan: ExecutionPlan) -> list[tuple[str, str]]:
    """``[("trainer.strategy", message)]`` when some device of ``plan`` cannot hold what its workers
    need (see the module docstring), else ``[]``. The message names the plan, the device, each
    stage's share and what it is made of, the total against what the device has, and the fixes.
    Stages that size their own micro-batches are counted at the budgets they would choose for this
    plan (:func:`plan_budgets`), a step's peak at that size included. A pure function, and cheap:
    parameter counts are cached by the policies, so a planner may ask for many plans."""
    budgets, problems = plan_budgets(workflow, plan)
    if problems:
        return problems
    places, have = _places(workflow, plan, budgets)
    over = [p for p, ws in places.items() if have[p] is not None and _need(ws) > have[p]]
    if not over:
        return []
    place, ws = over[0], places[over[0]]
    shared = f" shared by {len(ws)} workers" if len(ws) > 1 else ""
    more = f" (and {len(over) - 1} more devices likewise)" if len(over) > 1 else ""
    need = gib(_need(ws))
    head = f"plan {plan.strategy!r} needs {need} on {place}{shared}{more}, which has {gib(have[place])}"
    fixes = _fixes(ws, have[place], "GPUs" if plan.accelerator != "cpu" else "nodes")
    return [("trainer.strategy", f"{head}: {_shares(ws)}. Fix: {fixes}")]


def apply_budgets(workflow: Workflow, plan: ExecutionPlan) -> None:
    """Put ``plan``'s budgets in force on the stages that size their own micro-batches (and take
    back those of a plan before it): what the workers start with. Not part of any check."""
    for name, stage in workflow.stages.items():
        if isinstance(stage, TokenBudget):
            stage.apply_budget(plan.budgets.get(name))


def _need(workers: list[WorkerMemory]) -> int:
    """What the workers on one device hold at once: context-switching workers that take turns on
    a slot (overlapping groups, ``flow.sharing``) count the largest of them, the others add up."""
    turns: list[tuple[set[int], int]] = []  # (slots, largest) of workers that take turns
    alone = 0
    for w in workers:
        slots = set(w.group.replica_slots(w.replica))
        if not w.group.context_switch:
            alone += w.nbytes
            continue
        joined = [t for t in turns if t[0] & slots]
        turns = [t for t in turns if not t[0] & slots]
        turns.append((slots.union(*(t[0] for t in joined)), max([w.nbytes, *(t[1] for t in joined)])))
    return alone + sum(t[1] for t in turns)


def _shares(workers: list[WorkerMemory]) -> str:
    """``"actor 45.1 GiB = ...; rollout 3.2 GiB = 2.9 GiB ... + 0.3 GiB ..."`` over the workers."""
    names = list(dict.fromkeys(s for w in workers for s in w.parts))
    names.sort(key=lambda s: -sum(w.stage_bytes(s) for w in workers))
    out = []
    for name in names:
        holders = [w for w in workers if name in w.parts]
        total = sum(w.stage_bytes(name) for w in holders)
        if not total:
            continue
        parts = [p for p in holders[0].parts[name] if p.nbytes]
        made_of = parts[0].what if len(parts) == 1 else " + ".join(f"{gib(p.nbytes)} {p.what}" for p in parts)
        per = f" ({len(holders)} replicas x {gib(total / len(holders))})" if len(holders) > 1 else ""
        out.append(f"{name} {gib(total)}{per} = {made_of}")
    if any(w.group.context_switch for w in workers):
        out.append("stages that take turns (context switching) count their largest share only")
    unknown = sorted({s for w in workers for s in w.unknown})
    if unknown:
        out.append(f"not counted (no estimate): {', '.join(unknown)}")
    return "; ".join(out)


def _fixes(workers: list[WorkerMemory], have: int, devices: str) -> str:
    """What would shrink the need: always a smaller model or more devices; context switching where
    it alone would fit; then what the stages' parts suggest (a lower precision, a bf16 rollout)."""
    key = "trainer.devices, trainer.num_nodes" if devices == "GPUs" else "trainer.num_nodes"
    fixes = [
        "a smaller model",
        f"more {devices} ({key}) with the actor sharded (trainer.train_engine=fsdp) or the stages "
        "apart (trainer.strategy=disaggregated)",
    ]
    turns = sum(max([w.stage_bytes(s) for s in w.parts] or [0]) for w in workers)
    if turns <= have and not all(w.group.context_switch for w in workers):
        fixes.append(f"trainer.strategy=collocated_offload (stages take turns: {gib(turns)})")
    fixes += list(dict.fromkeys(p.fix for w in workers for ps in w.parts.values() for p in ps if p.fix))
    return "; or ".join(fixes)
