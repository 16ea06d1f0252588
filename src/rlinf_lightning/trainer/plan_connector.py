"""PlanConnector: resolves the accelerator and the strategy once (Lightning's accelerator
connector), builds the run's plan (the task's workflow, the strategy's placement and
micro-batches, the stages' token budgets: one value) and checks it (placement, memory) before any
worker starts, changing nothing. The fit loop is handed the workflow and the plan it built."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from rlinf_lightning.errors import ConfigError
from rlinf_lightning.flow.memory import memory_problems, unestimated_stages, with_budgets
from rlinf_lightning.flow.plan import ExecutionPlan
from rlinf_lightning.flow.workflow import Workflow
from rlinf_lightning.launchers import LAUNCHERS
from rlinf_lightning.strategies import STRATEGIES, Resources, Strategy
from rlinf_lightning.tasks.base import RunSpec

if TYPE_CHECKING:
    from rlinf_lightning.trainer.trainer import RLTrainer

log = logging.getLogger(__name__)


class PlanConnector:
    """The run's resources and strategy; builds and checks plans.

    Attributes (after :meth:`build`):
        strategy: the resolved strategy object (asked again between iterations by the fit loop).
    """

    def __init__(self, trainer: RLTrainer) -> None:
        self.trainer = trainer
        self.strategy: Strategy | None = None

    @property
    def accelerator(self) -> str:
        """``trainer.accelerator`` with ``auto`` resolved: ``cuda`` when torch sees a GPU."""
        if self.trainer.accelerator == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.trainer.accelerator

    @property
    def resources(self) -> Resources:
        t = self.trainer
        return Resources(t.devices, t.num_nodes, self.accelerator, t.num_threads)

    def build(self, policy: Any, task: Any, run: RunSpec) -> tuple[Workflow, ExecutionPlan]:
        """The task's workflow and the plan for it: the strategy's placement and micro-batches, and
        the token budget of each stage that sizes its own (``flow.memory.with_budgets``). Raises
        ``ValueError`` when the workflow is malformed or the strategy cannot place it on these
        resources; a budget that cannot fit one sample is left out (:meth:`problems` names it)."""
        workflow = task.build_workflow(policy, run)
        workflow.validate()
        workflow.check_keys(task.input_keys)
        if "train" not in workflow.roles:
            raise ValueError(f"workflow {workflow.name!r} names no stage with role 'train'")
        if workflow.max_staleness != run.max_staleness:
            raise ConfigError(
                [
                    (
                        "trainer.max_staleness",
                        f"{run.max_staleness}, but the {type(task).__name__} task's workflow "
                        f"{workflow.name!r} lets its weight sync lag {workflow.max_staleness} "
                        "(its build_workflow must pass run.max_staleness to Workflow.sync); "
                        "use trainer.max_staleness=0 with this task",
                    )
                ]
            )
        self.strategy = STRATEGIES.resolve(self.trainer.strategy)
        plan = self.strategy.plan(workflow, self.resources, task.batch_shape(run))
        plan.validate(workflow, len(self.resources.slots))
        plan, _ = with_budgets(workflow, plan)
        return workflow, plan

    def problems(
        self, policy: Any, task: Any, run: RunSpec
    ) -> tuple[list[tuple[str, str]], tuple[Workflow, ExecutionPlan] | None]:
        """Builds the plan and returns what is wrong with it: the requested micro-batch against the
        task's batch, a stage the placement cannot serve, or more memory than the devices have;
        and the workflow and plan built (``None`` where none could be)."""
        try:
            mbs, shape = run.micro_batch_size, task.batch_shape(run)
            if mbs and (mbs % shape.group_size or shape.rollout_batch_size % mbs):
                return [
                    (
                        "trainer.micro_batch_size",
                        f"{mbs} must be a multiple of the task's unit of {shape.group_size} samples "
                        f"that divides its {shape.rollout_batch_size} samples per iteration",
                    )
                ], None
            workflow, plan = self.build(policy, task, run)
        except ConfigError as exc:  # the task found a setting its workflow cannot serve
            return exc.problems, None
        except ValueError as exc:  # the strategy cannot place this workflow on these resources
            return [("trainer.strategy", str(exc))], None
        return self.check(workflow, plan), (workflow, plan)

    def check(self, workflow: Workflow, plan: ExecutionPlan) -> list[tuple[str, str]]:
        """What is wrong with ``plan`` for ``workflow``: a stage its placement cannot serve, or more
        memory than its devices have. Changes nothing."""
        separate = LAUNCHERS.resolve(plan.launcher or self.trainer.launcher).separate_processes
        placement = [
            problem
            for g in plan.groups
            for s in g.stages
            for problem in workflow.stages[s].check_placement(g.replicas, separate)
        ]
        # only where the user can act: a policy that cannot be sized on the meta device (a
        # simulator's memory is not known before it runs; the check counts it as nothing and names
        # it only if the plan does not fit)
        unknown = [s for s in unestimated_stages(workflow, plan) if hasattr(workflow.stages[s], "policy")]
        if unknown:
            log.warning(
                "memory check: stage(s) %s give no estimate before they run, so the check counts only "
                "the other stages (their policy's configure_model cannot run on the meta device: "
                "override RLModule.parameter_count to give its size)",
                ", ".join(unknown),
            )
        return placement or memory_problems(workflow, plan)
