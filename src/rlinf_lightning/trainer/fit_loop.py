"""FitLoop: one fit of a policy on a task under a plan: launch the workers, resume, run the
iterations (each queued while the previous one finishes, unless evaluation, a checkpoint or a
strategy's re-plan needs the workers idle), evaluate, checkpoint, apply re-plans, summarise."""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlinf_lightning.checkpoint import load_checkpoint, resolve_checkpoint, save_checkpoint, set_rng_state
from rlinf_lightning.errors import CheckpointError
from rlinf_lightning.flow.plan import ExecutionPlan
from rlinf_lightning.flow.trace import write_chrome_trace
from rlinf_lightning.launchers import LAUNCHERS
from rlinf_lightning.policies.lora import checkpoint_mismatch
from rlinf_lightning.strategies import Replan, RunInfo
from rlinf_lightning.trainer.logger_connector import hyperparameters

if TYPE_CHECKING:
    from rlinf_lightning.trainer.trainer import RLTrainer

log = logging.getLogger(__name__)


class FitLoop:
    """Drives the running workflow through ``trainer.max_iterations`` iterations."""

    def __init__(self, trainer: RLTrainer, policy: Any, task: Any) -> None:
        self.trainer, self.policy, self.task = trainer, policy, task
        self.connector = trainer.plan_connector
        self.workflow, self.plan = self.connector.workflow, self.connector.plan
        self.strategy = self.connector.strategy
        self.train = self.workflow.roles["train"]
        self.run_spec = trainer.run_spec
        self.spans: list[Any] = []  # every stage call, kept for the trace
        self.history: list[dict[str, float]] = []  # evaluations
        self.replan_s = 0.0  # seconds spent starting the workers of a new plan mid-run

    # -- the whole fit ---------------------------------------------------------------------------
    def run(self, ckpt_path: str | None) -> dict[str, Any]:
        t = self.trainer
        resume = self._read_checkpoint(ckpt_path)
        torch.manual_seed(t.seed)
        t.callback_connector.setup()
        t.default_root_dir.mkdir(parents=True, exist_ok=True)
        t.logger_connector.setup()
        log.info("%s", self.plan.describe())
        t.logger_connector.log_hyperparams(hyperparameters(t, self.policy, self.task, self.plan))
        t0 = time.perf_counter()
        self.runtime = self._launch(self.plan)
        self.strategy.on_launch(self._run_info(time.perf_counter() - t0))
        try:
            start_it = self._start(resume)
            train_s, samples = self._iterate(start_it)
            summary = self._summary(start_it, time.perf_counter() - t0, train_s, samples)
            (t.default_root_dir / "summary.json").write_text(json.dumps(summary, indent=1))
            t.logger_connector.finalize("success")
            t.callback_connector.call("on_fit_end", summary)
            return summary
        except BaseException as exc:
            t.callback_connector.call("on_exception", exc)
            t.logger_connector.finalize("failed")
            raise
        finally:
            self.runtime.shutdown()
            if t.trace:
                write_chrome_trace(t.trace, self.spans, self.plan)

    def _read_checkpoint(self, ckpt_path: str | None) -> tuple[Path, Any, Any, Any] | None:
        """Read (safely) before any worker starts, so a bad file fails now."""
        if not ckpt_path:
            return None
        path = resolve_checkpoint(ckpt_path, self.trainer.ckpt_dir)
        train_state, state, rng = load_checkpoint(path)
        if why := checkpoint_mismatch(self.policy, train_state["lora"]):
            raise CheckpointError(f"{path}: {why}")
        if (
            not train_state["lora"]
            and hasattr(self.policy, "check_state_dict")
            and (why := self.policy.check_state_dict(train_state["model"]))
        ):
            raise CheckpointError(f"{path}: {why}; resume with the policy that wrote it")
        return path, train_state, state, rng

    def _start(self, resume: tuple[Path, Any, Any, Any] | None) -> int:
        """Report the train engine, load the checkpoint into the workers, evaluate the start;
        returns the last iteration already done."""
        if hasattr(self.workflow.stages[self.train], "engine_info"):  # what auto resolved to, on its device
            engine = self.runtime.call(self.train, "engine_info")
            tis = engine.get("tis_cap")
            log.info(
                "%s: %s over %d replica(s), precision %s%s",
                self.train, engine["engine"], engine["world_size"], engine["precision"],
                "" if tis is None else f", truncated importance sampling (cap {tis})",
            )  # fmt: skip
        start_it = 0
        if resume is not None:
            path, train_state, state, rng = resume
            if (path / "sharded").is_dir():
                self.runtime.call(self.train, "load_sharded", str(path / "sharded"), replicas="all")
            else:
                self.runtime.call(self.train, "load_state_dict", train_state, replicas="all")
            self.runtime.resync()
            set_rng_state(rng)
            start_it, self.history = state["iteration"], state["eval_history"]
            log.info("resumed from %s at iteration %d", path, start_it)
        self.trainer.callback_connector.call("on_fit_start", self.policy)
        if not self.history:
            self.history.append(self._evaluate(0))
        return start_it

    # -- iterations ------------------------------------------------------------------------------
    def _iterate(self, start_it: int) -> tuple[float, int]:
        """Run iterations ``start_it + 1 .. max_iterations``; returns their seconds and samples."""
        t, calls = self.trainer, self.trainer.callback_connector
        per_iteration = self.task.batch_shape(self.run_spec).rollout_batch_size
        micro_batch: dict[int, int] = {}  # iteration -> its input's micro-batch size
        train_s, samples, queued = 0.0, 0, False
        for it in range(start_it + 1, t.max_iterations + 1):
            t.iteration = it
            calls.call("on_iteration_start", it)
            if not queued:
                t_ready = time.perf_counter()
                micro_batch[it] = self._start_iteration(it)
            queued = not self._idle_after(it)
            if queued:  # the workers start it the moment they finish this one
                micro_batch[it + 1] = self._start_iteration(it + 1)
            stage_metrics = self.runtime.finish_iteration()
            dt = time.perf_counter() - t_ready
            t_ready += dt
            train_s, samples = train_s + dt, samples + per_iteration
            spans = self.runtime.pop_spans()
            replan = self.strategy.observe(it, dt, spans, micro_batch.pop(it), queued)
            metrics = self._metrics(stage_metrics, spans, dt, per_iteration)
            t.logger_connector.log_metrics(metrics, it)
            calls.call("on_iteration_end", it, metrics)
            self._after_iteration(it)
            if replan is not None and it < t.max_iterations:
                self._replan(replan)
        return train_s, samples

    def _start_iteration(self, it: int) -> int:
        """Queue iteration ``it``'s input at the plan's current granularity; returns it."""
        micro_batch = self.plan.micro_batch_size[self.workflow.source_edge.channel]
        self.runtime.start_iteration(it, self.task.inputs(it, micro_batch, self.run_spec))
        return micro_batch

    def _idle_after(self, it: int) -> bool:
        """Whether the workers must be idle after iteration ``it`` (evaluation, checkpoint, the end)."""
        t = self.trainer
        return (
            it == t.max_iterations
            or self.strategy.holds_after(it)
            or bool(t.eval_every and it % t.eval_every == 0)
            or bool(t.ckpt_every and it % t.ckpt_every == 0)
        )

    def _after_iteration(self, it: int) -> None:
        """Evaluate and checkpoint when their cadence (or the end) says so."""
        t, last = self.trainer, it == self.trainer.max_iterations
        if last or (t.eval_every and it % t.eval_every == 0):
            self.history.append(self._evaluate(it))
        if last or (t.ckpt_every and it % t.ckpt_every == 0):
            self._save(it)

    def _metrics(
        self, stage_metrics: dict[str, dict[str, float]], spans: list[Any], dt: float, samples: int
    ) -> dict[str, float]:
        """What one iteration logs: each stage's metrics as ``stage/name``, busy seconds per stage
        (``time/stage``), throughput (``perf/*``, counts a stage reports as ``*_total`` per
        second), the strategy's metrics, and the train stage's MFU."""
        metrics = {f"{st}/{k}": v for st, m in stage_metrics.items() for k, v in m.items()}
        metrics.update(self._stage_seconds(spans))
        metrics.update(self.strategy.metrics)
        metrics["time/iteration"] = dt
        metrics["perf/samples_per_s"] = samples / dt
        for k, v in list(metrics.items()):  # counts a stage reports: tokens, env steps, ...
            if k.endswith("_total"):
                metrics[f"perf/{k.split('/')[-1].removesuffix('_total')}_per_s"] = v / dt
        metrics.update(self._mfu(metrics))
        return metrics

    def _stage_seconds(self, spans: list[Any]) -> dict[str, float]:
        """Busy seconds per stage this iteration, per replica of the stage's group."""
        out: dict[str, float] = {}
        if self.trainer.trace:
            self.spans.extend(spans)
        for s in spans:
            out[f"time/{s.stage}"] = out.get(f"time/{s.stage}", 0.0) + (s.end - s.start)
        return {k: v / self.plan.group_of(k[5:]).replicas for k, v in out.items()}

    def _mfu(self, metrics: dict[str, float]) -> dict[str, float]:
        """Model FLOPs utilisation of the train stage: its model FLOPs per replica over its busy
        seconds per replica times the measured peak of one replica's device."""
        flops, peak = metrics.get(f"{self.train}/flops_total"), metrics.get(f"{self.train}/peak_flops")
        busy = metrics.get(f"time/{self.train}")
        if not (flops and peak and busy):
            return {}
        return {"perf/mfu": flops / self.plan.group_of(self.train).replicas / (busy * peak)}

    # -- evaluation, checkpoints, re-plans -------------------------------------------------------
    def _evaluate(self, it: int) -> dict[str, float]:
        metrics = self.task.evaluate(self.runtime)
        self.trainer.logger_connector.log_metrics({f"eval/{k}": v for k, v in metrics.items()}, it)
        self.trainer.callback_connector.call("on_evaluation_end", it, metrics)
        return {"iteration": it, **metrics}

    def _save(self, it: int) -> None:
        t, train = self.trainer, self.train
        path = save_checkpoint(
            t.ckpt_dir,
            it,
            self.runtime.call(train, "state_dict", replicas="all")[0],
            {"eval_history": self.history, "seed": t.seed},
            write_extra=lambda tmp: self.runtime.call(
                train, "save_sharded", str(tmp / "sharded"), replicas="all"
            ),
        )
        t.callback_connector.call("on_save_checkpoint", str(path))

    def _replan(self, replan: Replan) -> None:
        """Run the next iterations under ``replan.plan``: the same groups take the new micro-batch
        sizes at once; other groups get new workers, which receive the training state (through a
        sharded checkpoint for a sharded engine) and the synced weights before they continue."""
        if self.plan.layout() != replan.plan.layout():
            t0 = time.perf_counter()
            self._restart_workers(replan.plan)
            took = time.perf_counter() - t0
            self.replan_s += took
            log.info("new workers running in %.1f s", took)
            self.strategy.on_relaunch(self._run_info(took))
        self.plan = self.connector.plan = replan.plan

    def _launcher(self, plan: ExecutionPlan) -> Any:
        """``plan``'s own launcher (a strategy may choose it), else the trainer's."""
        return LAUNCHERS.resolve(plan.launcher or self.trainer.launcher)

    def _launch(self, plan: ExecutionPlan) -> Any:
        return self._launcher(plan).launch(self.workflow, plan, timeout_s=self.trainer.timeout_s)

    def _run_info(self, launch_s: float) -> RunInfo:
        t = self.trainer
        separate = LAUNCHERS.resolve(t.launcher).separate_processes
        return RunInfo(t.default_root_dir, t.max_iterations, launch_s, separate)

    def _restart_workers(self, plan: ExecutionPlan) -> None:
        tmp, train = self.trainer.default_root_dir / ".replan", self.train
        sharded = self.runtime.call(train, "save_sharded", str(tmp), replicas="all")[0]
        state = None if sharded else self.runtime.call(train, "state_dict", replicas="all")[0]
        self.runtime.shutdown()
        log.info("%s", plan.describe())
        self.runtime = self._launch(plan)
        if sharded:
            self.runtime.call(train, "load_sharded", str(tmp), replicas="all")
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            self.runtime.call(train, "load_state_dict", state, replicas="all")
        self.runtime.resync()

    # -- the end ---------------------------------------------------------------------------------
    def _summary(self, start_it: int, wall_s: float, train_s: float, samples: int) -> dict[str, Any]:
        t, head, history = self.trainer, self.task.eval_metric, self.history
        extras = {k: v for k, v in history[-1].items() if k not in (head, "iteration")}
        summary = {
            f"eval_{head}_before": history[0][head],
            f"eval_{head}_after": history[-1][head],
            f"{head}_before": history[0][head],
            f"{head}_after": history[-1][head],
            **{f"eval_{k}": v for k, v in extras.items()},
            "eval_history": history,
            "iterations": t.max_iterations,
            "resumed_from_iteration": start_it,
            "wall_s": wall_s,
            "train_wall_s": train_s,
            "replan_s": self.replan_s,
            "samples_per_s": samples / train_s if train_s else 0.0,
            "strategy": self.plan.strategy,
            "train_engine": t.train_engine,
        }
        counts = ", ".join(f"{int(v)} {k}" for k, v in extras.items() if float(v).is_integer())
        log.info(
            "held-out %s: %.3f -> %.3f (%s%d iterations, %.0f s); summary: %s",
            head, history[0][head], history[-1][head], counts + ", " if counts else "",
            t.max_iterations - start_it, wall_s, t.default_root_dir / "summary.json",
        )  # fmt: skip
        return summary
