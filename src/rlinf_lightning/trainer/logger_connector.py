"""LoggerConnector: the run's Lightning loggers, from the trainer's ``logger`` setting."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlinf_lightning.loggers import LOGGERS
from rlinf_lightning.registry import instantiate

#: what ``trainer.logger`` accepts: True/False, a name (``csv``, ``wandb``, ``tensorboard``), a
#: ``{class_path, init_args}`` dict, a Lightning logger, or a list of these
LoggerSpec = Any


class LoggerConnector:
    """Builds the loggers once per fit and fans every call out to all of them."""

    def __init__(self, spec: LoggerSpec, root: Path) -> None:
        self.specs = [] if spec is False or spec is None else spec if isinstance(spec, list) else [spec]
        self.root = root
        self.loggers: list[Any] = []

    def problems(self) -> list[tuple[str, str]]:
        return [
            ("trainer.logger", LOGGERS.unknown_message(s))
            for s in self.specs
            if isinstance(s, str) and s not in LOGGERS
        ]

    def setup(self) -> None:
        self.loggers = [
            LOGGERS.resolve("csv" if s is True else s, self.root)
            if isinstance(s, str | bool)
            else instantiate(s)
            for s in self.specs
        ]

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for lg in self.loggers:
            lg.log_metrics(metrics, step=step)

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        for lg in self.loggers:
            lg.log_hyperparams(params)

    def finalize(self, status: str) -> None:
        for lg in self.loggers:
            lg.finalize(status)


def hyperparameters(trainer: Any, policy: Any, task: Any, plan: Any) -> dict[str, Any]:
    """The plain (loggable) settings of the trainer, policy and task, flattened by section, and
    the plan's description."""

    def flat(prefix: str, obj: Any) -> dict[str, Any]:
        items = vars(obj).items() if hasattr(obj, "__dict__") else obj.items()
        out: dict[str, Any] = {}
        for k, v in items:
            if k.startswith("_"):
                continue
            if _plain(v):
                out[f"{prefix}/{k}"] = v
            elif isinstance(v, dict) or hasattr(v, "__dataclass_fields__"):
                out.update(flat(f"{prefix}/{k}", v))
        return out

    out = {**flat("trainer", trainer), **flat("policy", policy), **flat("task", task)}
    out["plan"] = plan.describe()  # groups, replicas, slots and micro-batch sizes
    return out


def _plain(v: Any) -> bool:
    return isinstance(v, (str, int, float, bool, type(None))) or (
        isinstance(v, tuple) and all(isinstance(x, (int, float)) for x in v)
    )
