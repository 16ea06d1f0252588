"""The macro flow (stages, channels, workflow) and its micro execution (plan, wiring, worker)."""

from rlinf_lightning.flow.batch import BatchShape
from rlinf_lightning.flow.channel import Channel, ChannelAborted, ChannelTimeout, EndOfIteration, Message
from rlinf_lightning.flow.metrics import Metrics
from rlinf_lightning.flow.plan import ExecutionPlan, WorkerGroup
from rlinf_lightning.flow.stage import MemoryPart, Stage, StageContext
from rlinf_lightning.flow.trace import Span
from rlinf_lightning.flow.worker import StageError, Worker
from rlinf_lightning.flow.workflow import Workflow

__all__ = [
    "BatchShape",
    "Channel",
    "ChannelAborted",
    "ChannelTimeout",
    "EndOfIteration",
    "ExecutionPlan",
    "MemoryPart",
    "Message",
    "Metrics",
    "Span",
    "Stage",
    "StageContext",
    "StageError",
    "Worker",
    "WorkerGroup",
    "Workflow",
]
