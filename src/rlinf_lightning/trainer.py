"""RLTrainer: validates the config, asks the task for its workflow and the strategy for a plan,
launches it, runs iterations, logs, evaluates and checkpoints.

    trainer = RLTrainer(algorithm="grpo", strategy="collocated", rollout="hf", max_iterations=100)
    trainer.fit(policy, task)  # an RLModule, and a Task (rlinf_lightning.tasks)

Strategies, launchers, rollout engines, train engines, algorithms and rewards are resolved by name
through their registries, and the task supplies the workflow, each iteration's input and the
evaluation; the trainer reaches stages only through the workflow's roles (``train``). So this
module never branches on which strategy, engine, task or stage it drives.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from rlinf_lightning.algorithms import ALGORITHMS
from rlinf_lightning.callbacks import ProgressBar
from rlinf_lightning.checkpoint import load_checkpoint, resolve_checkpoint, save_checkpoint, set_rng_state
from rlinf_lightning.engines.precision import DTYPES, PRECISIONS
from rlinf_lightning.engines.rollout import ROLLOUT_ENGINES, SamplingParams
from rlinf_lightning.engines.train import TRAIN_ENGINES, TrainSpec, resolve_train_engine
from rlinf_lightning.errors import CheckpointError, ConfigError
from rlinf_lightning.flow.memory import memory_problems
from rlinf_lightning.flow.plan import ExecutionPlan
from rlinf_lightning.flow.trace import write_chrome_trace
from rlinf_lightning.flow.workflow import Workflow
from rlinf_lightning.launchers import LAUNCHERS
from rlinf_lightning.loggers import LOGGERS
from rlinf_lightning.strategies import STRATEGIES, Replan, Resources, RunInfo

LoggerSpec = (
    Any  # True/False, "csv" | "wandb" | "tensorboard", a {class_path, init_args} dict, a Logger, or a list
)


class RLTrainer:
    """Runs RL post-training of a policy on a task.

    Args:
        algorithm: algorithm name (``grpo``) or an algorithm object such as ``GRPO(kl_coef=0.01)``.
        strategy: execution plan strategy: a name (``collocated``: data-parallel replicas on every
            slot; ``collocated_offload``, ``disaggregated``, ``hybrid``), a ``Strategy`` object (e.g.
            ``HybridStrategy(placement="rollout: 0, reward,advantage,inference,actor: 1")`` or
            ``CollocatedStrategy(replicas=1)``), or a ``{class_path, init_args}`` dict.
        launcher: how workers start: ``inprocess`` (default; threads of this process), ``processes``
            (one OS process per worker), ``ray`` (Ray actors), or a launcher object.
        rollout: rollout engine name (``hf``; ``vllm`` with the plugin).
        rollout_dtype: the rollout engine's weights and compute dtype (``float32``, ``bfloat16``,
            ``float16``; ``None``: the policy's ``dtype``). The actor's float32 weights are cast at
            each sync; ``actor/approx_kl`` measures the log-prob mismatch this causes, and
            ``GRPO(tis_cap=...)`` corrects for it.
        train_strategy: how the actor trains over the replicas of the group the plan puts it on:
            ``auto`` (``single`` on one replica, ``ddp`` on more), ``single``, ``ddp``, or ``fsdp``
            (FSDP2 shards the state; one process per replica).
        train_engine_options: keyword arguments of the train engine, e.g. for ``ddp``/``fsdp``
            ``{malloc_mmap_threshold_mb: null}``.
        precision: how the actor trains, with Lightning's names: ``32-true``, ``bf16-mixed``
            (float32 master weights and optimizer state, bf16 autocast forward and backward;
            log-probs and losses in float32), ``bf16-true``, or ``auto`` (``bf16-mixed`` where the
            device computes bf16 natively: a GPU with bf16, a CPU with AVX512-BF16 or AMX; else
            ``32-true``).
        accelerator: what a device slot is: ``cpu``, ``cuda``, or ``auto`` (``cuda`` when available).
        devices: device slots per node (GPUs, or shares of the cores on CPU).
        num_nodes: number of machines.
        max_iterations: RL iterations (one optimizer step each).
        group_size: completions sampled per prompt (GRPO's group; at least 2).
        rollout_batch_size: samples per iteration (prompts x group_size).
        micro_batch_size: samples per message between stages (a multiple of ``group_size``;
            default: the strategy's choice, the whole batch for collocated, a quarter for pipelined).
        train_micro_batch_size: samples per forward/backward in the actor (gradient accumulation;
            default: each arriving micro-batch at once).
        train_max_tokens_per_micro_batch: instead, cut the actor's micro-batches by tokens: samples
            sorted by length, as many per forward/backward as fit ``rows x longest row <= this``.
            Either way each micro-batch is trimmed to its longest prompt and response, so padding
            costs no compute.
        sampling: temperature, top_p, top_k and max_new_tokens for rollouts.
        eval_every: evaluate on the held-out split every this many iterations (0: only before and after).
        ckpt_every: checkpoint every this many iterations (0: only at the end).
        default_root_dir: run directory (logs, checkpoints, ``summary.json``).
        logger: ``True`` for a CSVLogger (``<default_root_dir>/logs/version_N/metrics.csv``; a resumed
            run writes the next version, so nothing is overwritten), ``False`` for none, a name
            (``csv``, ``wandb``, ``tensorboard``), a ``{class_path, init_args}`` dict, a Lightning
            logger, or a list.
        callbacks: Lightning-style callbacks (objects or ``{class_path, init_args}`` dicts).
        enable_progress_bar: print one progress line per iteration.
        seed: seeds data order, sampling and initialisation.
        timeout_s: longest wait for any stage's input before the run fails instead of hanging.
        num_threads: torch threads per device slot on CPU (0: the machine's cores shared evenly).
        trace: write a Chrome trace-event JSON of every stage call here (open in Perfetto).
    """

    def __init__(
        self,
        algorithm: Any = "grpo",
        strategy: Any = "collocated",
        launcher: Any = "inprocess",
        rollout: str = "hf",
        rollout_dtype: str | None = None,
        train_strategy: str = "auto",
        train_engine_options: dict[str, Any] | None = None,
        precision: str = "auto",
        accelerator: str = "auto",
        devices: int = 1,
        num_nodes: int = 1,
        max_iterations: int = 100,
        group_size: int = 8,
        rollout_batch_size: int = 128,
        micro_batch_size: int | None = None,
        train_micro_batch_size: int | None = None,
        train_max_tokens_per_micro_batch: int | None = None,
        sampling: SamplingParams | None = None,
        eval_every: int = 0,
        ckpt_every: int = 0,
        default_root_dir: str = "runs/default",
        logger: LoggerSpec = True,
        callbacks: list[Any] | None = None,
        enable_progress_bar: bool = True,
        seed: int = 0,
        timeout_s: float = 600.0,
        num_threads: int = 0,
        trace: str | None = None,
    ) -> None:
        self.algorithm = algorithm
        self.strategy = strategy
        self.launcher = launcher
        self.rollout = rollout
        self.rollout_dtype = rollout_dtype
        self.train_strategy = train_strategy
        self.train_engine_options = dict(train_engine_options or {})
        self.precision = precision
        self.accelerator = accelerator
        self.devices = devices
        self.num_nodes = num_nodes
        self.max_iterations = max_iterations
        self.group_size = group_size
        self.rollout_batch_size = rollout_batch_size
        self.micro_batch_size = micro_batch_size
        self.train_micro_batch_size = train_micro_batch_size
        self.train_max_tokens_per_micro_batch = train_max_tokens_per_micro_batch
        self.sampling = sampling or SamplingParams()
        self.eval_every = eval_every
        self.ckpt_every = ckpt_every
        self.default_root_dir = Path(default_root_dir)
        self.logger_spec = logger
        self.callbacks: list[Any] = list(callbacks or [])
        self.enable_progress_bar = enable_progress_bar
        self.seed = seed
        self.timeout_s = timeout_s
        self.num_threads = num_threads
        self.trace = trace
        self.iteration = 0
        self.loggers: list[Any] = []

    # -- configuration ---------------------------------------------------------------------------
    @property
    def train_spec(self) -> TrainSpec:
        """How the task's learning stage trains (engine, its options, precision)."""
        return TrainSpec(self.train_strategy, self.train_engine_options, self.precision)

    def validate(self, policy: Any = None, task: Any = None) -> None:
        """Raise :class:`ConfigError` naming every bad key; loads nothing heavy."""
        p: list[tuple[str, str]] = []
        for key, reg in (
            ("algorithm", ALGORITHMS),
            ("strategy", STRATEGIES),
            ("launcher", LAUNCHERS),
            ("rollout", ROLLOUT_ENGINES),
            ("train_strategy", TRAIN_ENGINES),
        ):
            value = getattr(self, key)
            name = resolve_train_engine(value, 1) if key == "train_strategy" else value
            if isinstance(name, str) and name not in reg:
                p.append((f"trainer.{key}", reg.unknown_message(value)))
        positive = ("devices", "num_nodes", "max_iterations", "rollout_batch_size")
        for key in positive + (
            "micro_batch_size",
            "train_micro_batch_size",
            "train_max_tokens_per_micro_batch",
        ):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                p.append((f"trainer.{key}", f"must be >= 1, got {getattr(self, key)}"))
        if self.train_micro_batch_size and self.train_max_tokens_per_micro_batch:
            p.append(
                (
                    "trainer.train_max_tokens_per_micro_batch",
                    "set either this or trainer.train_micro_batch_size (samples), not both",
                )
            )
        if self.group_size < 2:
            p.append(
                (
                    "trainer.group_size",
                    f"must be >= 2 (advantages compare samples of a prompt), got {self.group_size}",
                )
            )
        elif self.rollout_batch_size % self.group_size:
            nearest = max(1, self.rollout_batch_size // self.group_size) * self.group_size
            p.append(
                (
                    "trainer.rollout_batch_size",
                    f"{self.rollout_batch_size} is not divisible by trainer.group_size={self.group_size}; "
                    f"use a multiple such as {nearest}",
                )
            )
        elif self.micro_batch_size and (
            self.micro_batch_size % self.group_size or self.rollout_batch_size % self.micro_batch_size
        ):
            p.append(
                (
                    "trainer.micro_batch_size",
                    f"{self.micro_batch_size} must be a multiple of trainer.group_size={self.group_size} "
                    f"that divides trainer.rollout_batch_size={self.rollout_batch_size}",
                )
            )
        s = self.sampling
        if s.temperature <= 0:
            p.append(("trainer.sampling.temperature", f"must be > 0 for RL sampling, got {s.temperature}"))
        if not 0 < s.top_p <= 1:
            p.append(("trainer.sampling.top_p", f"must be in (0, 1], got {s.top_p}"))
        if s.max_new_tokens < 1:
            p.append(("trainer.sampling.max_new_tokens", f"must be >= 1, got {s.max_new_tokens}"))
        for key in ("eval_every", "ckpt_every", "num_threads"):
            if getattr(self, key) < 0:
                p.append((f"trainer.{key}", f"must be >= 0, got {getattr(self, key)}"))
        if self.timeout_s <= 0:
            p.append(("trainer.timeout_s", f"must be > 0, got {self.timeout_s}"))
        if self.rollout_dtype is not None and self.rollout_dtype not in DTYPES:
            p.append(
                (
                    "trainer.rollout_dtype",
                    f"must be float32, bfloat16, float16 or null, got {self.rollout_dtype!r}",
                )
            )
        if self.precision not in PRECISIONS:
            p.append(("trainer.precision", f"must be one of {', '.join(PRECISIONS)}; got {self.precision!r}"))
        if self.accelerator not in ("auto", "cpu", "cuda"):
            p.append(("trainer.accelerator", f"must be auto, cpu or cuda, got {self.accelerator!r}"))
        elif self.accelerator == "cuda" and not torch.cuda.is_available():
            p.append(("trainer.accelerator", "cuda was asked for but torch sees no GPU; use cpu or auto"))
        p += self._logger_problems()
        launcher = self.launcher if isinstance(self.launcher, str) else None
        if launcher in LAUNCHERS and self.num_nodes > 1 and not LAUNCHERS.get(launcher).multi_node:
            p.append(
                (
                    "trainer.num_nodes",
                    f"{self.num_nodes} nodes, but launcher {launcher!r} runs every worker on this machine; "
                    "use trainer.launcher=ray for several machines",
                )
            )
        for section, obj in (("policy", policy), ("task", task)):
            if obj is not None and hasattr(obj, "validate_config"):
                p += [(f"{section}.{k}", m) for k, m in obj.validate_config()]
        if not p and policy is not None and task is not None:
            p += self._check_plan(policy, task)
        if p:
            raise ConfigError(p)

    def _check_plan(self, policy: Any, task: Any) -> list[tuple[str, str]]:
        """Whether the task's workflow has a plan on these resources that every stage can run on,
        and whose estimated memory fits the devices (``flow.memory``)."""
        try:
            workflow, plan = self._build_plan(policy, task)
        except ValueError as exc:  # the strategy cannot place this workflow on these resources
            return [("trainer.strategy", str(exc))]
        separate = LAUNCHERS.resolve(instantiate(self.launcher)).separate_processes
        placement = [
            problem
            for g in plan.groups
            for s in g.stages
            for problem in workflow.stages[s].check_placement(g.replicas, separate)
        ]
        return placement or memory_problems(workflow, plan)

    def _build_plan(self, policy: Any, task: Any) -> tuple[Workflow, ExecutionPlan]:
        """The task's workflow (stages built from config only, nothing loaded) and the strategy's plan."""
        workflow = task.build_workflow(policy, self)
        workflow.validate()
        workflow.check_keys(task.input_keys)
        if "train" not in workflow.roles:
            raise ValueError(f"workflow {workflow.name!r} names no stage with role 'train'")
        accelerator = self.accelerator
        if accelerator == "auto":
            accelerator = "cuda" if torch.cuda.is_available() else "cpu"
        resources = Resources(self.devices, self.num_nodes, accelerator, self.num_threads)
        batch = task.batch_shape(self)
        self._strategy = STRATEGIES.resolve(instantiate(self.strategy))
        plan = self._strategy.plan(workflow, resources, batch)
        plan.validate(workflow, len(resources.slots))
        return workflow, plan

    # -- loggers and callbacks -------------------------------------------------------------------
    def _build_loggers(self) -> list[Any]:
        spec = self.logger_spec
        if spec is False or spec is None:
            return []
        specs = spec if isinstance(spec, list) else [spec]
        return [
            LOGGERS.resolve("csv" if s is True else s, self.default_root_dir)
            if isinstance(s, str | bool)
            else instantiate(s)
            for s in specs
        ]

    def _logger_problems(self) -> list[tuple[str, str]]:
        spec = self.logger_spec
        specs = spec if isinstance(spec, list) else [spec]
        return [
            ("trainer.logger", LOGGERS.unknown_message(s))
            for s in specs
            if isinstance(s, str) and s not in LOGGERS
        ]

    def _call(self, hook: str, *args: Any) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(self, *args)

    def _log(self, metrics: dict[str, float], step: int) -> None:
        for lg in self.loggers:
            lg.log_metrics(metrics, step=step)

    # -- fit ---------------------------------------------------------------------------------------
    def fit(self, policy: Any, task: Any, ckpt_path: str | None = None) -> dict[str, Any]:
        """Train ``policy`` on ``task``; resume from ``ckpt_path`` (a directory or ``"last"``)."""
        self.validate(policy, task)
        resume = resolve_checkpoint(ckpt_path, self.ckpt_dir) if ckpt_path else None
        if resume is not None:  # read (safely) before any worker starts: a bad file fails now
            train_state, state, rng = load_checkpoint(resume)
            if hasattr(policy, "check_state_dict") and (why := policy.check_state_dict(train_state["model"])):
                raise CheckpointError(f"{resume}: {why}; resume with the policy that wrote it")
        torch.manual_seed(self.seed)
        launcher = LAUNCHERS.resolve(instantiate(self.launcher))
        self.callbacks = [instantiate(c) for c in self.callbacks]
        if self.enable_progress_bar and not any(isinstance(c, ProgressBar) for c in self.callbacks):
            self.callbacks.append(ProgressBar())
        self.default_root_dir.mkdir(parents=True, exist_ok=True)
        self.loggers = self._build_loggers()

        workflow, self.plan = self._build_plan(policy, task)
        samples_per_iteration = task.batch_shape(self).rollout_batch_size
        print(self.plan.describe(), flush=True)
        for lg in self.loggers:
            lg.log_hyperparams(self.hparams(policy, task))

        start_it, history = 0, []
        self._spans: list[Any] = []
        self.replan_s = 0.0  # seconds spent starting the workers of a new plan mid-run
        train = workflow.roles["train"]
        t_start = time.perf_counter()
        runtime = launcher.launch(workflow, self.plan, timeout_s=self.timeout_s)
        launch_s = time.perf_counter() - t_start
        self._strategy.on_launch(RunInfo(self.default_root_dir, self.max_iterations, launch_s))
        try:
            if hasattr(workflow.stages[train], "engine_info"):  # what auto resolved to, on its device
                engine = runtime.call(train, "engine_info")
                print(
                    f"{train}: {engine['engine']} over {engine['world_size']} replica(s),"
                    f" precision {engine['precision']}",
                    flush=True,
                )
            if resume is not None:
                if (resume / "sharded").is_dir():
                    runtime.call(train, "load_sharded", str(resume / "sharded"), replicas="all")
                else:
                    runtime.call(train, "load_state_dict", train_state, replicas="all")
                runtime.resync()
                set_rng_state(rng)
                start_it, history = state["iteration"], state["eval_history"]
                print(f"resumed from {resume} at iteration {start_it}", flush=True)
            self._call("on_fit_start", policy)
            if not history:
                history.append(self._evaluate(runtime, task, 0))
            source = workflow.source_edge.channel
            micro_batch: dict[int, int] = {}  # iteration -> its input's micro-batch size

            def start(i: int) -> None:
                micro_batch[i] = self.plan.micro_batch_size[source]
                runtime.start_iteration(i, task.inputs(i, micro_batch[i], self))

            samples, train_s, started = 0, 0.0, False
            for it in range(start_it + 1, self.max_iterations + 1):
                self.iteration = it
                self._call("on_iteration_start", it)
                if not started:
                    t_ready = time.perf_counter()
                    start(it)
                started = not self._idle_after(it)
                if started:  # queued now, the workers start it the moment they finish this one
                    start(it + 1)
                stage_metrics = runtime.finish_iteration()
                dt = time.perf_counter() - t_ready
                t_ready += dt
                samples += samples_per_iteration
                train_s += dt
                spans = runtime.pop_spans()
                replan = self._strategy.observe(it, dt, spans, micro_batch.pop(it), started)
                metrics = {f"{st}/{k}": v for st, m in stage_metrics.items() for k, v in m.items()}
                metrics.update(self._stage_seconds(spans))
                metrics.update(self._strategy.metrics)
                metrics["time/iteration"] = dt
                metrics["perf/samples_per_s"] = samples_per_iteration / dt
                for k, v in list(metrics.items()):  # counts a stage reports: tokens, env steps, ...
                    if k.endswith("_total"):
                        metrics[f"perf/{k.split('/')[-1].removesuffix('_total')}_per_s"] = v / dt
                metrics.update(self._mfu(metrics, train))
                self._log(metrics, it)
                self._call("on_iteration_end", it, metrics)
                if self.eval_every and it % self.eval_every == 0 and it != self.max_iterations:
                    history.append(self._evaluate(runtime, task, it))
                if it == self.max_iterations or (self.ckpt_every and it % self.ckpt_every == 0):
                    if it == self.max_iterations:
                        history.append(self._evaluate(runtime, task, it))
                    self._save(runtime, train, it, history)
                if replan is not None and it < self.max_iterations:
                    runtime = self._replan(replan, runtime, launcher, workflow, train)
            summary = self._summary(task, history, start_it, time.perf_counter() - t_start, train_s, samples)
            (self.default_root_dir / "summary.json").write_text(json.dumps(summary, indent=1))
            for lg in self.loggers:
                lg.finalize("success")
            self._call("on_fit_end", summary)
            return summary
        except BaseException as exc:
            self._call("on_exception", exc)
            for lg in self.loggers:
                lg.finalize("failed")
            raise
        finally:
            runtime.shutdown()
            if self.trace:
                write_chrome_trace(self.trace, self._spans, self.plan)

    def _summary(
        self,
        task: Any,
        history: list[dict[str, float]],
        start_it: int,
        wall_s: float,
        train_s: float,
        samples: int,
    ) -> dict[str, Any]:
        head = task.eval_metric
        extras = {k: v for k, v in history[-1].items() if k not in (head, "iteration")}
        summary = {
            f"eval_{head}_before": history[0][head],
            f"eval_{head}_after": history[-1][head],
            f"{head}_before": history[0][head],
            f"{head}_after": history[-1][head],
            **{f"eval_{k}": v for k, v in extras.items()},
            "eval_history": history,
            "iterations": self.max_iterations,
            "resumed_from_iteration": start_it,
            "wall_s": wall_s,
            "train_wall_s": train_s,
            "samples_per_s": samples / train_s if train_s else 0.0,
            "strategy": self.plan.strategy,
            "rollout": self.rollout,
            "train_strategy": self.train_strategy,
        }
        counts = ", ".join(f"{int(v)} {k}" for k, v in extras.items() if float(v).is_integer())
        print(
            f"held-out {head}: {history[0][head]:.3f} -> {history[-1][head]:.3f}"
            f" ({counts + ', ' if counts else ''}{self.max_iterations - start_it} iterations,"
            f" {wall_s:.0f} s); summary: {self.default_root_dir / 'summary.json'}",
            flush=True,
        )
        return summary

    def _idle_after(self, it: int) -> bool:
        """Whether the workers must be idle after iteration ``it`` (evaluation, checkpoint, the end)."""
        return (
            it == self.max_iterations
            or self._strategy.holds_after(it)
            or bool(self.eval_every and it % self.eval_every == 0)
            or bool(self.ckpt_every and it % self.ckpt_every == 0)
        )

    @property
    def ckpt_dir(self) -> Path:
        return self.default_root_dir / "checkpoints"

    def _evaluate(self, runtime: Any, task: Any, it: int) -> dict[str, float]:
        self.eval_metric = task.eval_metric
        metrics = task.evaluate(runtime)
        self._log({f"eval/{k}": v for k, v in metrics.items()}, it)
        self._call("on_evaluation_end", it, metrics[task.eval_metric])
        return {"iteration": it, **metrics}

    def _mfu(self, metrics: dict[str, float], train: str) -> dict[str, float]:
        """Model FLOPs utilisation of the train stage: its model FLOPs per replica over its busy
        seconds per replica times the measured peak of one replica's device."""
        flops, peak = metrics.get(f"{train}/flops_total"), metrics.get(f"{train}/peak_flops")
        busy = metrics.get(f"time/{train}")
        if not (flops and peak and busy):
            return {}
        return {"perf/mfu": flops / self.plan.group_of(train).replicas / (busy * peak)}

    def _replan(self, replan: Replan, runtime: Any, launcher: Any, workflow: Workflow, train: str) -> Any:
        """Run the next iterations under ``replan.plan``: the same groups take the new micro-batch
        sizes at once; other groups get new workers, which receive the training state (through a
        sharded checkpoint for a sharded engine) and the synced weights before they continue."""

        def layout(plan: ExecutionPlan) -> list[tuple]:
            return [(g.name, g.stages, g.slots, g.slots_per_replica, g.schedule) for g in plan.groups]

        if layout(self.plan) == layout(replan.plan):
            self.plan = replan.plan
            return runtime
        t0 = time.perf_counter()
        tmp = self.default_root_dir / ".replan"
        sharded = runtime.call(train, "save_sharded", str(tmp), replicas="all")[0]
        state = None if sharded else runtime.call(train, "state_dict", replicas="all")[0]
        runtime.shutdown()
        self.plan = replan.plan
        print(self.plan.describe(), flush=True)
        runtime = launcher.launch(workflow, self.plan, timeout_s=self.timeout_s)
        if sharded:
            runtime.call(train, "load_sharded", str(tmp), replicas="all")
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            runtime.call(train, "load_state_dict", state, replicas="all")
        runtime.resync()
        self.replan_s += time.perf_counter() - t0
        print(f"new workers running in {time.perf_counter() - t0:.1f} s", flush=True)
        return runtime

    def _stage_seconds(self, spans: list[Any]) -> dict[str, float]:
        """Busy seconds per stage this iteration, per replica of the stage's group."""
        out: dict[str, float] = {}
        if self.trace:
            self._spans.extend(spans)
        for s in spans:
            out[f"time/{s.stage}"] = out.get(f"time/{s.stage}", 0.0) + (s.end - s.start)
        return {k: v / self.plan.group_of(k[5:]).replicas for k, v in out.items()}

    def _save(self, runtime: Any, train: str, it: int, history: list[dict[str, float]]) -> None:
        state = {"eval_history": history, "seed": self.seed}
        path = save_checkpoint(
            self.ckpt_dir,
            it,
            runtime.call(train, "state_dict", replicas="all")[0],
            state,
            write_extra=lambda tmp: runtime.call(train, "save_sharded", str(tmp / "sharded"), replicas="all"),
        )
        self._call("on_save_checkpoint", str(path))

    def hparams(self, policy: Any, task: Any) -> dict[str, Any]:
        def flat(obj: Any) -> dict[str, Any]:
            return {k: v for k, v in vars(obj).items() if not k.startswith("_") and _plain(v)}

        out = {f"trainer/{k}": v for k, v in flat(self).items()}
        out.update({f"trainer/sampling/{k}": v for k, v in vars(self.sampling).items()})
        engine = self.train_engine_options.items()
        out.update({f"trainer/train_engine_options/{k}": v for k, v in engine if _plain(v)})
        out.update({f"policy/{k}": v for k, v in flat(policy).items()})
        out.update({f"task/{k}": v for k, v in flat(task).items()})
        out["plan"] = self.plan.describe()  # groups, replicas, slots and micro-batch sizes
        return out


def _plain(v: Any) -> bool:
    return isinstance(v, (str, int, float, bool, type(None))) or (
        isinstance(v, tuple) and all(isinstance(x, (int, float)) for x in v)
    )


def instantiate(spec: Any) -> Any:
    """Build ``{class_path, init_args}`` dicts (jsonargparse style); return other objects unchanged."""
    if isinstance(spec, dict) and "class_path" in spec:
        import importlib

        module, _, name = spec["class_path"].rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        return cls(**spec.get("init_args", {}))
    return spec
