"""Tasks: what the policy is trained on (a dataset plus a reward, or an environment)."""

from rlinf_lightning.tasks.base import RunSpec, Task
from rlinf_lightning.tasks.data import Problem, generate_arithmetic, load_problems
from rlinf_lightning.tasks.embodied import EmbodiedTask
from rlinf_lightning.tasks.math import MathTask

__all__ = [
    "EmbodiedTask",
    "MathTask",
    "Problem",
    "RunSpec",
    "Task",
    "generate_arithmetic",
    "load_problems",
]
