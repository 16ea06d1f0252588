"""FitLoop: one fit of a policy on a task under a plan: launch the workers, resume, run the
iterations (each queued while the previous one finishes, or up to ``k + 1`` in flight under
``max_staleness`` k, unless evaluation, a checkpoint or a strategy's re-plan needs the workers
idle), evaluate, checkpoint, apply re-plans (starting a new plan's workers ahead, in the
background, when the strategy asks), summarise. Before an evaluation or the end, a lagged weight
sync is drained (the rollout takes the newest weights, so what is evaluated is the newest policy);
a checkpoint instead saves the versions the rollout holds back, so a run resumed from it lags, and
samples, exactly as the uninterrupted run does."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import yaml

from rlinf_lightning.checkpoint import (
    load_checkpoint,
    load_stage_states,
    load_sync_backlog,
    resolve_checkpoint,
    save_checkpoint,
    save_sync_backlog,
    set_rng_state,
)
from rlinf_lightning.errors import CheckpointError, ConfigError, RunError
from rlinf_lightning.flow.memory import apply_budgets, with_budgets
from rlinf_lightning.flow.plan import ExecutionPlan
from rlinf_lightning.flow.trace import write_chrome_trace
from rlinf_lightning.flow.worker import StageError
from rlinf_lightning.flow.workflow import Workflow
from rlinf_lightning.launchers import LAUNCHERS
from rlinf_lightning.launchers.base import merge_metrics
from rlinf_lightning.strategies import Replan, RunInfo
from rlinf_lightning.tools.loop import COUNTS as TOOL_COUNTS
from rlinf_lightning.trainer.ahead import AheadLaunch
from rlinf_lightning.trainer.failures import RunLog, failure_line
from rlinf_lightning.trainer.logger_connector import hyperparameters
from rlinf_lightning.trainer.restarts import LOST, Rewind, WorkerRestarts
from rlinf_lightning.trainer.run_config import algorithm_text, collision, resolved_config, resume_mismatch

if TYPE_CHECKING:
    from rlinf_lightning.trainer.trainer import RLTrainer

log = logging.getLogger(__name__)


#: stage metrics logged under their own name, not the stage's: what the run as a whole is asked
#: about (the staleness of ``trainer.max_staleness``, whichever stage trains)
RUN_NAMESPACES = ("async/",)


class FitLoop:
    """Drives the running workflow through ``trainer.max_iterations`` iterations."""

    def __init__(
        self, trainer: RLTrainer, policy: Any, task: Any, workflow: Workflow, plan: ExecutionPlan
    ) -> None:
        self.trainer, self.policy, self.task = trainer, policy, task
        self.workflow, self.plan = workflow, plan  # the plan the workers run; a re-plan replaces it
        self.strategy = trainer.plan_connector.strategy
        self.train = self.workflow.roles["train"]
        self.run_spec = trainer.run_spec
        self.spans: list[Any] = []  # every stage call, kept for the trace
        self.history: list[dict[str, float]] = []  # evaluations
        self.replan_s = 0.0  # seconds spent starting the workers of a new plan mid-run
        self.ahead: AheadLaunch | None = None  # workers the strategy asked to start in the background
        self.discarded: list[AheadLaunch] = []
        self.nonfinite: dict[str, int] = {}  # per learning stage, its skipped non-finite steps
        self.restarts = WorkerRestarts(trainer.max_worker_restarts, trainer.auto_resume)
        self.tools: dict[str, float] = {}  # multi-turn rollouts' counts (tools.loop.COUNTS), summed
        self.config = resolved_config(trainer, policy, task)  # recorded in the run dir, checkpoints, summary

    # -- the whole fit ---------------------------------------------------------------------------
    def run(self, ckpt_path: str | None) -> dict[str, Any]:
        """The fit; a stage that stops the run or runs out of memory ends it with a
        :class:`RunError` of one line, its traceback in ``run.log`` (``trainer.failures``)."""
        t = self.trainer
        # a new run, or one resuming a checkpoint from elsewhere (another run's), must not write
        # into a directory that holds a run of another configuration; one resuming its own
        # directory's checkpoint is judged against that checkpoint (``_read_checkpoint``)
        own = ckpt_path and resolve_checkpoint(ckpt_path, t.ckpt_dir).parent.resolve() == t.ckpt_dir.resolve()
        if not own and not t.allow_config_change and (problem := collision(t.ckpt_dir, self.config)):
            raise ConfigError([problem])
        resume = self._read_checkpoint(ckpt_path)
        t.default_root_dir.mkdir(parents=True, exist_ok=True)
        (t.default_root_dir / "config.yaml").write_text(yaml.safe_dump(self.config, sort_keys=False))
        self.run_log = RunLog(t.default_root_dir)
        try:
            return self._run(resume)
        except StageError as exc:
            line = failure_line(exc, self.workflow, self.plan, t.ckpt_dir, self.run_log.path)
            if line is None:
                raise
            self.run_log.failure(line, exc.tb)  # the terminal gets the line once, from the caller
            raise RunError(line) from None
        finally:
            self.run_log.close()

    def _run(self, resume: tuple[Path, Any, Any, Any, Any] | None) -> dict[str, Any]:
        t = self.trainer
        torch.manual_seed(t.seed)
        t.callback_connector.setup()
        t.logger_connector.setup()
        log.info("algorithm: %s", algorithm_text(self.run_spec.algorithm))
        log.info("%s", self.plan.describe(self.workflow))
        t.logger_connector.log_hyperparams(hyperparameters(t, self.policy, self.task, self.plan))
        t0 = time.perf_counter()
        self.runtime = self._launch(self.plan)
        self.strategy.on_launch(self._run_info(time.perf_counter() - t0))
        try:
            start_it = begin = self._start(resume)
            while True:
                try:
                    train_s, samples = self._iterate(begin)
                    break
                except Rewind as rewind:  # a learning stage's worker was lost (trainer.auto_resume)
                    begin = self._start(rewind.resume)
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
            self._follow_ahead(None)
            for a in self.discarded:
                a.join()
            if t.trace:
                write_chrome_trace(t.trace, self.spans, self.plan)

    def _read_checkpoint(self, ckpt_path: str | None) -> tuple[Path, Any, Any, Any, Any] | None:
        """Read (safely) before any worker starts, so a bad file fails now."""
        if not ckpt_path:
            return None
        path = resolve_checkpoint(ckpt_path, self.trainer.ckpt_dir)
        train_state, state, rng = load_checkpoint(path)
        why = resume_mismatch(path, state.get("config"), self.config)
        if why and not self.trainer.allow_config_change:
            raise CheckpointError(why)
        if why := self.policy.checkpoint_problem(train_state):
            raise CheckpointError(f"{path}: {why}")
        stage_states = load_stage_states(path)
        if unknown := sorted(set(stage_states) - set(self.workflow.stages)):
            raise CheckpointError(
                f"{path}: holds the state of stage(s) {unknown}, which this run's workflow has not "
                f"(stages: {', '.join(self.workflow.order)}); resume with the config that wrote it"
            )
        return path, train_state, state, rng, stage_states

    def _start(self, resume: tuple[Path, Any, Any, Any, Any] | None) -> int:
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
            path, train_state, state, rng, stage_states = resume
            if (path / "sharded").is_dir():
                self.runtime.call(self.train, "load_sharded", str(path / "sharded"), replicas="all")
            else:
                self.runtime.call(self.train, "load_state_dict", train_state, replicas="all")
            self._load_extra_states(stage_states)
            self.runtime.resync(state["iteration"], load_sync_backlog(path))
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
        train_s, samples, started = 0.0, 0, start_it  # started: the last iteration queued
        for it in range(start_it + 1, t.max_iterations + 1):
            t.iteration = it
            calls.call("on_iteration_start", it)
            if started < it:
                t_ready = time.perf_counter()
                started, micro_batch[it] = it, self._start_iteration(it)
            # the workers start the next ones the moment they finish this one
            while started < it + self.runtime.in_flight - 1 and not self._idle_after(started):
                started += 1
                micro_batch[started] = self._start_iteration(started)
            queued = started > it
            stage_metrics = self._finish_iteration(it, started, micro_batch)
            dt = time.perf_counter() - t_ready
            t_ready += dt
            train_s, samples = train_s + dt, samples + per_iteration
            spans = self.runtime.pop_spans()
            ready = self.ahead is not None and self.ahead.ready()
            replan = self.strategy.observe(it, dt, spans, micro_batch.pop(it), queued, ahead_ready=ready)
            metrics = self._metrics(stage_metrics, spans, dt, per_iteration)
            for k, v in metrics.items():
                if k.endswith("/nonfinite_steps"):
                    self.nonfinite[k.split("/")[0]] = int(v)
                if (count := k.removeprefix("rollout/tools/")) in TOOL_COUNTS:
                    self.tools[count] = self.tools.get(count, 0) + v
            t.logger_connector.log_metrics(metrics, it)
            calls.call("on_iteration_end", it, metrics)
            self._after_iteration(it)
            if replan is not None and it < t.max_iterations:
                self._replan(replan, it)
            self._follow_ahead(self.strategy.ahead() if it < t.max_iterations else None)
        return train_s, samples

    def _finish_iteration(
        self, it: int, started: int, micro_batch: dict[int, int]
    ) -> dict[str, dict[str, float]]:
        """Iteration ``it``'s stage metrics; where a worker was lost, the workers are restarted
        (``trainer.restarts``) and the iterations up to ``started`` not yet trained on are queued
        again from their inputs."""
        while True:
            try:
                return self.runtime.finish_iteration()
            except LOST as exc:
                done = self.restarts.recover(self, exc, it)
                for i in range(it + done, started + 1):
                    micro_batch[i] = self._start_iteration(i)
                if done:  # what the workers that answered it measured (the lost ones' is gone)
                    return merge_metrics([m for m, _ in getattr(exc, "answers", {}).values()])

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
            self.runtime.drain(it)
            self.history.append(self._evaluate(it))
        if last or (t.ckpt_every and it % t.ckpt_every == 0):
            self._save(it)

    def _metrics(
        self, stage_metrics: dict[str, dict[str, float]], spans: list[Any], dt: float, samples: int
    ) -> dict[str, float]:
        """What one iteration logs: each stage's metrics as ``stage/name`` (one in a run-wide
        namespace, :data:`RUN_NAMESPACES`, such as the learner's ``async/staleness``, as it is; a
        user's ``self.log("policy/x")`` stays ``actor/policy/x``), busy seconds per stage
        (``time/stage``), throughput (``perf/*``, counts a stage reports as ``*_total`` per
        second), the strategy's metrics, and the train stage's MFU."""
        metrics = {
            (k if k.startswith(RUN_NAMESPACES) else f"{st}/{k}"): v
            for st, m in stage_metrics.items()
            for k, v in m.items()
        }
        metrics.update(self._stage_seconds(spans))
        metrics.update(self.strategy.metrics)
        metrics.update(self.restarts.metrics)
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
        head = self.task.eval_metric  # NaN elsewhere: a metric the env cannot report (no success)
        metrics = {k: v for k, v in metrics.items() if k == head or v == v}
        self.trainer.logger_connector.log_metrics({f"eval/{k}": v for k, v in metrics.items()}, it)
        self.trainer.callback_connector.call("on_evaluation_end", it, metrics)
        return {"iteration": it, **metrics}

    def _save(self, it: int) -> None:
        t, train = self.trainer, self.train
        held_back = self.runtime.held_back(it)

        def write_extra(tmp: Path) -> None:
            self.runtime.call(train, "save_sharded", str(tmp / "sharded"), replicas="all")
            if held_back:
                save_sync_backlog(tmp, held_back)

        path = save_checkpoint(
            t.ckpt_dir,
            it,
            self.runtime.call(train, "state_dict", replicas="all")[0],
            {"eval_history": self.history, "seed": t.seed, "config": self.config},
            write_extra=write_extra,
            stage_states=self._extra_states(),
            keep=t.ckpt_keep,
        )
        t.callback_connector.call("on_save_checkpoint", str(path))

    def _replan(self, replan: Replan, it: int) -> None:
        """Run the next iterations under ``replan.plan``: the same groups take the new micro-batch
        sizes at once; other groups get new workers, which receive the training state (through a
        sharded checkpoint for a sharded engine) and the synced weights before they continue."""
        plan, _ = with_budgets(self.workflow, replan.plan)  # the strategy's ranking checked it
        replan = dataclasses.replace(replan, plan=plan)
        moved = self.plan.layout() != replan.plan.layout()
        if moved and self.runtime.adopt(replan.plan):
            apply_budgets(self.workflow, replan.plan)
            log.info("the same workers run the new plan:\n%s", replan.plan.describe(self.workflow))
        elif moved:
            t0 = time.perf_counter()
            if self.ahead and self.ahead.layout != replan.plan.layout():  # not those: still wanted?
                self._follow_ahead(self.strategy.ahead())  # if not, stopped before others start
            ahead = self.ahead if self.ahead and self.ahead.layout == replan.plan.layout() else None
            self.ahead = None if ahead else self.ahead
            waited = self._restart_workers(replan.plan, it, ahead)
            took = time.perf_counter() - t0
            self.replan_s += took
            if ahead is None:
                log.info("new workers running in %.1f s", took)
                self.strategy.on_relaunch(self._run_info(took))
            else:  # what the switch would have taken without the head start
                log.info("new workers (started %.1f s ahead) running after %.1f s", ahead.launch_s, took)
                self.strategy.on_relaunch(self._run_info(took - waited + ahead.launch_s))
        else:  # the same workers, other micro-batch sizes
            apply_budgets(self.workflow, replan.plan)
        self.plan = replan.plan

    def _launcher(self, plan: ExecutionPlan) -> Any:
        """``plan``'s own launcher (a strategy may choose it), else the trainer's."""
        return LAUNCHERS.resolve(plan.launcher or self.trainer.launcher)

    def _launch(self, plan: ExecutionPlan) -> Any:
        apply_budgets(self.workflow, plan)  # what the workers start with
        return self._launcher(plan).launch(self.workflow, plan, timeout_s=self.trainer.timeout_s)

    def _run_info(self, launch_s: float) -> RunInfo:
        t = self.trainer
        launcher = LAUNCHERS.resolve(t.launcher)
        return RunInfo(
            t.default_root_dir,
            t.max_iterations,
            launch_s,
            launcher.separate_processes,
            launcher.background_start,
        )

    def _follow_ahead(self, plan: ExecutionPlan | None) -> None:
        """Keep the workers started ahead for ``plan``, start them, or stop those of another."""
        layout = None if plan is None else plan.layout()
        if self.ahead is not None and self.ahead.layout == layout:
            return
        if self.ahead is not None:
            self.ahead.discard()
            self.discarded.append(self.ahead)
            self.ahead = None
        if plan is not None and layout != self.plan.layout() and self._launcher(plan).background_start:
            log.info("starting ahead, in the background:\n%s", plan.describe(self.workflow))
            self.ahead = AheadLaunch(lambda: self._launch(plan), layout)

    def _restart_workers(
        self, plan: ExecutionPlan, it: int, ahead: AheadLaunch | None = None, lost: set[str] = frozenset()
    ) -> float:
        """Carry the training state to ``plan``'s workers (``ahead``'s, once set up, else new
        ones), at version ``it``; the ``lost`` stages' workers are gone (a restart: their new
        copies start as set up). Returns the seconds spent waiting for ``ahead``."""
        tmp, train = self.trainer.default_root_dir / ".replan", self.train
        sharded = self.runtime.call(train, "save_sharded", str(tmp), replicas="all")[0]
        state = None if sharded else self.runtime.call(train, "state_dict", replicas="all")[0]
        extra = self._extra_states(skip=lost)
        held_back = self.runtime.held_back(it)  # a lagging rollout lags on the new workers too
        self.runtime.shutdown()
        t0 = time.perf_counter()
        if ahead is None:
            log.info("%s", plan.describe(self.workflow))
            self.runtime = self._launch(plan)
        else:
            self.runtime = ahead.take()
        waited = time.perf_counter() - t0 if ahead is not None else 0.0
        if sharded:
            self.runtime.call(train, "load_sharded", str(tmp), replicas="all")
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            self.runtime.call(train, "load_state_dict", state, replicas="all")
        self._load_extra_states(extra)
        self.runtime.resync(it, held_back)
        return waited

    def _extra_states(self, skip: set[str] = frozenset()) -> dict[str, dict[str, Any]]:
        """Every stage's ``extra_state`` that is not empty, by stage name (not ``skip``'s)."""
        states = {n: self.runtime.call(n, "extra_state") for n in self.workflow.order if n not in skip}
        return {name: state for name, state in states.items() if state}

    def _load_extra_states(self, states: dict[str, dict[str, Any]]) -> None:
        for name, state in states.items():
            self.runtime.call(name, "load_extra_state", state, replicas="all")

    # -- the end ---------------------------------------------------------------------------------
    def _summary(self, start_it: int, wall_s: float, train_s: float, samples: int) -> dict[str, Any]:
        t, head, history = self.trainer, self.task.eval_metric, self.history
        extras = {k: v for k, v in history[-1].items() if k not in (head, "iteration")}
        summary = {
            "eval_metric": head,
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
            "algorithm": type(self.run_spec.algorithm).__name__,
            "nonfinite_steps": self.nonfinite,
            "workers/restarts": self.restarts.count,
            **({"tools": self.tools} if self.tools else {}),  # counts over this fit's iterations
            "config": self.config,
        }
        counts = ", ".join(f"{int(v)} {k}" for k, v in extras.items() if float(v).is_integer())
        log.info(
            "held-out %s: %.3f -> %.3f (%s%d iterations, %.0f s); summary: %s",
            head, history[0][head], history[-1][head], counts + ", " if counts else "",
            t.max_iterations - start_it, wall_s, t.default_root_dir / "summary.json",
        )  # fmt: skip
        return summary
