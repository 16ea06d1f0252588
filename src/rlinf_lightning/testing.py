"""Fixture builders for tests and benchmarks: everything they train from, built in one place so
they all start alike; and the fit check the simulator plugins' tests share (the library itself
never imports this module); a checkpoint of one real update (``rlinf export``'s tests); and an
environment that makes any policy's samples multi-turn."""

from __future__ import annotations

import csv
import hashlib
import inspect
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers

from rlinf_lightning.assets import build_tiny_qwen2
from rlinf_lightning.sft import run_sft
from rlinf_lightning.tasks.data import make_arithmetic_splits
from rlinf_lightning.tools import Environment, MalformedCall


def build_warm_started(
    root: str | Path, *, n_train: int = 2000, n_test: int = 64, **sft: Any
) -> dict[str, Path]:
    """Under ``root``: a tiny Qwen2, the arithmetic splits, and that model after SFT on train.

    ``sft`` goes to :func:`~rlinf_lightning.sft.run_sft` (default: 60 steps of 32, eval on 64).
    Returns ``{"base", "sft", "train", "validation", "test", "split", "root"}``.

    The result is copied from the warm-start cache (:func:`warm_start_cache`) when it holds one built
    by the same code with the same arguments, and put there otherwise: every pytest process of a
    suite (core and each plugin) and every later run would otherwise train the same model again.
    """
    root = Path(root)
    sft = {"steps": 60, "batch_size": 32, "eval_size": 64, **sft}
    data = {name: root / "data" / f"{name}.jsonl" for name in ("train", "validation", "test")}
    data["split"] = root / "data" / "split.json"
    cache = warm_start_cache()
    entry = cache / _warm_start_key(n_train=n_train, n_test=n_test, **sft) if cache else None
    if entry is not None and (entry / "done").is_file():
        shutil.copytree(entry, root, dirs_exist_ok=True, ignore=shutil.ignore_patterns("done"))
    else:
        base = build_tiny_qwen2(root / "tiny-qwen2")
        make_arithmetic_splits(root / "data", n_train=n_train, n_test=n_test)
        run_sft(str(base), str(data["train"]), str(data["test"]), str(root / "tiny-qwen2-sft"), **sft)
        if entry is not None:
            _store(root, entry)
    return {"base": root / "tiny-qwen2", "sft": root / "tiny-qwen2-sft", **data, "root": root}


WARM_START_CACHE_ENV = "RLINF_WARM_START_CACHE"


def warm_start_cache() -> Path | None:
    """Where :func:`build_warm_started` keeps what it built: ``$RLINF_WARM_START_CACHE``, by default
    ``~/.cache/rlinf-lightning/warm-starts``; ``RLINF_WARM_START_CACHE=off`` builds every time."""
    where = os.environ.get(WARM_START_CACHE_ENV, "")
    if where.lower() in ("off", "0", "none"):
        return None
    return Path(where) if where else Path.home() / ".cache" / "rlinf-lightning" / "warm-starts"


def _warm_start_key(**arguments: Any) -> str:
    """A hash of what builds a warm start: its arguments, the source of the modules that build the
    model, the data and the SFT, and the versions of torch and transformers that run them."""
    import rlinf_lightning.assets as assets
    import rlinf_lightning.sft as sft
    import rlinf_lightning.tasks.data as data

    digest = hashlib.sha256(json.dumps(arguments, sort_keys=True, default=str).encode())
    for module in (assets, sft, data):
        digest.update(Path(module.__file__).read_bytes())
    digest.update(inspect.getsource(build_warm_started).encode())
    digest.update(f"torch {torch.__version__} transformers {transformers.__version__}".encode())
    return digest.hexdigest()[:20]


def _store(root: Path, entry: Path) -> None:
    """Copy ``root`` into the cache as ``entry``, atomically: a reader sees all of it or nothing."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=entry.parent, prefix=entry.name + "."))
    shutil.copytree(root, tmp, dirs_exist_ok=True)
    (tmp / "done").touch()
    try:
        tmp.rename(entry)
    except OSError:  # another process stored it first
        shutil.rmtree(tmp, ignore_errors=True)


def check_one_embodied_iteration(config: Path, run: Path, *overrides: str, chunk: int = 1) -> None:
    """`rlinf fit` of ``config`` for one iteration of 2 envs x 4 steps of ``chunk`` actions and 2
    evaluation episodes (CSV logger on, into ``run``), and what it must show: the plan, a
    checkpoint, 8 x ``chunk`` env steps, a
    finite PPO loss with a non-zero gradient (the value loss alone gives one), and success before
    and after in {0, 0.5, 1}. Raises ``AssertionError`` naming what is wrong."""
    res = subprocess.run(
        [sys.executable, "-m", "rlinf_lightning.cli", "fit", f"--config={config}",
         "--trainer.max_iterations=1", f"--trainer.default_root_dir={run}", "--task.init_args.num_envs=2",
         "--task.init_args.steps=4", "--task.init_args.eval_episodes=2", f"--task.init_args.chunk={chunk}",
         *overrides],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert "env -> rollout -> advantage -> actor" in res.stdout, "no plan table"
    assert (run / "checkpoints" / "iter-000001" / "model.safetensors").is_file(), "no checkpoint"
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["iterations"], summary["eval_episodes"]) == (1, 2), summary
    for key in ("success_before", "success_after"):
        assert summary[key] in (0.0, 0.5, 1.0), (key, summary[key])  # 2 episodes, each 0 or 1
    with open(run / "logs" / "version_0" / "metrics.csv") as f:
        (step,) = [
            {k: float(v) for k, v in row.items() if v} for row in csv.DictReader(f) if row.get("actor/loss")
        ]
    assert step["env/env_steps_total"] == 2 * 4 * chunk, step
    assert math.isfinite(step["actor/loss"]) and step["actor/grad_norm"] > 0, step


def checkpoint_one_update(
    model_dir: str | Path, assets: dict[str, Path], root: str | Path, lora: Any = None
) -> Any:
    """One actor update of ``LMPolicy(model_dir)`` (``lora``: its adapters) on a real rollout of two
    prompts, checkpointed under ``root/checkpoints`` as the fit loop writes it (the actor's
    ``state_dict``, the run's resolved configuration in ``state.json``; ``assets``' data for the
    task); returns the actor stage, whose ``engine.policy`` holds the trained weights. The
    advantages are fixed, +-1 in each group, so the update moves the weights whatever the rewards."""
    import torch
    from tensordict import TensorDict

    from rlinf_lightning.algorithms import GRPO
    from rlinf_lightning.checkpoint import save_checkpoint
    from rlinf_lightning.engines import HFRolloutEngine, SamplingParams
    from rlinf_lightning.engines.train import TrainSpec
    from rlinf_lightning.flow.stage import StageContext
    from rlinf_lightning.policies import LMPolicy
    from rlinf_lightning.tasks import MathTask
    from rlinf_lightning.trainer import RLTrainer
    from rlinf_lightning.trainer.run_config import resolved_config
    from rlinf_lightning.workflows.reasoning.actor import ActorStage
    from rlinf_lightning.workflows.reasoning.rollout import pack_samples
    from rlinf_lightning.workflows.specs import RolloutSpec, RunSpec

    policy = LMPolicy(str(model_dir), lr=1e-2, lora=lora)
    tok = policy.load_tokenizer()
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in ("What is 1+2?=", "What is 33+44?=")]
    outs = HFRolloutEngine(str(model_dir)).generate(
        ids, [0, 1], 2, SamplingParams(1.0, max_new_tokens=4), 0, tok.eos_token_id
    )
    batch = TensorDict(pack_samples(ids, outs, tok.pad_token_id), batch_size=[4])
    batch["advantage"] = torch.tensor([1.0, -1.0, -1.0, 1.0])
    batch["policy_version"] = torch.zeros(4, dtype=torch.long)
    actor = ActorStage(policy, RunSpec(GRPO(), TrainSpec("single")), RolloutSpec())
    actor.setup(StageContext())
    actor.begin_iteration(1)
    actor.process(batch)
    actor.end_iteration()
    trainer = RLTrainer(default_root_dir=str(root), logger=False, enable_progress_bar=False)
    config = resolved_config(trainer, policy, MathTask(str(assets["train"]), str(assets["test"])))
    state = {"eval_history": [], "seed": 0, "config": config}
    save_checkpoint(Path(root) / "checkpoints", 1, actor.state_dict(), state)
    return actor


class DigitTurns(Environment):
    """A test environment that makes every sample multi-turn, whatever the policy: each digit the
    policy writes ends a turn (the arithmetic warm start writes one first), and the step then does
    what ``mode`` says: ``reply`` (``<ok>``; after ``done_after`` steps it ends the sample),
    ``raise``, ``sleep`` (for ``sleep_s``, past any short timeout) or ``malformed``."""

    stop = tuple("0123456789")

    def __init__(self, mode: str = "reply", done_after: int = 0, sleep_s: float = 3.0) -> None:
        self.mode, self.done_after, self.sleep_s, self.steps = mode, done_after, sleep_s, 0

    def step(self, turn: str) -> tuple[str, bool]:
        self.steps += 1
        if self.mode == "raise":
            raise RuntimeError("the tool broke")
        if self.mode == "sleep":
            time.sleep(self.sleep_s)
        if self.mode == "malformed":
            raise MalformedCall("not a call")
        return "<ok>", self.done_after > 0 and self.steps >= self.done_after
