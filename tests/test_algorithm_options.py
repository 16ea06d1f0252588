"""Every option of every algorithm is set from the command line, and an out-of-range value of each
is refused with one line naming it, before anything loads (the real CLI entry point, in process).

Values are derived from each option's declared range (``algorithms.options.OPTION_RANGES``) and
type, so an option added later is covered without editing this file."""

from __future__ import annotations

import dataclasses
import time

import pytest

from rlinf_lightning.algorithms import ADVANTAGE_ESTIMATORS, ALGORITHMS, OFF_POLICY_CORRECTIONS, POLICY_LOSSES
from rlinf_lightning.algorithms.options import FILE_OPTIONS, OPTION_RANGES
from rlinf_lightning.cli import algorithm_names_as_classes, build_parser, main, subcommand_parser
from trainer_defaults import cli_fit_args, scaled

NAMES = list(ALGORITHMS)
REGISTRIES = {
    "advantage_estimator": ADVANTAGE_ESTIMATORS,
    "policy_loss": POLICY_LOSSES,
    "off_policy_correction": OFF_POLICY_CORRECTIONS,
}


def _options(name: str) -> list[dataclasses.Field]:
    return list(dataclasses.fields(ALGORITHMS.get(name)))


def _cli(value: object) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _valid(f: dataclasses.Field) -> object:
    """A value in range that differs from the default."""
    default = f.default
    if isinstance(default, bool):
        return not default
    if f.name in REGISTRIES:
        return next(n for n in REGISTRIES[f.name] if n != default)
    if f.name in FILE_OPTIONS:
        return "demos.safetensors"
    rule = OPTION_RANGES[f.name]
    if rule.choices:
        return next(c for c in rule.choices if c != default)
    low = rule.low if rule.low is not None else 0.0
    if rule.integer:
        return int(low if default is None else default) + 1
    if default is None:
        value = low + 1.5
    else:
        value = (default + low) / 2 if default > low else low + 0.5  # strictly inside an open bound
    return value if rule.high is None else min(value, (low + rule.high) / 2)


def _invalid(f: dataclasses.Field) -> object:
    """A value out of range (for a name: one not registered)."""
    if f.name in REGISTRIES:
        return "no_such_entry"
    rule = OPTION_RANGES[f.name]
    if rule.choices:
        return "no-such-choice"
    return rule.low - 1 if rule.low is not None else rule.high + 1


def test_every_option_has_a_range_or_is_a_name_or_a_switch():
    for name in NAMES:
        for f in _options(name):
            assert f.name in {*OPTION_RANGES, *REGISTRIES, *FILE_OPTIONS} or isinstance(f.default, bool), (
                name,
                f.name,
            )


@pytest.mark.parametrize("name", NAMES)
def test_every_option_of_every_preset_is_set_from_the_command_line(name):
    parser = build_parser()
    values = {f.name: _valid(f) for f in _options(name)}
    if "tis_cap" in values:  # it weights tokens as the correction does: one of them at a time
        values["tis_cap"] = None
    argv = [
        "fit",
        "--policy.model_path=m",
        "--task.train_path=t",
        "--task.test_path=t",
        f"--trainer.algorithm={name}",
    ]
    argv += [f"--trainer.algorithm.init_args.{k}={_cli(v)}" for k, v in values.items()]
    cfg = parser.parse_args(algorithm_names_as_classes(argv))
    trainer = subcommand_parser(parser, "fit").instantiate(cfg.fit).trainer
    assert type(trainer.algorithm) is ALGORITHMS.get(name)
    for key, value in values.items():
        assert getattr(trainer.algorithm, key) == value, (name, key)
    trainer.validate()  # every value in range: nothing to refuse


@pytest.mark.parametrize("name", NAMES)
def test_an_out_of_range_value_of_every_option_is_refused_with_one_line_naming_it(
    name, assets, tmp_path, capsys
):
    # a file option's missing file is refused where the workflow reads it (tests/test_offpolicy.py)
    options = [f for f in _options(name) if not isinstance(f.default, bool) and f.name not in FILE_OPTIONS]
    bad = [f"--trainer.algorithm.init_args.{f.name}={_cli(_invalid(f))}" for f in options]
    t0 = time.perf_counter()
    status = main(cli_fit_args(assets, tmp_path, f"--trainer.algorithm={name}", *bad)[3:])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err, err
    lines = err.splitlines()
    for f in options:
        naming = [line for line in lines if line.strip().startswith(f"trainer.algorithm.{f.name}:")]
        assert len(naming) == 1, (name, f.name, err)
    assert (
        time.perf_counter() - t0 < scaled(10) and not (tmp_path / "run").exists()
    )  # nothing loaded or written


@pytest.mark.parametrize("name", NAMES)
def test_a_switch_given_a_non_boolean_is_refused_naming_it(name, capsys):
    for f in (f for f in _options(name) if isinstance(f.default, bool)):
        argv = [f"--trainer.algorithm={name}", f"--trainer.algorithm.init_args.{f.name}=maybe"]
        try:
            status = main(
                ["fit", "--policy.model_path=m", "--task.train_path=t", "--task.test_path=t", *argv]
            )
        except SystemExit as exc:
            status = exc.code
        err = capsys.readouterr().err
        assert status == 2 and len(err.strip().splitlines()) == 1 and f.name in err, (name, f.name, err)


#: every option of the critic (``task.critic``, a ``ValueModel``): a value in range, one out of it
CRITIC_OPTIONS = {
    "lr": (0.003, -1.0),
    "weight_decay": (0.01, -0.1),
    "betas": ([0.8, 0.9], [0.8, 1.5]),
    "max_grad_norm": (0.5, -1.0),
    "dtype": ("bfloat16", "float8"),
    "train_micro_batch_size": (4, 0),
}


def test_every_critic_option_is_set_from_the_command_line(assets):
    parser = build_parser()
    argv = ["fit", f"--policy.model_path={assets['sft']}", "--task.train_path=t", "--task.test_path=t"]
    argv += ["--trainer.algorithm=ppo", f"--task.critic.model_path={assets['sft']}"]
    argv += [f"--task.critic.{k}={_cli(good)}" for k, (good, _) in CRITIC_OPTIONS.items()]
    cfg = parser.parse_args(algorithm_names_as_classes(argv))
    critic = subcommand_parser(parser, "fit").instantiate(cfg.fit).task.critic
    assert critic.model_path == str(assets["sft"])
    for key, (good, _) in CRITIC_OPTIONS.items():
        assert getattr(critic, key) == (tuple(good) if key == "betas" else good), key
    assert critic.validate_config() == []


def test_an_out_of_range_critic_option_is_refused_with_one_line_naming_it(assets, tmp_path, capsys):
    bad = [f"--task.critic.{k}={_cli(wrong)}" for k, (_, wrong) in CRITIC_OPTIONS.items()]
    bad.append("--task.critic.model_path=/no/such/model")
    status = main(cli_fit_args(assets, tmp_path, "--trainer.algorithm=ppo", *bad)[3:])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err, err
    lines = [line.strip() for line in err.splitlines()]
    for key in (*CRITIC_OPTIONS, "model_path"):
        assert len([line for line in lines if line.startswith(f"task.critic.{key}:")]) == 1, (key, err)
    assert not (tmp_path / "run").exists()  # nothing loaded or written
