"""The macro flow (stages, channels, workflow) and its micro execution (plan, worker)."""

from rlinf_lightning.flow.channel import Channel, ChannelTimeout, EndOfIteration
from rlinf_lightning.flow.plan import ExecutionPlan, WorkerGroupSpec
from rlinf_lightning.flow.stage import Stage, StageContext
from rlinf_lightning.flow.worker import Span, StageError, Worker
from rlinf_lightning.flow.workflow import Workflow

__all__ = [
    "Channel",
    "ChannelTimeout",
    "EndOfIteration",
    "ExecutionPlan",
    "Span",
    "Stage",
    "StageContext",
    "StageError",
    "Worker",
    "WorkerGroupSpec",
    "Workflow",
]
