"""Disaggregated and hybrid plans: stages split over two worker groups, micro-batches pipelined.

The first stage (rollout) streams micro-batches of whole prompt groups to the next as each is
generated; every downstream stage processes them as they arrive (elastic pipelining), and the
actor accumulates gradients and steps once per global batch, so an iteration computes the same
update as a collocated one. Weights go back to the rollout once per iteration (the sync edge).
"""

from __future__ import annotations

from rlinf_lightning.flow.plan import ExecutionPlan, WorkerGroupSpec
from rlinf_lightning.flow.workflow import Workflow
from rlinf_lightning.strategies.base import BatchShape, Resources, Strategy

# Relative cost of the reasoning stages on the tiny math workload (from its time/<stage> metrics).
DEFAULT_COSTS = {"rollout": 1.0, "reward": 0.15, "advantage": 0.01, "inference": 0.3, "actor": 1.0}


class _TwoGroups(Strategy):
    def __init__(self, micro_batches: int = 4) -> None:
        self.micro_batches = micro_batches

    def split_index(self, workflow: Workflow) -> int:
        """Stages ``order[:i]`` go to the generation group, the rest to the training group."""
        raise NotImplementedError

    def plan(self, workflow: Workflow, resources: Resources, batch: BatchShape) -> ExecutionPlan:
        slots = resources.slots
        if len(slots) < 2:
            raise ValueError(
                f"strategy {self.name!r} places stages on separate slots and needs trainer.devices >= 2 "
                f"(got {len(slots)}); use strategy 'collocated' on one slot"
            )
        order = workflow.order
        i = self.split_index(workflow)
        half = (len(slots) + 1) // 2
        groups = [("gen", order[:i], slots[:half]), ("train", order[i:], slots[half:])]
        workers = [
            WorkerGroupSpec(n, st, sl, schedule="interleaved", num_threads=resources.threads(len(sl)))
            for n, st, sl in groups
        ]
        mb = batch.split(self.micro_batches)
        mbs = {workflow.input_edge(s).channel: mb for s in order}
        return ExecutionPlan(self.name, workers, mbs, notes=self.notes)


class DisaggregatedStrategy(_TwoGroups):
    """Rollout alone on half the slots; every other stage on the other half, pipelined.

    Args:
        micro_batches: micro-batches per iteration when ``trainer.micro_batch_size`` is unset.
    """

    name = "disaggregated"
    notes = "rollout | rest, pipelined by micro-batch"

    def split_index(self, workflow: Workflow) -> int:
        return 1


class HybridStrategy(_TwoGroups):
    """Pipelined like disaggregated, but the split point balances the two groups' load.

    Stages before the split share the rollout's worker (interleaved), the rest share the actor's,
    choosing the contiguous split that minimises the busier group's cost. Costs are seconds per
    stage (e.g. the ``time/<stage>`` metrics of a profiling run); unknown stages count as 0.1.

    Args:
        micro_batches: micro-batches per iteration when ``trainer.micro_batch_size`` is unset.
        costs: relative cost per stage name.
    """

    name = "hybrid"

    def __init__(self, micro_batches: int = 4, costs: dict[str, float] | None = None) -> None:
        super().__init__(micro_batches)
        self.costs = dict(costs or DEFAULT_COSTS)

    @property
    def notes(self) -> str:
        return "cost-balanced split, pipelined by micro-batch"

    def split_index(self, workflow: Workflow) -> int:
        cost = [self.costs.get(s, 0.1) for s in workflow.order]
        best = min(range(1, len(cost)), key=lambda i: (max(sum(cost[:i]), sum(cost[i:])), -i))
        return best
