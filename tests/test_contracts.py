"""A user's environment that breaks its contract (tools/environment.py) is one line naming the
contract, the class and what it returned: before any worker starts (exit 2) where a dry ``reset``
on the first training problem shows it, at run time (exit 1, no stage traceback, no second one from
teardown) where only a real turn does. A bare-string ``step`` (``"42"``, which used to unpack as
reply ``"4"``, done ``"2"``) is refused, never unpacked."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlinf_lightning import LMPolicy
from rlinf_lightning.cli import main
from rlinf_lightning.engines.rollout import HFRolloutEngine, SamplingParams
from rlinf_lightning.prompts import RAW
from rlinf_lightning.tools import TurnLoop, environment_factory
from rlinf_lightning.tools.environment import ContractError

#: a user's environments, each breaking one clause of the contract (a digit ends a turn: the
#: warm-started model writes one first, so every sample calls ``step``)
USER_ENVS = """
from rlinf_lightning.tools import Environment


class Digits(Environment):
    stop = tuple("0123456789")

    def step(self, turn):
        return "<ok>", True


class BareString(Digits):
    def step(self, turn):
        return "42"


class NoneStep(Digits):
    def step(self, turn):
        return None


class StrDone(Digits):
    def step(self, turn):
        return "<ok>", "yes"


class IntReset(Digits):
    def reset(self, problem):
        return len(problem)


class RaisingReset(Digits):
    def reset(self, problem):
        raise KeyError("no such table")


class TextReward(Digits):
    def reward(self, completion, answer):
        return "1.0"
"""
ENV = "task.environment"
PROMPTS = ["What is 12+7?=", "What is 3+30?="]


@pytest.fixture
def user_envs(tmp_path, monkeypatch):
    (tmp_path / "user_envs.py").write_text(USER_ENVS)
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.fixture(scope="module")
def engine(assets):
    return HFRolloutEngine(str(assets["sft"]))


@pytest.fixture(scope="module")
def tokenizer(assets):
    return LMPolicy(str(assets["sft"])).load_tokenizer()


@pytest.mark.parametrize(
    ("cls", "message"),
    [
        ("BareString", f"{ENV}: BareString.step must return (reply: str, done: bool), got str '42'"),
        ("NoneStep", f"{ENV}: NoneStep.step must return (reply: str, done: bool), got NoneType None"),
        ("StrDone", f"{ENV}: StrDone.step must return (reply: str, done: bool), got tuple ('<ok>', 'yes')"),
        ("IntReset", "task.environment: IntReset.reset must return the prompt text (str), got int 14"),
        ("RaisingReset", "task.environment: RaisingReset.reset raised KeyError: 'no such table'"),
        ("TextReward", "task.environment: TextReward.reward must return a number, got str '1.0'"),
    ],
)
def test_a_broken_contract_in_the_loop_is_one_line(user_envs, engine, tokenizer, cls, message):
    loop = TurnLoop(environment_factory({"class_path": f"user_envs.{cls}"}, []), 3, 24)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8)
    with pytest.raises(ContractError) as err:
        loop.generate(engine, tokenizer, RAW, PROMPTS, [0, 1], 2, sampling, 0, answers=["19", "33"])
    assert str(err.value).startswith(message) and "\n" not in str(err.value), err.value


def test_a_kept_contract_still_runs(user_envs, engine, tokenizer):
    loop = TurnLoop(environment_factory({"class_path": "user_envs.Digits"}, []), 3, 24)
    _, comps = loop.generate(engine, tokenizer, RAW, PROMPTS, [0, 1], 2, SamplingParams(max_new_tokens=8), 0)
    assert all(0 in c.mask or c.mask == [1] * len(c.token_ids) for cs in comps for c in cs)


def _fit(assets, tmp_path: Path, *overrides: str) -> list[str]:
    config = Path(__file__).parents[1] / "configs" / "math_grpo_tools_tiny.yaml"
    return [
        "fit", f"--config={config}", f"--policy.model_path={assets['sft']}",
        f"--task.train_path={assets['train']}", f"--task.test_path={assets['test']}",
        f"--trainer.default_root_dir={tmp_path / 'run'}", "--trainer.max_iterations=1",
        "--trainer.eval_every=0", "--task.eval_size=4", "--task.rollout_batch_size=16",
        "--trainer.enable_progress_bar=false", "--task.tools=[]", *overrides,
    ]  # fmt: skip


def _status(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


# (id, --task.environment value, text the message must contain)
BEFORE_WORKERS = [
    ("reset returns an int", "{class_path: user_envs.IntReset}",
     "task.environment: IntReset.reset must return the prompt text (str), got int "),
    ("reset raises", "{class_path: user_envs.RaisingReset}",
     "task.environment: RaisingReset.reset raised KeyError: 'no such table' on the first training problem"),
    ("unknown class", "{class_path: user_envs.NoSuchEnv}",
     "task.environment: cannot import 'user_envs.NoSuchEnv' (AttributeError"),
    ("unknown module", "{class_path: no_such_module.Env}",
     "task.environment: cannot import 'no_such_module.Env' (ModuleNotFoundError"),
    ("an argument beside init_args", "{class_path: user_envs.Digits, fault: raise}",
     "task.environment: 'fault' is not class_path or init_args"),
    ("an argument the class does not take", "{class_path: user_envs.Digits, init_args: {fault: raise}}",
     "task.environment: cannot build user_envs.Digits: TypeError"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("env", "needle"), [c[1:] for c in BEFORE_WORKERS], ids=[c[0] for c in BEFORE_WORKERS]
)
def test_a_broken_environment_is_refused_before_workers_start(
    user_envs, assets, tmp_path, capsys, env, needle
):
    status = _status(_fit(assets, tmp_path, f"--task.environment={env}"))
    err = capsys.readouterr().err
    assert status == 2, err
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) <= 2, err
    assert not (tmp_path / "run" / "logs").exists()


def test_a_bare_string_step_ends_the_run_in_one_line(user_envs, assets, tmp_path, capsys):
    """At run time (only a real turn calls ``step``): exit 1, one line, and no traceback from the
    stage nor from the teardown of the stages after it."""
    status = _status(_fit(assets, tmp_path, "--task.environment={class_path: user_envs.BareString}"))
    err = capsys.readouterr().err
    assert status == 1, err
    assert "task.environment: BareString.step must return (reply: str, done: bool), got str '42'" in err, err
    assert "Traceback" not in err and "teardown" not in err, err


def _grpo_checkpoint(assets, tmp_path: Path) -> None:
    """A checkpoint of the recipe's GRPO run in ``tmp_path / "run"``, recording its config."""
    import torch

    from rlinf_lightning.checkpoint import save_checkpoint
    from rlinf_lightning.cli import algorithm_names_as_classes, build_parser, subcommand_parser
    from rlinf_lightning.trainer.run_config import resolved_config

    parser = build_parser()
    sub = parser.parse_args(algorithm_names_as_classes(_fit(assets, tmp_path)))["fit"]
    sub.pop("config", None)
    init = subcommand_parser(parser, "fit").instantiate(sub)
    model = torch.nn.Linear(2, 2)
    state = {"model": model.state_dict(), "optimizer": torch.optim.AdamW(model.parameters()).state_dict()}
    config = resolved_config(init.trainer, init.policy, init.task)
    extra = {"eval_history": [], "seed": 0, "config": config}
    save_checkpoint(tmp_path / "run" / "checkpoints", 1, state, extra)


def test_resuming_another_runs_checkpoint_never_writes_into_a_third_runs_directory(assets, tmp_path, capsys):
    """A DAPO checkpoint resumed by explicit path with the GRPO run's directory as the root: refused
    before anything is written there (it used to overwrite that run's summary and move its last)."""
    _grpo_checkpoint(assets, tmp_path)
    last = (tmp_path / "run" / "checkpoints" / "last").read_text()
    elsewhere = tmp_path / "dapo" / "checkpoints" / "iter-000005"
    status = _status(_fit(assets, tmp_path, "--trainer.algorithm=dapo", f"--ckpt_path={elsewhere}"))
    err = capsys.readouterr().err
    assert status == 2, err
    assert "trainer.default_root_dir: " in err and "holds the checkpoints of another run" in err, err
    assert "differs on trainer.algorithm (GRPO there, DAPO here)" in err, err
    assert (tmp_path / "run" / "checkpoints" / "last").read_text() == last
    assert not (tmp_path / "run" / "logs").exists() and not (tmp_path / "run" / "config.yaml").exists()


@pytest.mark.parametrize("time_aware", [False, True])
def test_an_env_kwargs_time_limit_is_the_horizon(time_aware):
    from rlinf_lightning.envs import make_env

    env = make_env("CartPole-v1", 1, time_aware=time_aware, max_episode_steps=20)
    try:
        assert env.max_episode_steps == 20
    finally:
        env.close()


def test_the_chunk_check_reads_the_env_kwargs_time_limit(tmp_path, capsys):
    config = Path(__file__).parents[1] / "configs" / "embodied_ppo_cartpole.yaml"
    argv = ["fit", f"--config={config}", f"--trainer.default_root_dir={tmp_path / 'run'}",
            "--task.init_args.env_kwargs={max_episode_steps: 4}", "--task.init_args.chunk=5"]  # fmt: skip
    status = _status(argv)
    err = capsys.readouterr().err
    assert status == 2, err
    assert "task.chunk: 5 steps per chunk, longer than CartPole-v1's episodes (4 steps)" in err, err
