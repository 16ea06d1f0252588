"""RLTrainer: what every run has (strategy and plan, launcher, devices, precision, iterations,
evaluation and checkpoint cadence, loggers, callbacks, seed, timeouts, trace); everything about
*what* is trained (data, rollout, batch sizes, environments) belongs to the task.

    trainer = RLTrainer(algorithm="grpo", strategy="collocated", max_iterations=100)
    trainer.fit(policy, task)  # an RLModule, and a Task (rlinf_lightning.tasks)

Strategies, launchers, train engines, algorithms and loggers are resolved by name through their
registries; the task supplies the workflow, each iteration's input and the evaluation, and sees
only a frozen :class:`~rlinf_lightning.tasks.base.RunSpec`. So the trainer never branches on
which strategy, engine, task or stage it drives.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rlinf_lightning.algorithms import ALGORITHMS, Algorithm
from rlinf_lightning.algorithms.options import option_problems
from rlinf_lightning.engines.precision import PRECISIONS
from rlinf_lightning.engines.train import TRAIN_ENGINES, TrainSpec, resolve_train_engine
from rlinf_lightning.errors import ConfigError
from rlinf_lightning.flow.plan import ExecutionPlan
from rlinf_lightning.flow.workflow import Workflow
from rlinf_lightning.launchers import LAUNCHERS
from rlinf_lightning.strategies import STRATEGIES
from rlinf_lightning.tasks.base import RunSpec
from rlinf_lightning.trainer.callback_connector import CallbackConnector
from rlinf_lightning.trainer.fit_loop import FitLoop
from rlinf_lightning.trainer.logger_connector import LoggerConnector, LoggerSpec
from rlinf_lightning.trainer.plan_connector import PlanConnector


class RLTrainer:
    """Runs RL post-training of a policy on a task.

    Args:
        algorithm: a preset's name (``grpo``, ``dr_grpo``, ``dapo``, ``gspo``, ``rloo``,
            ``reinforce_plus_plus``, ``reinforce_plus_plus_baseline``, ``cispo``; ``ppo`` with a
            critic), or an algorithm object such as ``DAPO(clip_eps_high=0.3)``. On the command
            line a name's options are set key by key: ``--trainer.algorithm=dapo
            --trainer.algorithm.init_args.clip_eps_high=0.3`` (see ``docs/algorithms.md``).
        strategy: execution plan strategy: a name (``collocated``: data-parallel replicas on every
            slot; ``collocated_offload``, ``disaggregated``, ``hybrid``, ``auto``), a ``Strategy``
            object (e.g. ``HybridStrategy(placement="rollout: 0, reward,advantage,inference,actor:
            1")`` or ``CollocatedStrategy(replicas=1)``), or a ``{class_path, init_args}`` dict.
        launcher: how workers start: ``inprocess`` (default; threads of this process), ``processes``
            (one OS process per worker), ``ray`` (Ray actors), or a launcher object.
        train_engine: how the task's learning stage trains over the replicas of the group the plan
            puts it on: ``auto`` (``single`` on one replica, ``ddp`` on more), ``single``, ``ddp``,
            or ``fsdp`` (FSDP2 shards the state; one process per replica).
        train_engine_options: keyword arguments of the train engine, e.g. for ``ddp``/``fsdp``
            ``{malloc_mmap_threshold_mb: null}``.
        precision: how the actor trains, with Lightning's names: ``32-true``, ``bf16-mixed``
            (float32 master weights and optimizer state, bf16 autocast forward and backward;
            log-probs and losses in float32), ``bf16-true``, or ``auto`` (``bf16-mixed`` where the
            device computes bf16 natively: a GPU with bf16, a CPU with AVX512-BF16 or AMX; else
            ``32-true``).
        compile: run the actor's forward and backward under ``torch.compile`` (off by default: the
            first micro-batch of each shape compiles, which a long run repays and a short one does
            not); the compile seconds are the actor's ``compile_s`` metric.
        accelerator: what a device slot is: ``cpu``, ``cuda``, or ``auto`` (``cuda`` when available).
        devices: device slots per node (GPUs, or shares of the cores on CPU).
        num_nodes: number of machines.
        max_iterations: RL iterations (one rollout batch and its update each).
        micro_batch_size: samples per message between stages (a multiple of the task's unit, e.g.
            a prompt group, that divides its batch; default: the strategy's choice, the whole batch
            for collocated, a quarter for pipelined).
        eval_every: evaluate on the held-out split every this many iterations (0: only before and after).
        ckpt_every: checkpoint every this many iterations (0: only at the end).
        ckpt_keep: keep the newest this many checkpoints, deleting older ones as each is written
            (0: keep every one; a replay buffer's checkpoint holds every transition written).
        max_staleness: asynchronous RL with bounded staleness: the rollout of iteration ``i`` may
            use weights ``k`` versions older than the synchronous flow's (version ``i - 1 - k``
            instead of ``i - 1``, version ``v`` being the weights after ``v`` updates), so it
            runs while the actor still trains on earlier iterations; up to ``k + 1`` iterations
            are in flight. Every sample carries the version that produced it; the actor checks the
            bound and logs ``async/staleness_mean`` and ``_max``. 0: synchronous (on-policy).
            Pair it with an off-policy correction (``trainer.algorithm.off_policy_correction``,
            see ``docs/async.md``).
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
        on_nonfinite: what a learning stage does with an optimizer step whose loss or gradient
            norm is NaN or infinite: ``skip`` (default: the step is not taken, its gradients are
            dropped, it is counted as ``<stage>/nonfinite_steps`` and warned about once) or
            ``stop`` (the run ends at the first, naming the stage, iteration and metric; the last
            checkpoint stays as it was). Non-finite advantages or rewards always stop the run.
        max_consecutive_nonfinite: under ``skip``, this many skipped steps in a row stop the run.
        allow_config_change: let a run resume from (``ckpt_path``), or start afresh into the
            directory of, checkpoints written under another configuration of what changes the
            update (the algorithm and its options, ``max_staleness``, the policy's or the task's
            settings); refused by default, naming the keys that differ (``docs/failures.md``).
        max_worker_restarts: how many times a run replaces workers it lost (killed, or silent past
            ``timeout_s``) under the ``processes`` and ``ray`` launchers, re-syncing their weights
            and running the interrupted iteration again; one more loss ends the run
            (``docs/failures.md``). 0: the first loss ends it.
        auto_resume: when the lost worker held a learning stage (the actor, a critic: its
            optimizer state is gone with it), go on from the last checkpoint instead of ending
            the run (counted as a restart).
    """

    def __init__(
        self,
        algorithm: Algorithm | str = "grpo",
        strategy: Any = "collocated",
        launcher: Any = "inprocess",
        train_engine: str = "auto",
        train_engine_options: dict[str, Any] | None = None,
        precision: str = "auto",
        compile: bool = False,
        accelerator: str = "auto",
        devices: int = 1,
        num_nodes: int = 1,
        max_iterations: int = 100,
        micro_batch_size: int | None = None,
        eval_every: int = 0,
        ckpt_every: int = 0,
        ckpt_keep: int = 0,
        max_staleness: int = 0,
        default_root_dir: str = "runs/default",
        logger: LoggerSpec = True,
        callbacks: list[Any] | None = None,
        enable_progress_bar: bool = True,
        seed: int = 0,
        timeout_s: float = 600.0,
        num_threads: int = 0,
        trace: str | None = None,
        on_nonfinite: str = "skip",
        max_consecutive_nonfinite: int = 3,
        allow_config_change: bool = False,
        max_worker_restarts: int = 3,
        auto_resume: bool = False,
    ) -> None:
        self.algorithm, self.strategy, self.launcher = algorithm, strategy, launcher
        self.train_engine, self.train_engine_options = train_engine, dict(train_engine_options or {})
        self.precision, self.accelerator, self.compile = precision, accelerator, compile
        self.devices, self.num_nodes = devices, num_nodes
        self.max_iterations, self.micro_batch_size = max_iterations, micro_batch_size
        self.eval_every, self.ckpt_every, self.ckpt_keep = eval_every, ckpt_every, ckpt_keep
        self.max_staleness = max_staleness
        self.default_root_dir = Path(default_root_dir)
        self.callbacks: list[Any] = list(callbacks or [])
        self.enable_progress_bar, self.seed = enable_progress_bar, seed
        self.timeout_s, self.num_threads, self.trace = timeout_s, num_threads, trace
        self.on_nonfinite, self.max_consecutive_nonfinite = on_nonfinite, max_consecutive_nonfinite
        self.allow_config_change = allow_config_change
        self.max_worker_restarts, self.auto_resume = max_worker_restarts, auto_resume
        self.iteration = 0
        self.policy: Any = None  # the policy and task being fit (for callbacks)
        self.task: Any = None
        self.plan_connector = PlanConnector(self)
        self.fit_loop: FitLoop | None = None  # the last fit's, which holds the plan its workers ran
        self.logger_connector = LoggerConnector(logger, self.default_root_dir)
        self.callback_connector = CallbackConnector(self)

    # -- what the run is -------------------------------------------------------------------------
    @property
    def run_spec(self) -> RunSpec:
        """What the task is told about the run."""
        return RunSpec(
            algorithm=ALGORITHMS.resolve(self.algorithm),
            train=TrainSpec(
                self.train_engine,
                self.train_engine_options,
                self.precision,
                self.compile,
                self.on_nonfinite,
                self.max_consecutive_nonfinite,
            ),
            seed=self.seed,
            micro_batch_size=self.micro_batch_size,
            max_staleness=self.max_staleness,
        )

    @property
    def plan(self) -> ExecutionPlan | None:
        """The plan the workers of the current (or last) fit run (``None`` before a fit)."""
        return self.fit_loop.plan if self.fit_loop is not None else None

    @property
    def workflow(self) -> Workflow | None:
        """The workflow of the current (or last) fit (``None`` before a fit)."""
        return self.fit_loop.workflow if self.fit_loop is not None else None

    @property
    def loggers(self) -> list[Any]:
        return self.logger_connector.loggers

    @property
    def ckpt_dir(self) -> Path:
        return self.default_root_dir / "checkpoints"

    def build_plan(self, policy: Any, task: Any) -> tuple[Workflow, ExecutionPlan]:
        """The task's workflow (stages built from configuration, nothing loaded) and the
        strategy's plan for it, as :meth:`fit` would run them."""
        return self.plan_connector.build(policy, task, self.run_spec)

    # -- validation ------------------------------------------------------------------------------
    def validate(self, policy: Any = None, task: Any = None) -> tuple[Workflow, ExecutionPlan] | None:
        """Raise :class:`ConfigError` naming every bad key; loads nothing heavy. With a policy and
        a task, also builds the plan :meth:`fit` runs, checks its placement and memory, and
        returns the workflow and that plan."""
        p = self._setting_problems() + self.logger_connector.problems()
        for section, obj in (("policy", policy), ("task", task)):
            if obj is not None and hasattr(obj, "validate_config"):
                p += [(f"{section}.{k}", m) for k, m in obj.validate_config()]
        built = None
        if not p and policy is not None and task is not None:
            problems, built = self.plan_connector.problems(policy, task, self.run_spec)
            p += problems
        if p:
            raise ConfigError(p)
        return built

    def _setting_problems(self) -> list[tuple[str, str]]:
        p: list[tuple[str, str]] = []
        for key, reg in (("algorithm", ALGORITHMS), ("strategy", STRATEGIES), ("launcher", LAUNCHERS)):
            value = getattr(self, key)
            if isinstance(value, str) and value not in reg:
                p.append((f"trainer.{key}", reg.unknown_message(value)))
        if not p:
            p += [
                (f"trainer.algorithm.{k}", m) for k, m in option_problems(ALGORITHMS.resolve(self.algorithm))
            ]
        if resolve_train_engine(self.train_engine, 1) not in TRAIN_ENGINES:
            p.append(("trainer.train_engine", TRAIN_ENGINES.unknown_message(self.train_engine)))
        positive = ("devices", "num_nodes", "max_iterations", "micro_batch_size", "max_consecutive_nonfinite")
        for key in positive:
            if getattr(self, key) is not None and getattr(self, key) < 1:
                p.append((f"trainer.{key}", f"must be >= 1, got {getattr(self, key)}"))
        nonnegative = (
            "eval_every", "ckpt_every", "ckpt_keep", "num_threads", "max_staleness", "max_worker_restarts"
        )  # fmt: skip
        for key in (*nonnegative, "seed"):  # seed: numpy's and gymnasium's take none below 0
            if getattr(self, key) < 0:
                p.append((f"trainer.{key}", f"must be >= 0, got {getattr(self, key)}"))
        if self.timeout_s <= 0:
            p.append(("trainer.timeout_s", f"must be > 0, got {self.timeout_s}"))
        if self.on_nonfinite not in ("skip", "stop"):
            why = f"must be skip or stop, got {self.on_nonfinite!r}"
            p.append(("trainer.on_nonfinite", why))
        if self.precision not in PRECISIONS:
            p.append(("trainer.precision", f"must be one of {', '.join(PRECISIONS)}; got {self.precision!r}"))
        if self.accelerator not in ("auto", "cpu", "cuda"):
            p.append(("trainer.accelerator", f"must be auto, cpu or cuda, got {self.accelerator!r}"))
        elif self.accelerator == "cuda" and not torch.cuda.is_available():
            p.append(("trainer.accelerator", "cuda was asked for but torch sees no GPU; use cpu or auto"))
        launcher = self.launcher if isinstance(self.launcher, str) else None
        if launcher in LAUNCHERS and self.num_nodes > 1 and not LAUNCHERS.get(launcher).multi_node:
            p.append(
                (
                    "trainer.num_nodes",
                    f"{self.num_nodes} nodes, but launcher {launcher!r} runs every worker on this machine; "
                    "use trainer.launcher=ray for several machines",
                )
            )
        return p

    # -- fit -------------------------------------------------------------------------------------
    def fit(self, policy: Any, task: Any, ckpt_path: str | None = None) -> dict[str, Any]:
        """Train ``policy`` on ``task``; resume from ``ckpt_path`` (a directory or ``"last"``).
        Returns the summary also written to ``<default_root_dir>/summary.json``."""
        workflow, plan = self.validate(policy, task)
        self.policy, self.task = policy, task
        self.fit_loop = FitLoop(self, policy, task, workflow, plan)
        return self.fit_loop.run(ckpt_path)
