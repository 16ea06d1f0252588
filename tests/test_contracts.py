"""A user's environment that breaks its contract (tools/environment.py) is one line naming the
contract, the class and what it returned: before any worker starts (exit 2) where a dry ``reset``
on the first training problem shows it, at run time (exit 1, no stage traceback, no second one from
teardown) where only a real turn does. A bare-string ``step`` (``"42"``, which used to unpack as
reply ``"4"``, done ``"2"``) is refused, never unpacked."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from rlinf_lightning import LMPolicy
from rlinf_lightning.cli import main
from rlinf_lightning.engines.rollout import HFRolloutEngine, SamplingParams
from rlinf_lightning.flow import BatchShape, Stage, Workflow
from rlinf_lightning.flow.worker import StageError
from rlinf_lightning.launchers import LAUNCHERS
from rlinf_lightning.prompts import RAW
from rlinf_lightning.strategies import STRATEGIES, Resources
from rlinf_lightning.tools import TurnLoop, environment_factory

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
    from rlinf_lightning.tools.environment import ContractError

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


@pytest.fixture(scope="module")
def fetch_pi0(tmp_path_factory) -> Path:
    """A tiny π0 sized for FetchReach (13-d state, 4-d actions) with its tokenizer and statistics."""
    import torch

    from rlinf_lightning.assets import TinyPi0Config, build_tiny_pi0
    from rlinf_lightning.policies.pi0.norm import NormStats

    path = build_tiny_pi0(tmp_path_factory.mktemp("pi0") / "pi0", TinyPi0Config(max_state_dim=16))
    NormStats(torch.zeros(13), torch.ones(13), torch.zeros(4), torch.ones(4)).save(path)
    return path


def _pi0_copy(fetch_pi0: Path, tmp: Path, change=None) -> Path:
    import shutil

    out = tmp / "pi0"
    shutil.copytree(fetch_pi0, out)
    if change is not None:
        change(out)
    return out


def _other_sizes(path: Path) -> None:
    import torch

    from rlinf_lightning.policies.pi0.norm import NormStats

    NormStats(torch.zeros(5), torch.ones(5), torch.zeros(3), torch.ones(3)).save(path)


def _wider_state(path: Path) -> None:
    import json

    config = json.loads((path / "config.json").read_text())
    config["max_state_dim"] = 24  # the weights were saved for 16
    (path / "config.json").write_text(json.dumps(config))


# (id, how the directory is broken, text the message must contain)
PI0_DIRS = [
    ("no norm stats", lambda p: (p / "norm_stats.json").unlink(),
     "policy.model_path: {dir}: no norm_stats.json, so states and actions would run raw"),
    ("norm stats of other sizes", _other_sizes,
     "policy.model_path: its norm_stats.json is for 5-d states and 3-d actions, the env's are 13-d and 4-d"),
    ("corrupt norm stats", lambda p: (p / "norm_stats.json").write_text("{"),
     "policy.model_path: {dir}/norm_stats.json: not a readable norm_stats.json (JSONDecodeError"),
    ("norm stats without actions", lambda p: (p / "norm_stats.json").write_text('{"norm_stats": {}}'),
     "norm_stats.json: not a readable norm_stats.json (KeyError"),
    ("no tokenizer", lambda p: (p / "tokenizer.json").unlink(),
     "policy.model_path: {dir}: no tokenizer.json"),
    ("weights for another config", _wider_state,
     "policy.model_path: {dir}: the weights do not match config.json"),
]  # fmt: skip


@pytest.mark.parametrize(("change", "needle"), [c[1:] for c in PI0_DIRS], ids=[c[0] for c in PI0_DIRS])
def test_a_broken_pi0_directory_is_refused_before_workers_start(fetch_pi0, tmp_path, capsys, change, needle):
    pi0 = _pi0_copy(fetch_pi0, tmp_path, change)
    config = Path(__file__).parents[1] / "configs" / "embodied_ppo_pi0_fetchreach.yaml"
    argv = ["fit", f"--config={config}", f"--trainer.default_root_dir={tmp_path / 'run'}",
            f"--policy.init_args.model_path={pi0}"]  # fmt: skip
    status = _status(argv)
    err = capsys.readouterr().err
    assert status == 2, err
    assert needle.format(dir=pi0) in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


def test_raw_on_purpose_needs_no_norm_stats(fetch_pi0, tmp_path):
    from rlinf_lightning.policies import Pi0Policy

    pi0 = _pi0_copy(fetch_pi0, tmp_path, lambda p: (p / "norm_stats.json").unlink())
    assert Pi0Policy(str(pi0), normalize=False).validate_config() == []
    assert [k for k, _ in Pi0Policy(str(pi0)).validate_config()] == ["model_path"]


def _demos(path: Path, chunk: int = 4, drop: tuple[str, ...] = (), action_dims: int = 3) -> Path:
    """A FetchReach-shaped demonstration file (8 rows), with ``drop``ped entries or another rank."""
    import torch
    from safetensors.torch import save_file

    n = 8
    action = torch.zeros(n, chunk, 4) if action_dims == 3 else torch.zeros(n, 4)
    tensors = {
        "obs.observation": torch.zeros(n, 10), "obs.desired_goal": torch.zeros(n, 3), "action": action,
        "action_mask": torch.ones(n, chunk, dtype=torch.bool), "episode": torch.zeros(n, dtype=torch.long),
    }  # fmt: skip
    meta = {"image_keys": "[]", "state_keys": '["observation", "desired_goal"]'}
    save_file({k: v for k, v in tensors.items() if k not in drop}, str(path), metadata=meta)
    return path


# (id, subcommand arguments given (tmp_path, assets, π0 dir), text the one line must contain)
SUBCOMMANDS = [
    ("sft: missing train file",
     lambda t, a, p: ["sft", f"--base_model={a['base']}", "--train_path=/nonexistent/train.jsonl"],
     "rlinf sft: --train_path /nonexistent/train.jsonl: no such file"),
    ("sft: broken train file",
     lambda t, a, p: ["sft", f"--base_model={a['base']}", f"--train_path={_write(t / 'd.jsonl', '{1')}"],
     "rlinf sft: --train_path {tmp}/d.jsonl:1:"),
    ("sft: unknown tool", lambda t, a, p: ["sft", f"--base_model={a['base']}", "--tools=[calculater]"],
     "rlinf sft: --tools: unknown tool 'calculater'"),
    ("sft: no turns", lambda t, a, p: ["sft", f"--base_model={a['base']}", "--tools=[calculator]",
                                       "--max_turns=0"],
     "rlinf sft: --max_turns: must be >= 1, got 0"),
    ("sft: no base model", lambda t, a, p: ["sft", "--base_model=/nonexistent/model"],
     "rlinf sft: --base_model /nonexistent/model: not a model directory"),
    ("sft: demos without a mask", lambda t, a, p: ["sft", f"--base_model={p}",
     f"--train_path={_demos(t / 'd.safetensors', drop=('action_mask',))}"],
     "rlinf sft: --train_path {tmp}/d.safetensors: not a demonstration file (no action_mask"),
    ("sft: demos of the wrong shape", lambda t, a, p: ["sft", f"--base_model={p}",
     f"--train_path={_demos(t / 'd.safetensors', action_dims=2)}"],
     "d.safetensors: action must be float [N, chunk, action_dim], got torch.float32 [8, 4]"),
    ("sft: demos of longer chunks than pi0's", lambda t, a, p: ["sft", f"--base_model={p}",
     f"--train_path={_demos(t / 'd.safetensors', chunk=12)}"],
     "rlinf sft: --train_path {tmp}/d.safetensors: its demonstrations' chunks are 12 actions, longer than "
     "the chunk_size 8"),
    ("demos: no expert", lambda t, a, p: ["demos", "--env=NoSuchEnv-v0"],
     "rlinf demos: --env NoSuchEnv-v0: no scripted expert"),
    ("demos: no episodes", lambda t, a, p: ["demos", "--episodes=0", f"--out={t / 'd.safetensors'}"],
     "rlinf demos: --episodes: must be >= 1, got 0"),
    ("plan: no devices", lambda t, a, p: [*_plan(t, a), "--devices=0"],
     "rlinf plan: --devices: must be >= 1, got 0"),
    ("plan: a negative size", lambda t, a, p: [*_plan(t, a), "--task.rollout_batch_size=-8"],
     "task.rollout_batch_size"),
    ("plan: a batch of split groups", lambda t, a, p: [*_plan(t, a), "--task.rollout_batch_size=100"],
     "use a multiple such as 96"),
    ("plan: an unknown stage sped up", lambda t, a, p: [*_plan(t, a), "--speedup={rolout: 2}"],
     "rlinf plan: --speedup: unknown stage 'rolout'; the workflow's stages are rollout"),
]  # fmt: skip


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _plan(tmp: Path, assets) -> list[str]:
    from rlinf_lightning.strategies.auto.profile import Profile, StageCost

    prof = Profile("reasoning", message_s=0.001, launch_s=5.0)
    prof.stages = {
        s: StageCost(0.002, 0.0003) for s in ("rollout", "reward", "advantage", "inference", "actor")
    }
    config = Path(__file__).parents[1] / "configs" / "math_grpo_tiny.yaml"
    return ["plan", f"--config={config}", f"--profile={prof.save(tmp / 'profile.json')}",
            f"--policy.model_path={assets['sft']}", f"--task.train_path={assets['train']}",
            f"--task.test_path={assets['test']}"]  # fmt: skip


@pytest.mark.parametrize(("make", "needle"), [c[1:] for c in SUBCOMMANDS], ids=[c[0] for c in SUBCOMMANDS])
def test_every_subcommand_refuses_a_bad_input_in_one_line(assets, fetch_pi0, tmp_path, capsys, make, needle):
    status = _status(make(tmp_path, assets, fetch_pi0))
    captured = capsys.readouterr()
    assert status == 2, captured.err
    assert needle.format(tmp=tmp_path) in captured.err and "Traceback" not in captured.err, captured.err
    lines = captured.err.strip().splitlines()  # one, or a ConfigError's heading and its line, as fit's
    assert len(lines) == 1 or (len(lines) == 2 and lines[0].endswith("invalid configuration:")), lines
    assert not captured.out, captured


class _BrokenSetup(Stage):
    name = "broken"

    def setup(self, ctx):
        raise OSError("cannot open the device")

    def process(self, batch):
        return batch


class _Engine(Stage):
    """Like the actor stages: ``teardown`` releases what ``setup`` built."""

    name = "engine"

    def setup(self, ctx):
        self.engine = object()

    def process(self, batch):
        return batch

    def teardown(self):
        del self.engine


def test_a_failed_setup_is_not_followed_by_the_teardown_of_stages_never_set_up(caplog):
    """Before: ``'_Engine' object has no attribute 'engine'``, a second traceback after the first."""
    wf = Workflow("toy").chain(_BrokenSetup(), _Engine())
    plan = STRATEGIES.resolve("collocated").plan(wf, Resources(1, threads_per_slot=1), BatchShape(8, 4))
    with caplog.at_level(logging.WARNING), pytest.raises(StageError, match="cannot open the device"):
        LAUNCHERS.resolve("inprocess").launch(wf, plan, timeout_s=30)
    assert not [r for r in caplog.records if "teardown" in r.getMessage()], caplog.text
